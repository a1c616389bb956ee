"""Build tests/conformance/slime/dumps/ with slime's own code; run once, by hand, and commit its output:

    python tests/conformance/slime/build_dumps.py --slime /tmp/slime --out tests/conformance/slime/dumps/

`--slime` is a checkout of THUDM/slime (outside this repository); its commit is recorded in the output
(a tree without .git needs `--commit SHA`). Nothing of slime is copied: its modules are imported from
that path, and only what they write is kept.

Each case is one `--save-debug-rollout-data` file written by slime's `save_debug_rollout_data`
(slime/observability/rollout_data_utils.py) from samples made with slime's `Sample` and its
`append_response_tokens` (slime/utils/types.py), as slime's rollouts make them: engine outputs
appended with their log-probs and SGLang's meta_info (finish reason, weight version, the top-p nucleus
as int32 bytes), tool observations appended as not trainable (loss mask 0, log-prob 0.0, an empty
nucleus). The log-probs are slime's `get_log_probs_and_entropy` (slime/backends/megatron_utils/loss.py)
over the fixture model's logits (rlbench/fixtures/models/tiny-qwen3, random weights of seed 1234 through
rlbench.core.model.build_model), given the recorded nucleus where there is one: the log-probs
renormalised over the nucleus, which is what slime's engine reports under --rollout-top-p < 1 and what
slime's trainer computes to match it. The nucleus is SGLang's top-p rule (the most likely ids until
their mass reaches top-p), and the top-p case's ids are sampled from it with a seeded generator.

The cases: removed (a remove_sample sample whose log-probs are another policy's), top_p, no_logprobs
(one group's samples made by a generate function that reports no log-probs), tool_span (a tool
observation inside the response; prompts with content-part lists and a tool call of content null),
unequal_groups (groups of 3 and 2; teacher log-probs and train metadata set), multimodal, and eval
(slime's eval_<id> file). cases.json records slime's commit, the sha256 of each slime file read,
Sample's field names, the settings, and per case the facts tests/conformance/slime/test_dumps.py holds
rlbench's import to.

Single-process shims (slime is written for a Megatron job): modules slime imports but never calls here
(httpx, pybase64) are placeholders where not installed; megatron's mpu, read by the log-prob function,
answers as the one rank of every group.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
import types
from argparse import Namespace
from pathlib import Path

import numpy as np
import torch
from build_expected import commit_of, slime_parser  # a sibling script (these run as scripts)

REPO = Path(__file__).resolve().parents[3]
SCHEMA = "rlbench.conformance.slime-dumps/1"
MODEL = "rlbench/fixtures/models/tiny-qwen3"
TOKENIZER = "rlbench/fixtures/tokenizers/qwen-tiny"
SEED, TEMPERATURE, TOP_P = 1234, 1.0, 0.5
READ = (
    "slime/utils/types.py",
    "slime/observability/rollout_data_utils.py",
    "slime/backends/megatron_utils/loss.py",
    "slime/utils/ppo_utils.py",
    "slime/utils/misc.py",
)
PLACEHOLDERS = ("httpx", "pybase64")


class _Placeholder(types.ModuleType):
    """A module slime imports but this script never calls: every attribute is an inert class."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (), {})


def _slime(path: Path) -> Namespace:
    """slime's modules this script calls, imported from the checkout at `path`."""
    for name in PLACEHOLDERS:
        if importlib.util.find_spec(name) is None:
            sys.modules[name] = _Placeholder(name)
    sys.path.insert(0, str(path))
    from slime.backends.megatron_utils import loss
    from slime.observability import rollout_data_utils
    from slime.utils import types as slime_types

    loss.mpu = Namespace(
        get_context_parallel_world_size=lambda: 1,
        get_context_parallel_rank=lambda: 0,
        get_tensor_model_parallel_rank=lambda: 0,
        get_tensor_model_parallel_group=lambda: None,
    )
    return Namespace(Sample=slime_types.Sample, save=rollout_data_utils.save_debug_rollout_data, loss=loss)


