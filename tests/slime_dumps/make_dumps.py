"""Build the slime debug-dump fixtures with slime's own writers, offline, on the CPU:

    python tests/slime_dumps/make_dumps.py --slime SLIME_CHECKOUT [--out examples/slime-dump-details]

SLIME_CHECKOUT: a checkout of THUDM/slime at the commit this script names (COMMIT); its `slime/` package is
imported from there (it needs torch, numpy and httpx only). What it writes is a `--dump-details` directory as
slime writes one for three rollouts of a run with two data-parallel ranks:

- rollout_data/{id}.pt: slime.observability.rollout_data_utils.save_debug_rollout_data, on slime `Sample`s
  whose token ids are the fixture tokenizer's (rlbench/fixtures/tokenizers/qwen-tiny), and eval_{id}.pt for
  rollout 0 (an eval dump, which an import skips);
- tokenizer/: the run's tokenizer (the fixture's), saved as slime's data source saves it;
- with --v1-writer: tests/slime_dumps/v1/train_data/{id}_{rank}.pt, the same ranks' data in slime's format 1
  (2 DP x 2 TP copies), and tests/slime_dumps/v1-cp/train_data/, the same with context parallelism 2 and two
  pipeline stages (slime's own slice_log_prob_with_cp cutting each CP rank's slices; the first stage without
  what the trainer computes);
- with --miles MILES_CHECKOUT (radixark/miles at MILES_COMMIT): tests/slime_dumps/miles-cp/train_data/, the
  same in Miles' format 1 with context parallelism 2 (Miles' own save_debug_train_data_for_rank, which records
  cp_rank, cp_size and qkv_format, and Miles' slice_log_prob_with_cp); and tests/slime_dumps/miles-rollout/, the
  same samples as Miles' Samples written by Miles' own save_debug_rollout_data (rollout_data/{id}.pt with its
  `metadata`, and trajectory/{id}.jsonl: the conversations of the samples that have one, popped from the .pt);
- tests/slime_dumps/expected.json: slime's own train_rollout_logprob_abs_diff of each rollout (expected_metrics);
- train_data/{id}.pt: format 2, slime.observability.train_data_utils._build_dump_payload over what each DP
  rank holds after training (restore_context_parallel_fields_to_cpu with context parallelism 1, as the writer
  runs it), saved as save_debug_train_data saves it (torch.save of the payload). The values a trainer would
  compute (log_probs, ref_log_probs, advantages, returns, kl) are seeded numbers: the fixtures test reading,
  joining and comparing, not training.

The files are committed; tests never run slime. Rerun this only to change them, and say so in the commit.
"""

from __future__ import annotations

import argparse
import random
import sys
from argparse import Namespace
from pathlib import Path

