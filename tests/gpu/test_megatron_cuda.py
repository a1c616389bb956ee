"""The megatron trainer on CUDA in deterministic mode (slime's recipe): two runs with one seed
write the same checksums and metrics, and the manifest records the settings. With two GPUs,
TP=2 (NCCL) agrees with TP=1 within rtol 1e-6. With three, `--placement ray` (two rank actors and
the engine's actor, a GPU each) writes the in-process TP=2 run's checksums."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import run_cli, small_toml


def _run(tmp_path, name: str, *args: str, dtype: str = "float32"):
    (tmp_path / "s.toml").write_text(small_toml(4) + f'[model]\ndtype = "{dtype}"\n')
    res = run_cli(
        "run",
        "-c",
        str(tmp_path / "s.toml"),
        "--seed",
        "7",
        "--trainer",
        "megatron",
        "--device",
        "cuda",
        "--deterministic",
        "--out",
        str(tmp_path / name),
        "--json",
        *args,
    )
    assert res.returncode == 0, res.stderr
    return tmp_path / name


def _metrics(run):
    return [
        {k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
        for line in (run / "metrics.jsonl").read_text().splitlines()
    ]


def test_deterministic_megatron_runs_repeat_bit_for_bit(tmp_path):
    a, b = _run(tmp_path, "a"), _run(tmp_path, "b")
    assert (a / "checksums.jsonl").read_bytes() == (b / "checksums.jsonl").read_bytes()
    assert _metrics(a) == _metrics(b)
    res = run_cli("diff", str(a), str(b))
    assert res.returncode == 0, res.stdout + res.stderr
    settings = json.loads((a / "manifest.json").read_text())["determinism"]
    assert settings["deterministic"] and settings["deterministic_algorithms"]
    assert settings["cublas_workspace_config"] == ":4096:8" and settings["nccl_algo"] == "Ring"
    assert json.loads((a / "manifest.json").read_text())["versions"]["megatron-core"] is not None


def test_megatron_bf16_on_cuda_repeats_bit_for_bit_over_fp32_masters_and_resumes(tmp_path):
    """Megatron's own mixed precision on the GPU (bf16 parameters, gradients reduced into fp32 buffers, fp32
    masters and AdamW state): two runs with one seed write the same checksums; the checkpoint's masters are fp32
    and the model shard is them rounded; a run resumed from step 2 writes the straight run's checksums."""
    import shutil

    from safetensors.torch import load_file

    a, b = _run(tmp_path, "a", dtype="bfloat16"), _run(tmp_path, "b", dtype="bfloat16")
    assert (a / "checksums.jsonl").read_bytes() == (b / "checksums.jsonl").read_bytes()
    assert _metrics(a) == _metrics(b)
    point = a / "checkpoints" / "000002"
    masters = {
        k.removeprefix("master/"): v
        for k, v in load_file(point / "optimizer-tp00.safetensors").items()
        if k.startswith("master/")
    }
    weights = load_file(point / "model-tp00.safetensors")
    assert masters and all(v.dtype == torch.float32 for v in masters.values())
    assert all(
        weights[k].dtype == torch.bfloat16 and torch.equal(v.to(torch.bfloat16), weights[k]) for k, v in masters.items()
    )
    resumed = shutil.copytree(a, tmp_path / "resumed")
    lines = (resumed / "metrics.jsonl").read_text().splitlines(keepends=True)
    (resumed / "metrics.jsonl").write_text("".join(lines[:3]))
    res = run_cli("run", "--resume", str(resumed))
    assert res.returncode == 0, res.stderr
    assert (resumed / "checksums.jsonl").read_bytes() == (a / "checksums.jsonl").read_bytes()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tp2_on_two_gpus_matches_tp1(tmp_path):
    one, two = _run(tmp_path, "tp1"), _run(tmp_path, "tp2", "--tp", "2")
    res = run_cli("diff", str(one), str(two), "--rtol", "1e-6")
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs three GPUs (two trainer ranks, the engine)")
def test_tp2_rank_actors_under_ray_placement_match_in_process_tp2(tmp_path, monkeypatch):
    pytest.importorskip("ray")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    local, ray = _run(tmp_path, "local", "--tp", "2"), _run(tmp_path, "ray", "--tp", "2", "--placement", "ray")
    assert (ray / "checksums.jsonl").read_bytes() == (local / "checksums.jsonl").read_bytes()
    assert _metrics(ray) == _metrics(local)


