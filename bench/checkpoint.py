"""Where a checkpoint's time goes (issue 34, point 4): the torch trainer's `save_checkpoint` at a real shape, by part.

bench/scale.py measured a checkpoint at Qwen3-0.6B on an H100 as 17.0 s making its files in memory (blocking the
step) and 6.1 s writing them (in the background, at the disk's speed). This splits the 17 s: the trainer's own
call, then each of its parts alone, the same tensors each time, `--repeats` rounds after a warm-up, medians:

- the host copies (`.cpu()` of the model's weights, the fp32 masters and AdamW's moments: what the call made
  before rlbench/core/tensor_file.py);
- the same copies into page-locked (pinned) host buffers allocated once, `non_blocking`, one synchronisation;
- safetensors' serialisation of the host tensors to bytes (`safetensors.torch.save`, what the call did then);
- `tensor_file.encode` of the same tensors from where they live (what the call does now: one copy per tensor,
  straight into the file's buffer; the same bytes as safetensors');
- the device checksum over the optimizer state and the masters (`digest.tensors_digest`, what the call does).

    python bench/checkpoint.py [--shape 0.6B] [--device cuda] [--repeats 3]

The shape's run is bench/scale.py's (its `shape_config`: bf16 over fp32 masters, Qwen3's vocabulary); one step
is run first, so AdamW has its moments.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:] = [str(BENCH)] + [p for p in sys.path if Path(p or ".").resolve() != BENCH]
import scale  # noqa: E402  (bench/scale.py: the shapes and the run they are measured on)
from stages import STAGES, sync_device  # noqa: E402

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]  # the folder only for the two above

import torch  # noqa: E402

from rlbench.backends.optimizer_state import optimizer_tensors
from rlbench.core import loop, tensor_file  # noqa: E402
from rlbench.rundir import digest  # noqa: E402
from rlbench.session import build  # noqa: E402


def _timed(fn, device: str, repeats: int) -> tuple[float, object]:
    """Median seconds of `repeats` calls after a warm-up, each between device synchronisations; the last result."""
    times, result = [], None
    for _ in range(repeats + 1):
        sync_device(device)
        start = time.perf_counter()
        result = fn()
        sync_device(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="0.6B", choices=sorted(scale.SHAPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16, help="the one step's response length (its cost only)")
    args = parser.parse_args()
    from safetensors.torch import save

    with tempfile.TemporaryDirectory() as tmp:
        ctx = build(scale.shape_config(Path(tmp), args.shape, args.device, 10, args.new_tokens))
        state = loop.StepState(0)
        for _, stage in STAGES[:7]:  # data .. sync: AdamW has its moments after the train stage
            stage(ctx, state)
        trainer = ctx.trainer
        named = trainer.masters.params if trainer.masters else dict(trainer.model.named_parameters())
        tensors = {
            **{f"model/{k}": v for k, v in trainer.export_hf_weights().items()},
            **optimizer_tensors(trainer.optimizer, named),
        }
        if trainer.masters:
            tensors.update({f"master/{k}": p.detach() for k, p in named.items()})
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        whole, files = _timed(trainer.save_checkpoint, args.device, args.repeats)
        copies, host = _timed(lambda: {k: v.cpu().contiguous() for k, v in tensors.items()}, args.device, args.repeats)
        pinned_copies = float("nan")
        if args.device.startswith("cuda"):
            buffers = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for k, v in tensors.items()}

            def into_pinned():
                for k, v in tensors.items():
                    buffers[k].copy_(v, non_blocking=True)
                torch.cuda.synchronize()
                return buffers

            pinned_copies, _ = _timed(into_pinned, args.device, args.repeats)
        serialise, _ = _timed(lambda: save(host), args.device, args.repeats)
        encoded, _ = _timed(lambda: tensor_file.encode(tensors), args.device, args.repeats)
        held = sorted((k, v) for k, v in tensors.items() if not k.startswith("model/"))
        checksum, _ = _timed(lambda: digest.tensors_digest(held), args.device, args.repeats)
        written = sum(len(data) for data in files.values())
        ctx.writer.close()
    label = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(
        f"{label}, torch {torch.__version__}, {args.shape}: a checkpoint of {written / 1e9:.2f} GB "
        f"({size / 1e9:.2f} GB of tensors), medians of {args.repeats} rounds after a warm-up"
    )
    print(f"  save_checkpoint (the trainer's call, blocks the step): {whole:.2f} s")
    for name, seconds in (
        ("host copies (.cpu())", copies),
        ("copies into pinned buffers", pinned_copies),
        ("safetensors serialisation to bytes", serialise),
        ("tensor_file.encode from the device", encoded),
        ("device checksum", checksum),
    ):
        rate = size / seconds / 1e9 if seconds == seconds else float("nan")  # nan: not measured on this device
        print(f"  {name:38s} {seconds:7.2f} s  {rate:6.2f} GB/s")


if __name__ == "__main__":
    main()