class Maker:
    """Samples in slime's shape, with the fixture model's log-probs as slime computes them."""

    def __init__(self, slime: Namespace):
        sys.path.insert(0, str(REPO))
        from rlbench.core.model import build_model, load_tokenizer

        self.slime, self.tok = slime, load_tokenizer(REPO / TOKENIZER)
        self.model = build_model(REPO / MODEL, SEED, init="random").eval()
        self.args = Namespace()  # what append_response_tokens reads of slime's arguments: nothing set

    def prompt(self, number: int) -> tuple[list[dict], list[int]]:
        messages = [{"role": "user", "content": f"Is {number} even or odd?"}]
        return messages, list(
            self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
        )

    def logits(self, tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.model(input_ids=torch.tensor([tokens]), use_cache=False).logits.float()

    def logprobs(self, tokens: list[int], response: int, nucleus=None, temperature: float = TEMPERATURE) -> list[float]:
        """slime's trainer-side log-probs of the last `response` ids (over the nucleus, where given)."""
        args = Namespace(rollout_temperature=temperature, log_probs_chunk_size=-1, allgather_cp=False, entropy_coef=0.0)
        extra = {} if nucleus is None else {"top_p_token_ids": [nucleus[0]], "top_p_token_offsets": [nucleus[1]]}
        _, res = self.slime.loss.get_log_probs_and_entropy(
            self.logits(tokens),
            args=args,
            unconcat_tokens=[torch.tensor(tokens)],
            total_lengths=[len(tokens)],
            response_lengths=[response],
            **extra,
        )
        return res["log_probs"][0].tolist()

    def sample(self, group: int, index: int, messages, prompt: list[int], number: int):
        return self.slime.Sample(
            group_index=group, index=index, prompt=messages, tokens=list(prompt), label=("even", "odd")[number % 2]
        )

    def engine_output(
        self, sample, ids: list[int], logprobs: list[float], finish: str = "stop", nucleus=None, text: str | None = None
    ) -> None:
        """Append what SGLang returned for one generate call, as slime's rollout does."""
        meta = {
            "finish_reason": {"type": finish},
            "weight_version": "1",
            "prompt_tokens": len(sample.tokens),
            "cached_tokens": 0,
        }
        if nucleus is not None:
            meta["top_p_token_ids"] = np.asarray(nucleus[0], dtype=np.int32).tobytes()
            meta["top_p_token_offsets"] = np.asarray(nucleus[1], dtype=np.int32).tobytes()
        sample.append_response_tokens(
            self.args,
            tokens=ids,
            log_probs=logprobs,
            trainable=True,
            meta_info=meta,
            text=self.tok.decode(ids) if text is None else text,
        )

    def answered(self, group: int, index: int, number: int, answer: str, temperature: float = TEMPERATURE):
        """A one-turn sample answering `answer` (canonical ids and the end of turn), rewarded 1 when right."""
        messages, prompt = self.prompt(number)
        ids = self.tok.encode(answer) + [self.tok.eos_token_id]
        sample = self.sample(group, index, messages, prompt, number)
        self.engine_output(sample, ids, self.logprobs(prompt + ids, len(ids), temperature=temperature), text=answer)
        sample.reward = float(answer == sample.label)
        return sample

    def nucleus(self, logits: torch.Tensor) -> list[int]:
        """SGLang's top-p rule: the most likely ids, in order, while the mass before each is below top-p."""
        probs = torch.softmax(logits / TEMPERATURE, dim=-1)
        sorted_probs, order = probs.sort(descending=True)
        keep = (sorted_probs.cumsum(0) - sorted_probs) < TOP_P
        return order[keep].tolist()

    def sampled_top_p(self, group: int, index: int, number: int, generator: torch.Generator, most: int = 6):
        """A sample whose ids are drawn from each step's nucleus, renormalised, as the engine samples."""
        messages, prompt = self.prompt(number)
        tokens, kept, offsets = list(prompt), [], [0]
        for _ in range(most):
            logits = self.logits(tokens)[0, -1]
            ids = self.nucleus(logits)
            probs = torch.softmax(logits[ids] / TEMPERATURE, dim=-1)
            tokens.append(ids[int(torch.multinomial(probs, 1, generator=generator))])
            kept += ids
            offsets.append(len(kept))
            if tokens[-1] == self.tok.eos_token_id:
                break
        response = tokens[len(prompt) :]
        sample = self.sample(group, index, messages, prompt, number)
        self.engine_output(
            sample,
            response,
            self.logprobs(tokens, len(response), (kept, offsets)),
            "stop" if response[-1] == self.tok.eos_token_id else "length",
            (kept, offsets),
        )
        sample.reward = float(index % 2)
        return sample


def _non_canonical_pieces(tok, texts: list[str]) -> tuple[str, list[int]]:
    """A text and a piecewise encoding of it that is not its canonical encoding (an environment that
    tokenises its output in pieces), the first text of `texts` that has one."""
    for text in texts:
        canon = tok.encode(text)
        for k in range(1, len(text)):
            pieces = tok.encode(text[:k]) + tok.encode(text[k:])
            if pieces != canon:
                return text, pieces
    raise SystemExit("no piecewise encoding differs from the canonical one")


def case_removed(make: Maker) -> tuple[list, dict]:
    samples = [make.answered(g, 2 * g + j, 4 + g, ("even", "odd")[j]) for g in range(2) for j in range(2)]
    # a sample slime removed (a filter): its log-probs are another policy's, so judging it would flag a mismatch
    samples[3] = make.answered(1, 3, 5, "odd", temperature=0.5)
    samples[3].remove_sample = True
    return samples, {"removed": [3], "rewards": [s.reward for s in samples]}


def case_top_p(make: Maker) -> tuple[list, dict]:
    generator = torch.Generator().manual_seed(SEED)
    samples = [make.sampled_top_p(g, 2 * g + j, 6 + g, generator) for g in range(2) for j in range(2)]
    return samples, {"top_p": TOP_P, "nucleus_sizes": [len(s.rollout_top_p_token_ids) for s in samples]}


def case_no_logprobs(make: Maker) -> tuple[list, dict]:
    samples = [make.answered(0, j, 8, ("even", "odd")[j]) for j in range(2)]
    text, pieces = _non_canonical_pieces(make.tok, ["odd, since 9 is odd", "it is odd"])
    for j, ids in enumerate((make.tok.encode("odd") + [make.tok.eos_token_id], pieces + [make.tok.eos_token_id])):
        # a custom generate function that reports no log-probs: tokens set directly, rollout_log_probs None
        messages, prompt = make.prompt(9)
        sample = make.sample(1, 2 + j, messages, prompt, 9)
        sample.tokens, sample.response_length, sample.response = prompt + ids, len(ids), make.tok.decode(ids)
        sample.status, sample.reward = make.slime.Sample.Status.COMPLETED, 1.0
        samples.append(sample)
    return samples, {"without_logprobs": [2, 3], "non_canonical": [3]}


def case_tool_span(make: Maker) -> tuple[list, dict]:
    """Two turns around a tool observation: the observation is appended not trainable (loss mask 0, log-prob
    0.0) and tokenised in pieces, so it is not the canonical encoding of its text: judged as sampled ids
    it would look re-tokenised."""
    tok, eos = make.tok, make.tok.eos_token_id
    call = tok.encode("I will call the tool.")
    _, observation = _non_canonical_pieces(tok, ["\nthe tool says: twelve is even\n", "\nresult: even\n"])
    assert tok.encode(tok.decode(call + observation))[: len(call)] == call  # the drift is inside the observation
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "You can call a parity tool."}]},
        {"role": "user", "content": "Is 12 even or odd?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "parity", "arguments": {"n": 11}}}],
        },
        {"role": "tool", "content": "odd"},
        {"role": "user", "content": "And 12?"},
    ]
    _, prompt = make.prompt(12)
    samples = []
    for j, answer in enumerate(("even", "odd")):
        final = tok.encode(answer) + [eos]
        tokens = prompt + call + observation + final
        lps = make.logprobs(tokens, len(tokens) - len(prompt))
        sample = make.sample(0, j, messages, prompt, 12)
        make.engine_output(sample, call, lps[: len(call)], "stop")
        sample.append_response_tokens(make.args, tokens=observation, trainable=False, text=tok.decode(observation))
        make.engine_output(sample, final, lps[len(call) + len(observation) :], "stop", text=answer)
        sample.reward = float(j == 0)
        samples.append(sample)
    return samples, {"tool_span": [len(call), len(call) + len(observation)]}