COMMIT = "624b824a8"  # THUDM/slime, 2026-08-21 ("[NFC] Add observability subfolder (#2298)")
MILES_COMMIT = "31f1ca961"  # radixark/miles, 2026-08-21
ROLLOUTS, PROMPTS, PER_PROMPT, DP = 3, 2, 4, 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slime", required=True, help=f"a checkout of THUDM/slime at {COMMIT}")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[2] / "examples" / "slime-dump-details"))
    parser.add_argument(
        "--v1-writer",
        help="slime's format-1 writer, `git show 681b3adca^:slime/utils/train_dump_utils.py` of slime's history: "
        "with it, the same ranks' data is also written in format 1 (4 ranks: 2 DP x 2 TP copies) to --out-v1",
    )
    parser.add_argument("--out-v1", default=str(Path(__file__).resolve().parent / "v1" / "train_data"))
    parser.add_argument("--miles", help=f"a checkout of radixark/miles at {MILES_COMMIT} (its miles/ files are loaded)")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(args.slime).resolve()))
    import torch
    from slime.observability.rollout_data_utils import save_debug_rollout_data
    from slime.observability.train_data_utils import _build_dump_payload, restore_context_parallel_fields_to_cpu
    from slime.utils.types import Sample

    out = Path(args.out)
    rng = random.Random(20261127)
    for rollout_id in range(ROLLOUTS):
        samples = make_samples(rng, rollout_id, Sample)
        template = str(out / "rollout_data" / "{rollout_id}.pt")
        save_debug_rollout_data(template, samples, rollout_id=rollout_id, evaluation=False)
        if rollout_id == 0:
            save_debug_rollout_data(template, {"toy": {"samples": samples[:2]}}, rollout_id=0, evaluation=True)

        def shard(partition: list[int], samples: list = samples) -> dict:
            """One DP rank's rollout_data at dump time: its rows (positions in the rollout dump) and what the
            trainer computed for them."""
            rows = [samples[p] for p in partition]
            per_token = {
                name: [torch.tensor([round(rng.gauss(0, 1), 4) for _ in range(s.response_length)]) for s in rows]
                for name in ("log_probs", "ref_log_probs", "kl")
            }
            advantages = [torch.full((s.response_length,), round(rng.gauss(0, 1), 4)) for s in rows]
            return restore_context_parallel_fields_to_cpu(
                {
                    "partition": list(partition),
                    "tokens": [torch.tensor(s.tokens) for s in rows],
                    "response_lengths": [s.response_length for s in rows],
                    "total_lengths": [len(s.tokens) for s in rows],
                    "rewards": [s.reward - 0.5 for s in rows],
                    "raw_reward": [s.reward for s in samples],  # the whole batch, in the rollout dump's order
                    "local_raw_reward": [s.reward for s in rows],
                    "truncated": [0 for _ in rows],
                    "sample_indices": [s.index for s in rows],
                    "rollout_ids": list(partition),
                    "loss_masks": [torch.tensor(s.loss_mask, dtype=torch.int32) for s in rows],
                    "rollout_mask_sums": torch.tensor([float(sum(s.loss_mask)) for s in rows]),
                    "rollout_log_probs": [torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in rows],
                    **per_token,
                    "advantages": advantages,
                    "returns": [a.clone() for a in advantages],
                    "micro_batch_indices": [[0, 1], [2, 3]],  # local rows, two micro-batches of two
                    "num_microbatches": [2],
                    "global_batch_sizes": [len(samples)],
                },
                lambda value, _total, _response: value,  # context parallelism 1: each rank holds the whole value
                keep_restored=True,
            )

        positions = list(range(len(samples)))
        shards = [{"rank": r, "data_parallel_rank": r, "rollout_data": shard(positions[r::DP])} for r in range(DP)]
        if args.v1_writer:  # before the payload is built from them: format 1 saved each rank's rollout_data as is
            write_v1(args.v1_writer, Path(args.out_v1), rollout_id, shards)
            write_v1_cp(args.v1_writer, Path(args.out_v1).parent.parent / "v1-cp" / "train_data", rollout_id, shards)
        if args.miles:
            write_miles_rollouts(
                Path(args.miles), Path(args.out_v1).parent.parent / "miles-rollout", rollout_id, samples
            )
            write_miles_cp(
                Path(args.miles), Path(args.out_v1).parent.parent / "miles-cp" / "train_data", rollout_id, shards
            )
        path = out / "train_data" / f"{rollout_id}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(_build_dump_payload(shards, rollout_id=rollout_id, writer_rank=0), path)
    expected_metrics(out, Path(__file__).resolve().parent / "expected.json")
    # slime's data source saves the run's tokenizer beside the dumps (rollout/data_source.py: save_pretrained)
    from transformers import AutoTokenizer

    fixture = Path(__file__).resolve().parents[2] / "rlbench" / "fixtures" / "tokenizers" / "qwen-tiny"
    AutoTokenizer.from_pretrained(fixture).save_pretrained(out / "tokenizer")
    print(f"wrote {out} with slime {COMMIT}'s writers")


def make_samples(rng: random.Random, rollout_id: int, sample_class) -> list:
    """A rollout's slime Samples (`sample_class`: slime.utils.types.Sample): PROMPTS groups of PER_PROMPT, seeded
    ids, rewards and log-probs, a tool span (loss mask 0) in one sample a group."""
    samples = []
    for g in range(PROMPTS):
        prompt = [rng.randrange(3, 300) for _ in range(6 + g)]
        for j in range(PER_PROMPT):
            n = rng.randrange(3, 8)
            response = [rng.randrange(3, 300) for _ in range(n)]
            mask = [1] * n if j != 1 else [1, 1] + [0] * (n - 3) + [1]
            samples.append(
                sample_class(
                    group_index=rollout_id * PROMPTS + g,
                    index=(rollout_id * PROMPTS + g) * PER_PROMPT + j,  # slime's data source: a run-wide count
                    prompt=f"prompt {g}",
                    tokens=prompt + response,
                    response=f"response {j}",
                    response_length=n,
                    label="even",
                    reward=float(rng.randrange(2)),
                    loss_mask=mask,
                    rollout_log_probs=[round(-rng.random() * 3, 4) for _ in range(n)],
                    status=sample_class.Status.COMPLETED,
                )
            )
    return samples


