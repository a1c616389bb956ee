r"""Build expected_ppo.json from slime's own PPO functions; run once, by hand, and commit its output:

    python tests/conformance/slime/build_expected_ppo.py --slime /tmp/slime \
        --out tests/conformance/slime/expected_ppo.json

As build_expected.py (whose shims and argument defaults it uses): slime's modules are imported from `--slime`, called
on fixed, seeded inputs, and only their inputs and outputs are written, with slime's commit.

What slime is asked:
- gae cases: `chunked_gae` (slime/utils/ppo_utils.py; its ppo path's) and `vanilla_gae` (the recurrence it scans)
  on one response's dense seeded rewards and values at (gamma, lambd) in (1, 1), (0.99, 0.95), (1, 0), (0, 1), of
  1, 2, 5, 127, 128, 129 and 257 tokens (across chunked_gae's 128-token chunks), in float64 (slime's arithmetic
  without its rounding) and chunked_gae in float32 too (as slime runs it: the values' dtype);
- batch cases: `compute_advantages_and_returns` (slime/backends/megatron_utils/loss.py) with advantage_estimator
  "ppo", with and without --normalize-advantages, on ragged float32 values, a loss-mask-0 span, one at a response's
  last token and a sample with every token masked (slime's remove_sample): the per-token advantages and returns;
- value-loss cases: `value_loss_function` with slime's `get_sum_of_sample_mean` (per sample, and per token) at
  --value-clip 0.2 and 0.5 on new values some of which move past the clip: the loss and value_clipfrac.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.conformance.slime.build_expected import header, shimmed_slime, slime_args  # noqa: E402

SCHEMA = "rlbench.conformance.slime-ppo/1"
READ = (
    "slime/utils/ppo_utils.py",
    "slime/backends/megatron_utils/loss.py",
    "slime/backends/megatron_utils/cp_utils.py",
    "slime/utils/distributed_utils.py",
)
GAE_PARAMS = ((1.0, 1.0), (0.99, 0.95), (1.0, 0.0), (0.0, 1.0))
GAE_LENGTHS = (1, 2, 5, 127, 128, 129, 257)
# the batch: response lengths, a loss mask per sample (1 trained, 0 a tool span or a removed sample), rewards
RESPONSE_LENGTHS = [5, 3, 7, 4, 2, 6]
PROMPT_LENGTHS = [2, 3, 1, 2, 4, 2]
MASKS = [
    [1, 1, 1, 1, 1],
    [1, 1, 0],  # the last response token masked (the reward still sits on it)
    [1, 1, 0, 0, 1, 1, 1],  # a tool observation inside the response
    [1, 1, 1, 1],
    [0, 0],  # removed: trained on nothing
    [1, 1, 1, 1, 1, 1],
]
REWARDS = [1.0, 0.0, 1.0, -0.5, 1.0, 0.25]


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def gae_inputs() -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per response length: one sample's dense rewards and values, seeded, float64."""
    out = {}
    for length in GAE_LENGTHS:
        g = _generator(1000 + length)
        out[length] = (
            torch.randn(1, length, generator=g, dtype=torch.float64),
            0.5 * torch.randn(1, length, generator=g, dtype=torch.float64),
        )
    return out


def gae_cases() -> list[dict]:
    """chunked_gae (slime's ppo path) in float64 and float32, vanilla_gae in float64 (its reference recurrence)."""
    from slime.utils.ppo_utils import chunked_gae, vanilla_gae

    cases = []
    for length, (rewards, values) in gae_inputs().items():
        for gamma, lambd in GAE_PARAMS:
            for name, fn, dtype in (
                ("vanilla_gae", vanilla_gae, torch.float64),
                ("chunked_gae", chunked_gae, torch.float64),
                ("chunked_gae", chunked_gae, torch.float32),
            ):
                advantages, returns = fn(rewards.to(dtype), values.to(dtype), gamma, lambd)
                cases.append(
                    {
                        "name": f"{name}-T{length}-g{gamma}-l{lambd}-{str(dtype)[6:]}",
                        "function": name,
                        "length": length,
                        "dtype": str(dtype)[6:],
                        "gamma": gamma,
                        "lambd": lambd,
                        "advantages": advantages[0].double().tolist(),
                        "returns": returns[0].double().tolist(),
                    }
                )
    return cases


def _batch_values() -> list[torch.Tensor]:
    g = _generator(7)
    return [(0.5 * torch.randn(n, generator=g, dtype=torch.float64)).float() for n in RESPONSE_LENGTHS]


