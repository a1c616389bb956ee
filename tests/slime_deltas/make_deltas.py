"""Build the delta-weight-sync fixtures with slime's own code, offline, on the CPU:

    python tests/slime_deltas/make_deltas.py --slime SLIME_CHECKOUT

SLIME_CHECKOUT: THUDM/slime at COMMIT. What it writes under examples/slime-delta-weights/ (and the record beside
this script):

- base/: a tiny Qwen3 checkpoint (rlbench's fixture config, random bf16 weights): the engine's version 0;
- chain/weight_v000001..5: slime's own trainer-side encoder (slime/backends/megatron_utils/update_weight/
  update_weight_from_disk_delta.py, `_encode_delta` and `_write_delta_files`, one rank: torch.distributed answered
  for world size 1; its snapshot seeded as `_capture_baseline` seeds it, with slime/utils/disk_delta.py's
  `make_tensor_reader` over base/) publishing four trained states: v1 xor and xxh3-128, v2 overwrite and blake3,
  v3 xor and adler32, v4 a full version (an ordinary HF checkpoint: the chain's reset), v5 xor and xxh3-128 on it;
- final/: the trainer's weights after v5, which slime's own receiving side (the SGLang patch's
  sglang/srt/weight_sync/local_checkpoint.py, docker/patch/latest/sglang-pull_weights.patch, run from the patch's
  text) must reproduce from base/ and chain/: checked here before anything is kept;
- pulled_by_slime.json: rlbench's own writer (rlbench/core/weight_delta.py Publisher) given the same states
  (v1 full, then xor deltas) and pulled by slime's receiving side: the content digest of each file rlbench wrote
  (`content_digest`: a safetensors header's key order aside, which its writer varies by process), and the sha256 of
  each tensor after each version slime pulled, which tests/cpu/test_weight_delta.py holds rlbench's writer and
  rlbench's pull to.

The files are committed; tests never run slime. Rerun this only to change them, and say so in the commit.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

COMMIT = "624b824a8"
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DATA = REPO / "examples" / "slime-delta-weights"
PLAN = [("xor", "xxh3-128"), ("overwrite", "blake3"), ("xor", "adler32"), ("full", None), ("xor", "xxh3-128")]


def states(torch):
    """The base weights and five trained states: each a few tensors moved by a small step (some left alone), in
    bf16 as a bf16 trainer exports them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(REPO / "rlbench" / "fixtures" / "models" / "tiny-qwen3")
    torch.manual_seed(38)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    weights = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    out = [weights]
    gen = torch.Generator().manual_seed(1)
    for step in range(len(PLAN)):
        new = {}
        for i, (name, tensor) in enumerate(sorted(out[-1].items())):
            if (i + step) % 3 == 0:  # a third of the tensors unchanged each step
                new[name] = tensor.clone()
                continue
            noise = torch.randn(tensor.shape, generator=gen) * 1e-3
            keep = torch.rand(tensor.shape, generator=gen) < 0.5  # half the elements move
            new[name] = (tensor.float() + noise * keep).to(torch.bfloat16).contiguous()
        out.append(new)
    return out