def case_unequal_groups(make: Maker) -> tuple[list, dict]:
    sizes = (3, 2)
    samples = [
        make.answered(g, sum(sizes[:g]) + j, 14 + g, ("even", "odd")[j % 2])
        for g, size in enumerate(sizes)
        for j in range(size)
    ]
    for s in samples:  # kept in the recording; named as not used by replay
        s.teacher_log_probs = [lp - 0.1 for lp in s.rollout_log_probs]
        s.train_metadata = {"loss": "policy"}
        s.metadata = {"raw_reward": s.reward, "source": "parity"}
        s.session_id = f"session-{s.index}"
    return samples, {"group_sizes": list(sizes)}


def case_multimodal(make: Maker) -> tuple[list, dict]:
    samples = [make.answered(0, j, 16, ("even", "odd")[j]) for j in range(2)]
    samples[1].multimodal_inputs = {"images": [torch.zeros(2, 2, 3, dtype=torch.uint8)]}
    samples[1].multimodal_train_inputs = {"pixel_values": torch.zeros(1, 4)}
    return samples, {"refused_field": "multimodal_inputs"}


CASES = {
    "removed": case_removed,
    "top_p": case_top_p,
    "no_logprobs": case_no_logprobs,
    "tool_span": case_tool_span,
    "unequal_groups": case_unequal_groups,
    "multimodal": case_multimodal,
}