@pytest.mark.parametrize("clip", [1e6, 1e-6], ids=["no-clipping", "clipping"])
def test_megatron_bf16_steps_as_megatron_cores_own_mixed_precision_optimizer(tmp_path, clip):
    """rlbench's megatron trainer in bf16 held to megatron-core's own optimizer as slime builds it
    (`get_megatron_optimizer`, bf16: Float16OptimizerWithFloat16Params over a DDP's fp32 gradient buffers, its param
    groups, whose weight decays its OptimizerParamScheduler sets, its clipping), side by side: a twin of the model
    from the same initial weights takes, every minibatch,
    the gradients rlbench's trainer computed, and steps with megatron-core's optimizer. With torch's AdamW inside
    both (megatron-core's choice without Transformer Engine or Apex; fused, as rlbench's), the fp32 masters and the
    bf16 parameters are the same bits after every update when no gradient is clipped. When every update with a
    gradient clips, megatron-core's fp32 norm and rlbench's float64 one differ in the last bits: the norms agree to
    1e-6 relative and the masters to a few float32 ulps of an update. Every update has a gradient by construction
    (an entropy bonus: a batch whose samples all score alike has no policy gradient), or the comparison would have
    nothing to compare."""
    pytest.importorskip("megatron.core")
    import megatron.core.optimizer as moptim
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from rlbench.config import load_config
    from rlbench.core import loop
    from rlbench.session import build
    from rlbench.core.model import named_weights

    if not moptim.USING_PYTORCH_OPTIMIZER:
        pytest.skip("megatron-core steps with Transformer Engine's or Apex's FusedAdam here, not torch's AdamW")
    config = load_config(
        steps=3,
        seed=3,
        device="cuda",
        deterministic=True,
        model__dtype="bfloat16",
        algo__entropy_coef=0.01,
        train__backend="megatron",
        train__weight_decay=0.1,
        train__grad_clip=clip,
        train__lr=1e-4,
        data__prompts_per_step=8,
        rollout__n_samples_per_prompt=8,
        train__minibatches=2,
        train__micro_batch_size=8,
        out=str(tmp_path / "run"),
    )
    ctx = build(config)
    try:
        ctx.trainer._start()
        rank = ctx.trainer._local
        twin = rank._shard({n: t.detach().cpu() for n, t in named_weights(ctx.trainer.hf_model).items()}, "cuda")
        ddp = DistributedDataParallel(rank.tconfig, DistributedDataParallelConfig(grad_reduce_in_fp32=True), twin)
        train = config.train
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=train.lr,
                weight_decay=train.weight_decay,
                adam_beta1=train.betas[0],
                adam_beta2=train.betas[1],
                adam_eps=train.adam_eps,
                clip_grad=train.grad_clip,
                bf16=True,
                use_distributed_optimizer=False,
            ),
            [ddp],
        )
        # Megatron's training loop sets each group's lr and weight decay (times its wd_mult) through its scheduler
        schedule = OptimizerParamScheduler(
            optimizer,
            init_lr=train.lr,
            max_lr=train.lr,
            min_lr=0.0,
            lr_warmup_steps=0,
            lr_decay_steps=1,
            lr_decay_style="constant",
            start_wd=train.weight_decay,
            end_wd=train.weight_decay,
            wd_incr_steps=1,
            wd_incr_style="constant",
        )
        inner = optimizer.chained_optimizers[0] if hasattr(optimizer, "chained_optimizers") else optimizer
        for group in inner.optimizer.param_groups:  # torch's AdamW, fused as rlbench's
            group["fused"], group["foreach"] = True, False
        assert (
            sorted(g["weight_decay"] for g in inner.optimizer.param_groups)
            == sorted(g["weight_decay"] for g in rank.optimizer.param_groups)
            == [0.0, 0.1]
        )
        mine, theirs = dict(rank.gpt.named_parameters()), dict(twin.named_parameters())
        assert mine.keys() == theirs.keys()
        grads, norms, updates = {}, [], []
        real_clip, real_step = rank.clip_grads, rank.optimizer_step

        def clip_grads():
            grads.update({name: p.main_grad.detach().clone() for name, p in mine.items()})
            norm = real_clip()
            norms.append([float(norm)])
            return norm

        def optimizer_step():
            real_step()
            for name, p in theirs.items():
                p.main_grad.copy_(grads[name])
            done, norm, _ = optimizer.step()
            assert done
            schedule.step(increment=1)
            norms[-1].append(float(norm))
            masters = [(rank.masters.params[name].detach(), theirs[name].main_param.detach()) for name in mine]
            params = [(mine[name].detach(), theirs[name].detach()) for name in mine]
            updates.append(
                (
                    all(torch.equal(a, b) for a, b in masters),
                    all(torch.equal(a, b) for a, b in params),
                    max(float((a - b).abs().max()) for a, b in masters),
                )
            )
            optimizer.zero_grad()

        rank.clip_grads, rank.optimizer_step = clip_grads, optimizer_step
        loop.first_sync(ctx, 0)
        for step in range(config.steps):
            state = loop.StepState(step)
            for stage in (loop.data, loop.rollout, loop.reward, loop.advantage, loop.logprob, loop.train, loop.sync):
                stage(ctx, state)
    finally:
        ctx.writer.close()
        ctx.trainer.close()
    assert len(updates) == config.steps * train.minibatches
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in norms), norms
    assert all(a > 0 for a, _ in norms), norms
    if clip > 1:
        assert all(a < clip for a, _ in norms)
        assert all(same_masters and same_params for same_masters, same_params, _ in updates), (updates, norms)
    else:
        assert all(a > clip for a, _ in norms if a > 0)  # every update with a gradient clipped
        assert max(gap for _, _, gap in updates) < 1e-7, updates  # lr 1e-3: a few float32 ulps of an update