def write_v1(writer: str, out: Path, rollout_id: int, shards: list[dict]) -> None:
    """Format 1 as slime wrote it before 681b3adca: each rank's rollout_data (its rows without their positions:
    process_rollout_data popped `partition`) saved by slime's own writer, once per rank, tensor-parallel ranks
    (rank = 2 * dp + tp) writing the same rows."""
    import copy
    import importlib.util
    from argparse import Namespace

    import torch

    spec = importlib.util.spec_from_file_location("slime_v1_train_dump_utils", writer)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    get_rank = torch.distributed.get_rank
    try:
        for shard in shards:
            for tp in range(2):
                data = copy.deepcopy(shard["rollout_data"])
                data.pop("partition")
                rank = 2 * shard["data_parallel_rank"] + tp
                torch.distributed.get_rank = lambda *a, _rank=rank, **k: _rank
                template = str(out / "{rollout_id}_{rank}.pt")
                module.save_debug_train_data(
                    Namespace(save_debug_train_data=template), rollout_id=rollout_id, rollout_data=data
                )
    finally:
        torch.distributed.get_rank = get_rank


COMPUTED = ("log_probs", "ref_log_probs", "kl", "advantages", "returns")  # on the last pipeline stage only
CP_SPLIT = ("rollout_log_probs", "log_probs", "ref_log_probs", "kl", "advantages", "returns")  # what CP slices