def batch_cases() -> list[dict]:
    from slime.backends.megatron_utils.loss import compute_advantages_and_returns

    cases = []
    for normalize in (False, True):
        for gamma, lambd in ((1.0, 1.0), (0.99, 0.95)):
            args = slime_args(advantage_estimator="ppo", normalize_advantages=normalize, gamma=gamma, lambd=lambd)
            data = {
                "rewards": list(REWARDS),
                "values": _batch_values(),
                "response_lengths": list(RESPONSE_LENGTHS),
                "total_lengths": [p + r for p, r in zip(PROMPT_LENGTHS, RESPONSE_LENGTHS)],
                "loss_masks": [torch.tensor(m, dtype=torch.int32) for m in MASKS],
            }
            compute_advantages_and_returns(args, data)
            cases.append(
                {
                    "name": f"ppo-normalize{int(normalize)}-g{gamma}-l{lambd}",
                    "normalize_advantages": normalize,
                    "gamma": gamma,
                    "lambd": lambd,
                    "values": [v.double().tolist() for v in _batch_values()],
                    "advantages": [a.double().tolist() for a in data["advantages"]],
                    "returns": [r.double().tolist() for r in data["returns"]],
                }
            )
    return cases


def value_loss_cases() -> list[dict]:
    from slime.backends.megatron_utils.cp_utils import get_sum_of_sample_mean
    from slime.backends.megatron_utils.loss import value_loss_function

    old = _batch_values()
    g = _generator(11)
    new = [o + 0.4 * torch.randn(len(o), generator=g, dtype=torch.float64).float() for o in old]
    returns = [(torch.randn(len(o), generator=g, dtype=torch.float64)).float() for o in old]
    totals = [p + r for p, r in zip(PROMPT_LENGTHS, RESPONSE_LENGTHS)]
    # the value head's output [1, T, 1] over the packed sequences: response token j of a sample at its position
    # prompt + j - 1 (get_values' shift); the other positions hold a value nothing reads
    logits = torch.full((1, sum(totals), 1), 9.0)
    start = 0
    for p, values in zip(PROMPT_LENGTHS, new):
        logits[0, start + p - 1 : start + p - 1 + len(values), 0] = values
        start += p + len(values)
    tokens = [torch.arange(t) for t in totals]
    cases = []
    for clip in (0.2, 0.5):
        for per_token in (False, True):
            args = slime_args(advantage_estimator="ppo", value_clip=clip, calculate_per_token_loss=per_token)
            masks = [torch.tensor(m, dtype=torch.int32) for m in MASKS]
            reduce = get_sum_of_sample_mean(totals, list(RESPONSE_LENGTHS), masks, calculate_per_token_loss=per_token)
            batch = {
                "values": old,
                "returns": returns,
                "unconcat_tokens": tokens,
                "total_lengths": totals,
                "response_lengths": list(RESPONSE_LENGTHS),
            }
            loss, metrics = value_loss_function(args, batch, logits, reduce)
            cases.append(
                {
                    "name": f"value-loss-clip{clip}-{'per-token' if per_token else 'per-sample'}",
                    "value_clip": clip,
                    "per_token": per_token,
                    "old_values": [o.double().tolist() for o in old],
                    "values": [v.double().tolist() for v in new],
                    "returns": [r.double().tolist() for r in returns],
                    "loss": float(loss),
                    "value_clipfrac": float(metrics["value_clipfrac"]),
                }
            )
    return cases


def main() -> int:
    args, commit = shimmed_slime(__doc__.splitlines()[0])
    document = {
        **header(SCHEMA, commit, READ, "tests/conformance/slime/build_expected_ppo.py"),
        "batch": {
            "response_lengths": RESPONSE_LENGTHS,
            "prompt_lengths": PROMPT_LENGTHS,
            "loss_masks": MASKS,
            "rewards": REWARDS,
        },
        "gae_inputs": {
            str(n): {"rewards": r[0].tolist(), "values": v[0].tolist()} for n, (r, v) in gae_inputs().items()
        },
        "gae_cases": gae_cases(),
        "batch_cases": batch_cases(),
        "value_loss_cases": value_loss_cases(),
    }
    args.out.write_text(json.dumps(document, indent=None, separators=(",", ":")) + "\n")
    counts = {key: len(document[key]) for key in ("gae_cases", "batch_cases", "value_loss_cases")}
    print(f"wrote {args.out}: {counts}, slime {commit[:12]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