def build(slime_path: Path, out: Path, commit: str) -> dict:
    slime = _slime(slime_path)
    make = Maker(slime)
    cases = {}
    for name, case in CASES.items():
        samples, facts = case(make)
        slime.save(str(out / name / "rollout_{rollout_id}.pt"), samples, rollout_id=0, evaluation=False)
        cases[name] = {"file": f"{name}/rollout_0.pt", "samples": len(samples), **facts}
    evaluation = [make.answered(0, j, 18, ("even", "odd")[j]) for j in range(2)]
    slime.save(
        str(out / "eval" / "rollout_{rollout_id}.pt"),
        {"parity": {"samples": evaluation}},
        rollout_id=0,
        evaluation=True,
    )
    cases["eval"] = {"file": "eval/rollout_eval_0.pt", "samples": len(evaluation)}
    doc = {
        "schema": SCHEMA,
        "command": "python tests/conformance/slime/build_dumps.py --slime SLIME --out DIR",
        "slime": {
            "repo": "THUDM/slime",
            "commit": commit,
            "files": {f: hashlib.sha256((slime_path / f).read_bytes()).hexdigest() for f in READ},
        },
        "sample_fields": list(slime.Sample.__dataclass_fields__),
        "model": {"path": MODEL, "seed": SEED, "init": "random"},
        "tokenizer": TOKENIZER,
        "temperature": TEMPERATURE,
        "cases": cases,
    }
    (out / "cases.json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def main() -> int:
    parser = slime_parser(__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the directory to write the dumps and cases.json to")
    args = parser.parse_args()
    doc = build(args.slime.resolve(), args.out, commit_of(args.slime, args.commit))
    for name, case in doc["cases"].items():
        print(f"{name}: {case['file']} ({case['samples']} samples)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