def _load(name: str, path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def write_v1_cp(writer: str, out: Path, rollout_id: int, shards: list[dict]) -> None:
    """slime's format 1 with context parallelism 2 and pipeline parallelism 2 (tensor parallelism 1): megatron's
    rank order (tp-cp-ep-dp-pp) gives rank = cp + 2 * dp + 4 * pp; each CP rank's per-token fields cut by slime's
    own slice_log_prob_with_cp (cp_utils.py, megatron's mpu answering its CP rank and size); the first stage
    holds no computed field. Written by slime's own format-1 writer, which records no CP rank."""
    import copy
    import types

    import megatron.core
    import torch

    module = _load("slime_v1_train_dump_utils", Path(writer))
    state = {"cp_rank": 0}
    mpu = types.ModuleType("megatron.core.mpu")
    mpu.get_context_parallel_world_size = lambda: 2
    mpu.get_context_parallel_rank = lambda: state["cp_rank"]
    sys.modules["megatron.core.mpu"] = megatron.core.mpu = mpu
    from slime.backends.megatron_utils import cp_utils

    cp_utils.mpu = mpu
    get_rank = torch.distributed.get_rank
    try:
        for shard in shards:
            for pp in range(2):
                for cp in range(2):
                    state["cp_rank"] = cp
                    data = copy.deepcopy(shard["rollout_data"])
                    data.pop("partition")
                    if pp == 0:
                        for name in COMPUTED:
                            data.pop(name)
                    for name in CP_SPLIT:
                        if name in data:
                            data[name] = [
                                cp_utils.slice_log_prob_with_cp(v, t, r)
                                for v, t, r in zip(data[name], data["total_lengths"], data["response_lengths"])
                            ]
                    rank = cp + 2 * shard["data_parallel_rank"] + 4 * pp
                    torch.distributed.get_rank = lambda *a, _rank=rank, **k: _rank
                    module.save_debug_train_data(
                        Namespace(save_debug_train_data=str(out / "{rollout_id}_{rank}.pt")),
                        rollout_id=rollout_id,
                        rollout_data=data,
                    )
    finally:
        torch.distributed.get_rank = get_rank


def _miles_stubs(miles: Path, state) -> None:
    """Miles' packages as empty namespaces, and its parallel state answering `state` (what Miles' modules import)."""
    import types

    for name in (
        "miles",
        "miles.backends",
        "miles.backends.training_utils",
        "miles.utils",
        "miles.ray",
        "miles.ray.rollout",
    ):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = []
            sys.modules[name] = package
    parallel = types.ModuleType("miles.backends.training_utils.parallel")
    parallel.get_parallel_state = lambda: state
    sys.modules[parallel.__name__] = parallel


def write_miles_rollouts(miles: Path, out: Path, rollout_id: int, slime_samples: list) -> None:
    """The rollout's samples as Miles' Samples (miles/utils/types.py), each group's second sample with a
    conversation in metadata["messages"], saved by Miles' own save_debug_rollout_data (miles/ray/rollout/
    debug_data.py) with --dump-details' templates and a metadata dict as Miles' rollout manager passes."""
    import types

    _miles_stubs(miles, None)
    miles_types = _load("miles.utils.types", miles / "miles/utils/types.py")
    debug_data = _load("miles.ray.rollout.debug_data", miles / "miles/ray/rollout/debug_data.py")
    samples = []
    for k, s in enumerate(slime_samples):
        sample = miles_types.Sample(
            group_index=s.group_index,
            index=s.index,
            prompt=s.prompt,
            tokens=list(s.tokens),
            response=s.response,
            response_length=s.response_length,
            label=s.label,
            reward=s.reward,
            loss_mask=list(s.loss_mask),
            rollout_log_probs=list(s.rollout_log_probs),
            status=miles_types.Sample.Status.COMPLETED,
        )
        if k % 4 == 1:
            sample.metadata["messages"] = [
                {"role": "user", "content": s.prompt},
                {"role": "assistant", "content": s.response},
            ]
        samples.append(sample)
    args = types.SimpleNamespace(
        save_debug_rollout_data=str(out / "rollout_data" / "{rollout_id}.pt"),
        save_debug_trajectory_data=str(out / "trajectory" / "{rollout_id}.jsonl"),
    )
    debug_data.save_debug_rollout_data(
        args, samples, rollout_id, evaluation=False, metadata={"prompt_group_sizes": [4, 4]}
    )


def write_miles_cp(miles: Path, out: Path, rollout_id: int, shards: list[dict]) -> None:
    """Miles' format 1 with context parallelism 2 (DP 2, rank = cp + 2 * dp): Miles' own
    save_debug_train_data_for_rank (miles/utils/train_dump_utils.py), which records cp_rank, cp_size and
    qkv_format, each CP rank's fields cut by Miles' own slice_log_prob_with_cp (miles/backends/training_utils/
    cp_utils.py, its parallel state answering the CP rank and size)."""
    import copy
    import types

    state = types.SimpleNamespace(cp=types.SimpleNamespace(rank=0, size=2))
    _miles_stubs(miles, state)
    cp_utils = _load("miles.backends.training_utils.cp_utils", miles / "miles/backends/training_utils/cp_utils.py")
    writer = _load("miles.utils.train_dump_utils", miles / "miles/utils/train_dump_utils.py")
    for shard in shards:
        for cp in range(2):
            state.cp.rank = cp
            data = copy.deepcopy(shard["rollout_data"])
            data.pop("partition")  # Miles pops it too (train_data_conversion.py)
            for name in CP_SPLIT:
                data[name] = [
                    cp_utils.slice_log_prob_with_cp(v, t, r)
                    for v, t, r in zip(data[name], data["total_lengths"], data["response_lengths"])
                ]
            writer.save_debug_train_data_for_rank(
                Namespace(save_debug_train_data=str(out / "{rollout_id}_{rank}.pt"), qkv_format="thd"),
                rollout_id=rollout_id,
                rollout_data=data,
                rank=cp + 2 * shard["data_parallel_rank"],
                cp_rank=cp,
                cp_size=2,
            )


def expected_metrics(dumps: Path, path: Path) -> None:
    """slime's train_rollout_logprob_abs_diff of each rollout, computed by slime's own reducer on the train dump's
    tensors: loss.py's sum_of_sample_mean(|log_probs - rollout_log_probs|) with slime/backends/megatron_utils/
    cp_utils.py's get_sum_of_sample_mean (context parallelism 1: megatron-core's mpu stood in for by the two answers
    it gives there), over the step's rollouts (its global batch size), as the logged metric is reduced."""
    import json
    import types

    import megatron.core
    import torch

    mpu = types.ModuleType("megatron.core.mpu")
    mpu.get_context_parallel_world_size = lambda: 1
    mpu.get_context_parallel_rank = lambda: 0
    sys.modules["megatron.core.mpu"] = megatron.core.mpu = mpu
    from slime.backends.megatron_utils import cp_utils

    cp_utils.mpu = mpu  # where write_v1_cp imported it first
    get_sum_of_sample_mean = cp_utils.get_sum_of_sample_mean

    values = {}
    for file in sorted((dumps / "train_data").glob("*.pt")):
        dump = torch.load(file, weights_only=True)
        samples = dump["samples"]
        reduce = get_sum_of_sample_mean(
            [s["total_lengths"] for s in samples],
            [s["response_lengths"] for s in samples],
            [s["loss_masks"] for s in samples],
            [s["rollout_mask_sums"] for s in samples],
        )
        delta = torch.cat([(s["log_probs"] - s["rollout_log_probs"]).abs() for s in samples])
        rollouts = dump["dp_shards"][0]["global_batch_sizes"][0]
        values[str(dump["rollout_id"])] = float(reduce(delta)) / rollouts
    path.write_text(
        json.dumps({"slime_commit": COMMIT, "train_rollout_logprob_abs_diff": values}, indent=1, sort_keys=True) + "\n"
    )


if __name__ == "__main__":
    main()