def slime_reader(slime: Path):
    """The SGLang patch's local_checkpoint.py, taken from the patch's text and imported."""
    patch = (slime / "docker/patch/latest/sglang-pull_weights.patch").read_text().splitlines()
    start = next(i for i, line in enumerate(patch) if line == "+++ b/python/sglang/srt/weight_sync/local_checkpoint.py")
    lines = []
    for line in patch[start + 2 :]:
        if line.startswith("diff --git"):
            break
        lines.append(line[1:])
    path = Path(tempfile.mkdtemp()) / "slime_local_checkpoint.py"
    path.write_text("\n".join(lines) + "\n")
    spec = importlib.util.spec_from_file_location("slime_local_checkpoint", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def slime_encoder(slime: Path):
    sys.path.insert(0, str(slime))
    import slime.backends.megatron_utils.update_weight.update_weight_from_disk_delta as encoder

    class Dist:  # one rank: what torch.distributed answers for world size 1
        get_world_size = staticmethod(lambda *a, **k: 1)
        get_rank = staticmethod(lambda *a, **k: 0)
        barrier = staticmethod(lambda *a, **k: None)

        @staticmethod
        def all_gather_object(out, obj, group=None):
            out[0] = obj

    encoder.dist = Dist
    encoder.get_gloo_group = lambda: None
    from slime.utils.disk_delta import make_tensor_reader

    return encoder, make_tensor_reader


def save_hf(torch, weights: dict, directory: Path) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    save_file(weights, str(directory / "model.safetensors"))
    shutil.copyfile(REPO / "rlbench/fixtures/models/tiny-qwen3/config.json", directory / "config.json")


def digests(directory: Path) -> dict[str, str]:
    from safetensors import safe_open

    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                out[name] = hashlib.sha256(
                    t.contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes()
                ).hexdigest()
    return out


def content_digest(path: Path) -> str:
    """A file's sha256, a safetensors file's over its header read as JSON with sorted keys and its data: the
    safetensors writer orders the header's metadata map differently in each process (a hash map), its data not."""
    blob = path.read_bytes()
    if path.suffix != ".safetensors":
        return hashlib.sha256(blob).hexdigest()
    length = int.from_bytes(blob[:8], "little")
    header = json.dumps(json.loads(blob[8 : 8 + length]), sort_keys=True).encode()
    return hashlib.sha256(header + blob[8 + length :]).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slime", required=True, help=f"a checkout of THUDM/slime at {COMMIT}")
    args = parser.parse_args()
    import torch

    slime = Path(args.slime).resolve()
    for name in ("base", "chain", "final"):
        shutil.rmtree(DATA / name, ignore_errors=True)
    weights = states(torch)
    save_hf(torch, weights[0], DATA / "base")
    encoder, make_tensor_reader = slime_encoder(slime)
    publisher = object.__new__(encoder.UpdateWeightFromDiskDelta)
    publisher.delta_dir = str(DATA / "chain")
    (DATA / "chain").mkdir()
    publisher._is_pp_src_rank = True
    read = make_tensor_reader(str(DATA / "base"))
    publisher._snapshot = {name: read(name) for name in weights[0]}  # as _capture_baseline seeds it
    for version, (encoding, algorithm) in enumerate(PLAN, start=1):
        state = weights[version]
        if encoding == "full":
            save_hf(torch, state, DATA / "chain" / f"weight_v{version:06d}")
            read = make_tensor_reader(str(DATA / "chain" / f"weight_v{version:06d}"))
            publisher._snapshot = {name: read(name) for name in state}
            continue
        publisher.weight_version = version
        publisher.delta_encoding, publisher.checksum_algorithm = encoding, algorithm
        publisher._iter_hf_tensors = lambda state=state: iter(state.items())
        publisher._encode_delta()
        publisher._write_delta_files()
    save_hf(torch, weights[-1], DATA / "final")
    reader = slime_reader(slime)
    local = Path(tempfile.mkdtemp()) / "local"
    reader.pull(str(local), str(DATA / "base"), str(DATA / "chain"), len(PLAN))
    assert digests(local) == digests(DATA / "final"), "slime's reader does not reproduce the final weights"
    # rlbench's writer, read by slime's reader
    sys.path.insert(0, str(REPO))
    from rlbench.core.weight_delta import Publisher

    ours = Path(tempfile.mkdtemp()) / "ours"
    mine = Publisher(ours)
    mine.publish_full(1, weights[1], REPO / "rlbench/fixtures/models/tiny-qwen3/config.json")
    pulled = {}
    local = Path(tempfile.mkdtemp()) / "local"
    reader.pull(str(local), str(DATA / "base"), str(ours), 1)
    pulled["1"] = digests(local)
    for version in range(2, len(weights)):
        mine.publish(version, weights[version])
        reader.pull(str(local), str(DATA / "base"), str(ours), version)
        pulled[str(version)] = digests(local)
    files = {str(f.relative_to(ours)): content_digest(f) for f in sorted(ours.rglob("*")) if f.is_file()}
    record = {"slime_commit": COMMIT, "rlbench_chain_sha256": files, "sha256_after_each_version": pulled}
    (HERE / "pulled_by_slime.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"wrote {DATA} and {HERE / 'pulled_by_slime.json'} with slime {COMMIT}'s encoder and receiving side")


if __name__ == "__main__":
    main()
