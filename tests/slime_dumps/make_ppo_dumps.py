"""Build tests/slime_dumps/ppo/, a `--dump-details` directory of a slime PPO run, with slime's own code, offline:

    python tests/slime_dumps/make_ppo_dumps.py --slime SLIME_CHECKOUT [--out tests/slime_dumps/ppo]

SLIME_CHECKOUT: THUDM/slime at make_dumps.COMMIT, imported under tests/conformance/slime/build_expected.py's
single-process shims. Three rollouts of two prompts x 4 samples (a tool span, loss mask 0, in one sample a group),
two data-parallel ranks, as slime 624b824a writes them for `--advantage-estimator ppo --num-critic-only-steps 1
--normalize-advantages`:

- rollout_data/{0,1,2}.pt: save_debug_rollout_data on slime Samples (the fixture tokenizer's ids);
- train_data/{1,2}.pt only: rollout 0 is the critic's alone (train.py: the actor neither computes nor dumps), so it
  has no train dump; each is _build_dump_payload over the two ranks' rollout_data, which holds the critic's
  `values` (seeded numbers on every response token, as the critic's forward gives them) and the advantages and
  returns slime's own compute_advantages_and_returns computes from them (the ppo branch: the raw reward on the last
  response token, chunked GAE at gamma = lambd = 1, whitened over the step's trained tokens), over the whole batch
  (the DP group's statistics), then split between the ranks; the trainer's log-probs seeded;
- tokenizer/: the run's tokenizer, as slime's data source saves it.

Committed; tests never run slime. Rerun only to change them, and say so in the commit.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ROLLOUTS, DP, CRITIC_ONLY = 3, 2, 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slime", required=True, type=Path)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "ppo"))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from tests.conformance.slime.build_expected import install_shims, slime_args
    from tests.slime_dumps.make_dumps import make_samples

    install_shims(args.slime.resolve())
    import torch
    from slime.backends.megatron_utils.loss import compute_advantages_and_returns
    from slime.observability.rollout_data_utils import save_debug_rollout_data
    from slime.observability.train_data_utils import _build_dump_payload, restore_context_parallel_fields_to_cpu
    from slime.utils.types import Sample

    torch.set_num_threads(1)
    out = Path(args.out)
    rng = random.Random(20261129)
    ppo = slime_args(advantage_estimator="ppo", normalize_advantages=True, gamma=1.0, lambd=1.0)
    for rollout_id in range(ROLLOUTS):
        samples = make_samples(rng, rollout_id, Sample)
        save_debug_rollout_data(
            str(out / "rollout_data" / "{rollout_id}.pt"), samples, rollout_id=rollout_id, evaluation=False
        )
        if rollout_id < CRITIC_ONLY:
            continue
        batch = {
            "rewards": [s.reward for s in samples],  # ppo: raw
            "values": [
                torch.tensor([round(rng.gauss(0.5, 0.3), 4) for _ in range(s.response_length)]) for s in samples
            ],
            "response_lengths": [s.response_length for s in samples],
            "total_lengths": [len(s.tokens) for s in samples],
            "loss_masks": [torch.tensor(s.loss_mask, dtype=torch.int32) for s in samples],
        }
        compute_advantages_and_returns(ppo, batch)  # slime's: kl (zeros), advantages, returns

        def shard(partition: list[int], samples: list = samples, batch: dict = batch) -> dict:
            rows = [samples[p] for p in partition]
            seeded = {
                name: [torch.tensor([round(rng.gauss(0, 1), 4) for _ in range(s.response_length)]) for s in rows]
                for name in ("log_probs",)
            }
            return restore_context_parallel_fields_to_cpu(
                {
                    "partition": list(partition),
                    "tokens": [torch.tensor(s.tokens) for s in rows],
                    "response_lengths": [s.response_length for s in rows],
                    "total_lengths": [len(s.tokens) for s in rows],
                    "rewards": [s.reward for s in rows],
                    "raw_reward": [s.reward for s in samples],
                    "truncated": [0 for _ in rows],
                    "sample_indices": [s.index for s in rows],
                    "rollout_ids": list(partition),
                    "loss_masks": [torch.tensor(s.loss_mask, dtype=torch.int32) for s in rows],
                    "rollout_mask_sums": torch.tensor([float(sum(s.loss_mask)) for s in rows]),
                    "rollout_log_probs": [torch.tensor(s.rollout_log_probs, dtype=torch.float32) for s in rows],
                    **seeded,
                    **{key: [batch[key][p] for p in partition] for key in ("values", "kl", "advantages", "returns")},
                    "micro_batch_indices": [[0, 1], [2, 3]],
                    "num_microbatches": [2],
                    "global_batch_sizes": [len(samples)],
                },
                lambda value, _total, _response: value,
                keep_restored=True,
            )

        positions = list(range(len(samples)))
        shards = [{"rank": r, "data_parallel_rank": r, "rollout_data": shard(positions[r::DP])} for r in range(DP)]
        path = out / "train_data" / f"{rollout_id}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(_build_dump_payload(shards, rollout_id=rollout_id, writer_rank=0), path)
    from transformers import AutoTokenizer

    fixture = ROOT / "rlbench" / "fixtures" / "tokenizers" / "qwen-tiny"
    AutoTokenizer.from_pretrained(fixture).save_pretrained(out / "tokenizer")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
