"""PPO's critic (issue 56): the value model as slime 624b824a builds it, and its values per token.

slime's critic is the policy's architecture with its output layer replaced (slime/backends/megatron_utils/
model_provider.py, role "critic"): `LinearForLastLayer`, a Linear(hidden, 1) with a bias, its weight drawn from
N(0, init_method_std) (0.02, Megatron's default; no slime script sets it) and its bias 0, its output cast to
float32. The critic starts from the policy's checkpoint (slime loads --ref-load when the critic has none of its
own) with the output layer redrawn where the checkpoint's does not fit (model.py `_critic_output_layer_needs_reinit`:
a policy's [vocab, hidden] layer never does). slime's critic role unties the embeddings from the output layer; here
the policy's output layer is simply not part of the critic.

The value of response token j is the head's output at position prompt + j - 1 (slime's get_values shifts as the
log-probs do), computed for every response token, trained or not (GAE reads them all).

rlbench draws the head from its seeded generator (purpose "critic_head"), so a run's critic is the same bits on
every machine; slime draws it from the process's RNG, which no one can reproduce bit for bit: the distribution is
slime's, the draw is rlbench's.
"""

from __future__ import annotations

import copy

import torch

from rlbench.core.seeding import generator

HEAD_STD = 0.02  # Megatron's init_method_std default, which slime's critic head is drawn with


class ValueModel(torch.nn.Module):
    """The policy's decoder (its layers and final norm, copied: the critic trains apart) under a one-output head."""

    def __init__(self, policy: torch.nn.Module, seed: int, std: float = HEAD_STD):
        super().__init__()
        self.trunk = copy.deepcopy(policy.get_decoder())
        dtype = policy.get_output_embeddings().weight.dtype
        device = next(self.trunk.parameters()).device
        self.head = torch.nn.Linear(policy.config.hidden_size, 1, dtype=dtype, device=device)  # with a bias
        with torch.no_grad():
            self.head.weight.copy_(head_weight(policy.config.hidden_size, seed, std))  # in the model's dtype
            self.head.bias.zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The head's output at every position of `input_ids` [n, L], float32 [n, L]."""
        hidden = self.trunk(input_ids=input_ids, use_cache=False).last_hidden_state
        return self.head(hidden)[..., 0].float()


def head_weight(hidden: int, seed: int, std: float = HEAD_STD) -> torch.Tensor:
    """The value head's weight [1, hidden], drawn N(0, std) in float32 on the CPU from the run's seed."""
    return torch.empty(1, hidden).normal_(0.0, std, generator=generator(seed, "critic_head"))


def initial_weights(policy: dict[str, torch.Tensor], hidden: int, seed: int) -> dict[str, torch.Tensor]:
    """A `ValueModel`'s initial weights by name from the policy's Hugging Face weights (its output layer dropped):
    what the megatron trainer's ranks load their critic from (backends/megatron/critic.py)."""
    trunk = {f"trunk.{name.removeprefix('model.')}": t for name, t in policy.items() if name.startswith("model.")}
    dtype = next(iter(trunk.values())).dtype
    return {**trunk, "head.weight": head_weight(hidden, seed).to(dtype), "head.bias": torch.zeros(1, dtype=dtype)}


def token_values(model: ValueModel, tokens: torch.Tensor) -> torch.Tensor:
    """V for token t of `tokens` [n, L] (t >= 1) from the head at position t - 1, float32 [n, L]; position 0 gets 0
    (no position predicts it), as algo.token_logprobs lays out its log-probs."""
    return torch.nn.functional.pad(model(tokens)[:, :-1], (1, 0))
