"""Which CPU settings decide the bits: per-operation digests and a short default run, per setting.

    python bench/cpu_numerics.py --out here.json            # probe this machine
    python bench/cpu_numerics.py --compare a.json b.json    # what agrees across two machines

Each setting is a set of environment variables read when torch (ATen's CPU dispatch, MKL, oneDNN)
initialises, so each runs in a fresh process. A probe digests the outputs of the operations the
embedded model uses, at its shapes: GEMMs forward and backward (MKL), reductions and softmax
(ATen's vectorised kernels), transcendental functions (SLEEF or libm), scaled-dot-product
attention, and a whole forward/backward of the fixture model; then it runs `rlbench run --steps 3`
and keeps each stage's checksums. Comparing two machines' files shows which operation parts
first, under which setting, and whether some setting makes every digest agree.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETTINGS = {
    "plain": {},
    "cbwr-compatible": {"MKL_CBWR": "COMPATIBLE"},
    "cbwr-avx2": {"MKL_CBWR": "AVX2"},
    "cbwr-avx2-strict": {"MKL_CBWR": "AVX2,STRICT"},
    "aten-avx2": {"ATEN_CPU_CAPABILITY": "avx2"},
    "aten-default": {"ATEN_CPU_CAPABILITY": "default"},
    "cbwr-avx2-strict+aten-avx2": {"MKL_CBWR": "AVX2,STRICT", "ATEN_CPU_CAPABILITY": "avx2"},
    "cbwr-avx2+aten-avx2+onednn-avx2": {
        "MKL_CBWR": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    },
    "cbwr-compatible+aten-default": {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "default"},
    "cbwr-compatible+aten-avx2": {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "avx2"},
    "mkl-instructions-avx2+aten-avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    "cbwr-avx512+aten-avx512": {"MKL_CBWR": "AVX512", "ATEN_CPU_CAPABILITY": "avx512"},
    "cbwr-sse4_2+aten-avx2": {"MKL_CBWR": "SSE4_2", "ATEN_CPU_CAPABILITY": "avx2"},
}


def probe() -> dict:
    """Digests of each operation's output in this process (settings come from the environment)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    out: dict[str, str] = {}

    def put(name: str, t: torch.Tensor) -> None:
        out[name] = hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()[:16]

    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    # GEMMs at the fixture model's shapes: decode (M=1), prefill/train (M = tokens), lm head (N = vocab).
    for m, k, n in [
        (1, 64, 64),
        (1, 64, 192),
        (1, 192, 64),
        (1, 64, 314),
        (8, 64, 64),
        (30, 64, 192),
        (480, 64, 64),
        (480, 64, 192),
        (480, 192, 64),
        (480, 64, 314),
        (64, 480, 64),
    ]:
        a, b = rand(m, k), rand(n, k)
        put(f"linear {m}x{k}x{n}", F.linear(a, b))
        put(f"mm^T {m}x{k}x{n}", a.t() @ rand(m, n))  # the weight-gradient shape
    x = rand(480, 64)
    put("sum(-1)", x.sum(-1))
    put("mean(-1)", x.mean(-1))
    put("rmsnorm", x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    put("softmax", torch.softmax(rand(480, 314), -1))
    put("log_softmax", torch.log_softmax(rand(480, 314), -1))
    put("logsumexp", torch.logsumexp(rand(480, 314), -1))
    put("exp", torch.exp(x))
    put("log", torch.log(x.abs() + 1e-3))
    put("silu", F.silu(x))
    put("sigmoid", torch.sigmoid(x))
    put("rsqrt", torch.rsqrt(x.abs() + 1e-3))
    put("sin/cos", torch.cat([torch.sin(x * 7), torch.cos(x * 7)]))
    q, kk, v = rand(8, 4, 30, 16), rand(8, 4, 30, 16), rand(8, 4, 30, 16)
    put("sdpa causal", F.scaled_dot_product_attention(q, kk, v, is_causal=True))
    qg = q.clone().requires_grad_()
    F.scaled_dot_product_attention(qg, kk, v, is_causal=True).sum().backward()
    put("sdpa backward", qg.grad)
    put("sum all", x.sum())
    put("norm", torch.linalg.vector_norm(x))
    w = rand(314, 64).requires_grad_()
    F.cross_entropy(x @ w.t(), torch.arange(480) % 314).backward()
    put("cross_entropy grad", w.grad)
    # The fixture model, forward and backward.
    from rlbench.core.model import build_model

    model = build_model(REPO / "rlbench/fixtures/models/tiny-qwen3", 1234, init="random")
    ids = torch.arange(240).reshape(8, 30) % 314
    logits = model(input_ids=ids).logits
    put("model forward", logits)
    logits.log_softmax(-1).mean().backward()
    put("model backward", torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return out


def probe_train() -> dict:
    """Step 0 of the default run up to its first optimizer step, with a digest of every module's
    output and every intermediate of the loss, in call order: names the first operation that parts."""
    import torch

    from rlbench.config import load_config
    from rlbench.core import algo, loop
    from rlbench.session import build

    out: dict[str, str] = {}
    counter = [0]

    def put(name: str, t) -> None:
        if isinstance(t, tuple):
            t = t[0]
        if torch.is_tensor(t):
            counter[0] += 1
            out[f"{counter[0]:04d} {name}"] = hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()[:16]

    ctx = build(load_config(steps=1))
    state = loop.StepState(0)
    for stage in (loop.data, loop.rollout, loop.reward, loop.advantage, loop.logprob):
        stage(ctx, state)
    put("old_logprobs", state.batch.old_logprobs)
    model = ctx.trainer.model
    for name, module in model.named_modules():
        module.register_forward_hook(
            lambda m, i, o, name=name: put(f"fwd {name or 'model'}", o.logits if hasattr(o, "logits") else o)
        )
    for fn in ("token_logprobs", "token_entropy", "sample_mean", "ppo_clip_loss", "kl_penalty"):
        original = getattr(algo, fn)

        def wrapped(*args, _f=original, _n=fn, **kwargs):
            result = _f(*args, **kwargs)
            for k, r in enumerate(result if isinstance(result, tuple) else (result,)):
                put(f"{_n}[{k}]", r)
            return result

        setattr(algo, fn, wrapped)
    trainer = ctx.trainer
    trainer.train_config = trainer.train_config.__class__(**{**trainer.train_config.__dict__, "minibatches": 1})
    clip = torch.nn.utils.clip_grad_norm_

    def clip_probe(params, max_norm):
        params = list(params)
        for p in params:
            g = p.grad
            name = f"{tuple(g.shape)}"
            put(f"grad {name}", g)
            put(f"vector_norm {name}", torch.linalg.vector_norm(g))
            put(f"foreach_norm {name}", torch._foreach_norm([g])[0])
            put(f"pow2sum {name}", g.pow(2).sum())
            put(f"sqrt {name}", g.abs().sqrt())
            put(f"lerp {name}", torch.zeros_like(g).lerp_(g, 0.1))
            put(f"addcmul {name}", torch.zeros_like(g).addcmul_(g, g, value=0.001))
            put(f"addcdiv {name}", p.detach().clone().addcdiv_(g, g.abs() + 1e-8, value=-0.003))
            put(f"div {name}", g / (g.abs() + 1e-8))
            put(f"mul_ {name}", g * 0.37)
        total = clip(params, max_norm)
        put("clip total_norm", total)
        for p in params:
            put(f"clipped grad {tuple(p.grad.shape)}", p.grad)
        return total

    torch.nn.utils.clip_grad_norm_ = clip_probe
    step = trainer.optimizer.step

    def step_probe(*a, **k):
        result = step(*a, **k)
        for p, st in trainer.optimizer.state.items():
            for key, value in st.items():
                put(f"adam {key} {tuple(p.shape)}", value)
        return result

    trainer.optimizer.step = step_probe
    stats = trainer.train_step(state.batch, 0)
    put("losses", stats.losses)
    for name, p in model.named_parameters():
        put(f"weight after step {name}", p)
    out["grads_digest"] = stats.grads_digest
    out.update({f"grad {k}": v[:16] for k, v in stats.param_grads.items()})
    return out


def run_checksums(tmp: Path) -> list[dict]:
    out = tmp / "run"
    subprocess.run(
        [sys.executable, "-m", "rlbench.cli", "run", "--steps", "3", "--out", str(out), "--json"],
        cwd=REPO,
        check=True,
        stdout=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    return [json.loads(line) for line in (out / "checksums.jsonl").read_text().splitlines()]


def machine() -> dict:
    info = {"machine": platform.machine(), "python": platform.python_version()}
    try:
        text = Path("/proc/cpuinfo").read_text()
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        info["cpu"] = fields.get("model name")
        info["vendor"] = fields.get("vendor_id")
        flags = set(fields.get("flags", "").split())
        info["isa"] = sorted(f for f in flags if f.startswith(("avx", "fma", "amx")))
    except OSError:
        pass
    import torch

    info["torch"] = torch.__version__
    info["blas"] = next((line.strip() for line in torch.__config__.show().splitlines() if "Math Kernel" in line), None)
    return info


def collect(names: list[str], with_run: bool) -> dict:
    doc = {"machine": machine(), "settings": {}}
    for name in names:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("MKL_CBWR", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
        }
        env.update(SETTINGS[name])
        env["PYTHONPATH"] = str(REPO)
        code = (
            "import json, sys; sys.path.insert(0, 'bench'); import cpu_numerics as c; import torch; "
            "print(json.dumps({'ops': c.probe(), 'train': c.probe_train(), "
            "'capability': torch.backends.cpu.get_cpu_capability()}))"
        )
        probe_out = subprocess.run(
            [sys.executable, "-c", code], cwd=REPO, env=env, check=True, capture_output=True, text=True
        ).stdout
        entry = json.loads(probe_out.strip().splitlines()[-1])
        if with_run:
            saved = dict(os.environ)
            os.environ.clear()
            os.environ.update(env)
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    entry["run"] = run_checksums(Path(tmp))
            finally:
                os.environ.clear()
                os.environ.update(saved)
        doc["settings"][name] = entry
        print(f"{name}: capability {entry['capability']}", file=sys.stderr)
    return doc


def compare(a: dict, b: dict) -> None:
    print(f"A: {a['machine']}\nB: {b['machine']}")
    for name in a["settings"]:
        if name not in b["settings"]:
            continue
        sa, sb = a["settings"][name], b["settings"][name]
        ops = [k for k in sa["ops"] if sa["ops"][k] != sb["ops"].get(k)]
        train = [k for k in sa.get("train", {}) if sa["train"][k] != sb.get("train", {}).get(k)]
        stages = []
        for ra, rb in zip(sa.get("run", []), sb.get("run", [])):
            stages += [f"{ra['step']}:{k}" for k in ra if k != "step" and ra[k] != rb.get(k)]
        same = not ops and not stages and "run" in sa and "run" in sb
        print(
            f"{name:36s} ops differing {len(ops):2d}/{len(sa['ops'])} "
            f"{'run: identical' if same else 'run stages differing: ' + str(len(stages))}"
        )
        if ops:
            print("    ops:", ", ".join(ops))
        if train:
            print(f"    train step: {len(train)}/{len(sa['train'])} differ, first:", ", ".join(train[:6]))
        if stages:
            print("    first stages:", ", ".join(stages[:4]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the probe's JSON here")
    parser.add_argument("--settings", nargs="*", default=list(SETTINGS), help="which settings [default: all]")
    parser.add_argument("--no-run", action="store_true", help="operation digests only, no rlbench run")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two probe files")
    args = parser.parse_args()
    if args.compare:
        compare(*(json.loads(Path(p).read_text()) for p in args.compare))
        return 0
    doc = collect(args.settings, not args.no_run)
    text = json.dumps(doc, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
