"""How much of the trainer's forward + backward is transformers' own overhead, and how much is arithmetic.

Issue 11 asks for a default run of <= 15 s. Its steps are the tiny Qwen3's forwards and backwards; a
hand-written forward would skip transformers' module calls, kwargs handling, mask logic and output objects.
This measures what that would buy before anyone writes one: `functional` below runs the same operations as
transformers' Qwen3 (RMSNorm, q/k norms, rotary, SDPA with GQA, SwiGLU, tied LM head) on the model's own
parameters, checks that its logits and every gradient are the same bits as the model's, then times both on the
trainer's micro-batch shape, alternating, in one process.

    python bench/forward_overhead.py                 # portable numerics (the default)
    RLBENCH_CPU_NUMERICS=native python bench/forward_overhead.py

It is a measurement, not a second model: nothing in rlbench uses `functional`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import rlbench  # noqa: F401  - pins the CPU numerics before torch is imported
from rlbench import numerics

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from rlbench.core.model import build_model  # noqa: E402

MODEL = Path(__file__).resolve().parents[1] / "rlbench" / "fixtures" / "models" / "tiny-qwen3"


def functional(model, ids: torch.Tensor, keep: int) -> torch.Tensor:
    """Logits of the last `keep` positions, with transformers 5.23's Qwen3 operations in their order."""
    cfg, p = model.config, dict(model.named_parameters())
    heads, kv_heads, dim, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps

    def norm(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rotate(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    rows, length = ids.shape
    freqs = torch.arange(length)[None].expand(rows, length)[..., None].float() * model.model.rotary_emb.inv_freq
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]  # transformers scales both by 1.0 here: exact, left out
    h = F.embedding(ids, p["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        w = {k.removeprefix(f"model.layers.{i}."): v for k, v in p.items() if k.startswith(f"model.layers.{i}.")}
        x = norm(h, w["input_layernorm.weight"])
        q = norm(F.linear(x, w["self_attn.q_proj.weight"]).view(rows, length, heads, dim), w["self_attn.q_norm.weight"])
        k = norm(
            F.linear(x, w["self_attn.k_proj.weight"]).view(rows, length, kv_heads, dim), w["self_attn.k_norm.weight"]
        )
        v = F.linear(x, w["self_attn.v_proj.weight"]).view(rows, length, kv_heads, dim).transpose(1, 2)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q, k = q * cos + rotate(q) * sin, k * cos + rotate(k) * sin
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=dim**-0.5, enable_gqa=True)
        h = h + F.linear(a.transpose(1, 2).contiguous().reshape(rows, length, -1), w["self_attn.o_proj.weight"])
        x = norm(h, w["post_attention_layernorm.weight"])
        gate = F.silu(F.linear(x, w["mlp.gate_proj.weight"])) * F.linear(x, w["mlp.up_proj.weight"])
        h = h + F.linear(gate, w["mlp.down_proj.weight"])
    return F.linear(norm(h, p["model.norm.weight"])[:, -keep:], p["model.embed_tokens.weight"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16, help="micro-batch rows (the default run's minibatch: 16)")
    parser.add_argument("--length", type=int, default=24, help="tokens per row (prompt + answer, about 24)")
    parser.add_argument("--keep", type=int, default=6, help="logits kept (the answer span)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build_model(MODEL, 1234, init="random")
    ids = torch.randint(
        3,
        model.get_input_embeddings().weight.shape[0],
        (args.rows, args.length),
        generator=torch.Generator().manual_seed(0),
    )

    def library():
        return model(input_ids=ids, logits_to_keep=args.keep, use_cache=False).logits

    def by_hand():
        return functional(model, ids, args.keep)

    def train_pass(forward):
        model.zero_grad(set_to_none=True)
        forward().logsumexp(-1).sum().backward()
        return [param.grad.clone() for param in model.parameters()]

    same_logits = torch.equal(library(), by_hand())
    same_grads = all(torch.equal(a, b) for a, b in zip(train_pass(library), train_pass(by_hand)))
    print(f"numerics: {numerics.mode()}; rows {args.rows} x {args.length} tokens, logits of the last {args.keep}")
    print(f"same bits: logits {same_logits}, all {len(list(model.parameters()))} gradients {same_grads}")
    if not (same_logits and same_grads):
        print("the functional forward is not the model's computation: the timing below would compare unlike things")
        return 1
    times = {name: [] for name in ("transformers fwd+bwd", "functional fwd+bwd", "transformers fwd", "functional fwd")}
    for _ in range(args.repeats):  # alternating, so the machine's noise falls on both
        for name, run in (
            ("transformers fwd+bwd", lambda: train_pass(library)),
            ("functional fwd+bwd", lambda: train_pass(by_hand)),
            ("transformers fwd", lambda: torch.no_grad()(library)()),
            ("functional fwd", lambda: torch.no_grad()(by_hand)()),
        ):
            start = time.perf_counter()
            for _ in range(args.iters):
                run()
            times[name].append((time.perf_counter() - start) / args.iters * 1e3)
    median = {name: statistics.median(values) for name, values in times.items()}
    for name, value in median.items():
        print(f"{name:<22} {value:7.2f} ms (median of {args.repeats})")
    print(
        f"functional / transformers: fwd+bwd x{median['functional fwd+bwd'] / median['transformers fwd+bwd']:.2f}, "
        f"fwd x{median['functional fwd'] / median['transformers fwd']:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
