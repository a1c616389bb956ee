"""float64 on the CPU (issue 24): `model.dtype = "float64"` accepted where it runs (the CPU, the embedded
engine, either trainer) and refused in one line where it cannot; the megatron GPTModel in float64 computes
the transformers model's float64 logits; the manifest and the golden identity name the dtype; and diff's
advice to rerun in float64, shown for float32 runs of different layouts that part by a rounding-sized gap
and for no other pair; and (issue 53) the torch and megatron trainers training alike in float64 on a run whose
samples hold the pad id. The TP/DP invariance runs themselves are in test_megatron_parallel.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlbench.config import load_config
from rlbench.config_sections import FIXTURES
from rlbench.errors import BadInput
from rlbench.replay.diff import NOISE_GAP, Difference, layout_advice
from tests.conftest import RANDOM_INIT_MODEL

MODEL = FIXTURES / "models" / "tiny-qwen3"


@pytest.mark.parametrize("overrides", [{}, {"train__backend": "megatron"}, {"train__backend": "megatron", "tp": 2}])
def test_float64_is_accepted_on_the_cpu_with_either_trainer(overrides):
    assert load_config(model__dtype="float64", **overrides).model.dtype == "float64"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"device": "cuda"},
            "model.dtype: expected float32 or bfloat16 on cuda (float64 runs on the CPU only), got 'float64'",
        ),
        (
            {"rollout__backend": "sglang"},
            "model.dtype: expected float32 or bfloat16 with the sglang rollout (SGLang "
            "serves no float64; float64 runs with the embedded engine, hf), got 'float64'",
        ),
    ],
)
def test_float64_is_refused_where_it_cannot_run(overrides, message):
    with pytest.raises(BadInput) as info:
        load_config(model__dtype="float64", **overrides)
    assert str(info.value).splitlines() == [message]


def test_the_megatron_trainer_takes_float32_float64_and_bfloat16_and_unknown_dtypes_are_refused():
    for dtype in ("float32", "float64", "bfloat16"):  # bfloat16: over fp32 masters (test_mixed_precision.py)
        assert load_config(model__dtype=dtype, train__backend="megatron").model.dtype == dtype
    with pytest.raises(BadInput, match=r"model\.dtype: expected float32, bfloat16 or float64, got 'float16'"):
        load_config(model__dtype="float16")


def test_a_float64_run_records_its_dtype_and_the_golden_identity_keys_on_it(tmp_path):
    from rlbench.checks.golden import config_hash, config_identity
    from rlbench.session import run
    from rlbench.rundir.recording import read_step

    config = load_config(
        model__dtype="float64",
        steps=1,
        data__prompts_per_step=2,
        rollout__n_samples_per_prompt=4,
        train__minibatches=2,
        out=str(tmp_path / "f64"),
    )
    run(config)
    manifest = json.loads((tmp_path / "f64" / "manifest.json").read_text())
    assert manifest["config"]["model"]["dtype"] == "float64"
    from safetensors.torch import load_file

    weights = load_file(tmp_path / "f64" / "checkpoints" / "000001" / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.float64}  # trained and saved in float64
    assert read_step(tmp_path / "f64", 0)[0]["old_logprobs"].dtype == torch.float32  # the recording's schema
    as_float32 = json.loads(json.dumps(manifest))
    as_float32["config"]["model"]["dtype"] = "float32"
    assert config_hash(config_identity(manifest)) != config_hash(config_identity(as_float32))


def _rms_norm_in_the_inputs_dtype(self, hidden: torch.Tensor) -> torch.Tensor:
    """Qwen3RMSNorm.forward without its cast to float32."""
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


def test_the_megatron_model_in_float64_computes_the_hf_models_float64_logits(one_rank, monkeypatch):
    """Up to transformers' RMSNorm, which computes in float32 whatever the model's dtype: as it is, the
    transformers model in float64 is float32-close to megatron's (8.5e-8 measured); with its norm in float64,
    the two agree to float64 rounding (5.6e-16 measured)."""
    from transformers.models.qwen3 import modeling_qwen3

    from rlbench.backends.megatron import convert
    from rlbench.backends.megatron import model as mmodel
    from rlbench.core.model import build_model, load_model_config, named_weights

    hf = build_model(MODEL, master_seed=7, dtype="float64", init="random")
    config, dims = load_model_config(MODEL), mmodel.dims_of(load_model_config(MODEL), 1, MODEL)
    tconfig = mmodel.transformer_config(config, dims, 1, False, "cpu", {}, "float64")
    gpt = mmodel.build(config, dims, tconfig)
    assert {p.dtype for p in gpt.parameters()} == {torch.float64}  # the norms too (made float32, then cast)
    gpt.load_state_dict(convert.to_megatron(named_weights(hf), dims), strict=True)
    ids = torch.randint(0, dims.vocab, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = mmodel.logits(gpt, ids)
        assert got.dtype == hf(input_ids=ids).logits.dtype == torch.float64
        assert 1e-9 < float((got - hf(input_ids=ids).logits).abs().max()) < 1e-6
        monkeypatch.setattr(modeling_qwen3.Qwen3RMSNorm, "forward", _rms_norm_in_the_inputs_dtype)
        assert float((got - hf(input_ids=ids).logits).abs().max()) < 1e-13


def _pad_run(out: Path, backend: str):
    """Two float64 steps from random weights, whose samples hold the pad id 0 at seed 27 (a random policy samples
    any of the 314 ids: 1 of 200 tokens at step 0, 2 at step 1), under a dense reward so every sample trains."""
    from rlbench.session import run

    return run(
        load_config(
            seed=27,
            model__path=str(RANDOM_INIT_MODEL),
            model__init="random",
            model__dtype="float64",
            algo__kl_coef=0.0,
            train__lr=1e-3,
            steps=2,
            checkpoint_every=2,
            data__prompts_per_step=2,
            rollout__n_samples_per_prompt=4,
            rollout__max_new_tokens=8,
            train__minibatches=1,
            reward__custom_rm_path="tests.cpu.plugins.rewards.response_length",
            train__backend=backend,
            out=str(out),
        )
    )


def _weight_gap(a: Path, b: Path) -> float:
    from rlbench.core.model import load_safetensors

    wa, wb = (load_safetensors(run / "checkpoints" / "000002" / "model.safetensors") for run in (a, b))
    assert sorted(wa) == sorted(wb)
    return max(float((wa[name] - wb[name]).abs().max()) for name in wa)


def test_both_trainers_train_the_pad_ids_embedding_row_alike_in_float64(tmp_path, monkeypatch):
    """megatron-core's embedding has no padding index, so the pad id's row takes the gradient of its lookups; the
    torch trainer drops transformers' `padding_idx` to do the same (torch_trainer.train_every_row). With the pad id
    sampled mid-response, the two trainers' weights after two steps agree to float64 rounding (1.7e-15 measured,
    with transformers' RMSNorm computing in float64 as megatron's does: see the test above); with the padding index
    left in place (the control below: this test fails without the fix) they part by 4e-3, the pad row first."""
    from transformers.models.qwen3 import modeling_qwen3

    from rlbench.backends import torch_trainer
    from rlbench.rundir.recording import read_step

    monkeypatch.setattr(modeling_qwen3.Qwen3RMSNorm, "forward", _rms_norm_in_the_inputs_dtype)
    _pad_run(tmp_path / "torch", "torch")
    _pad_run(tmp_path / "megatron", "megatron")
    for step in (0, 1):
        ours, theirs = read_step(tmp_path / "torch", step)[0], read_step(tmp_path / "megatron", step)[0]
        assert torch.equal(ours["tokens"], theirs["tokens"])
        ends = set(ours["offsets"][1:].tolist())  # a sample's last token is no input to a loss-bearing position
        pads = [i for i in (ours["tokens"] == 0).nonzero().flatten().tolist() if i + 1 not in ends]
        assert pads and all(bool(ours["loss_mask"][i]) for i in pads), step  # sampled, then read as an input
    assert _weight_gap(tmp_path / "torch", tmp_path / "megatron") < 1e-12
    monkeypatch.setattr(torch_trainer, "train_every_row", lambda model: model)  # transformers' padding_idx kept
    _pad_run(tmp_path / "padding-idx", "torch")
    assert _weight_gap(tmp_path / "padding-idx", tmp_path / "megatron") > 1e-4


def _manifest(tp: int, dp: int, dtype: str) -> dict:
    return {"config": {"tp": tp, "dp": dp, "model": {"dtype": dtype}}}


def _gap(rel: float | None, stage: str = "loss") -> Difference:
    return Difference(1, stage, "minibatch 1", 0.5, 0.5 * (1 + (rel or 0)), 0.5 * (rel or 0), 1, rel)


def test_advice_for_float32_layouts_parting_by_a_rounding_sized_gap():
    advice = layout_advice(_manifest(1, 1, "float32"), _manifest(2, 1, "float32"), _gap(2.4e-6))
    assert advice.startswith(
        "the runs differ in parallel layout (A: tp 1, dp 1, float32; B: tp 2, dp 1, float32) "
        "and part by 2.4e-06 relative"
    )
    assert 'rerun both with dtype = "float64" in the [model] table of --config' in advice
    bf16 = layout_advice(_manifest(1, 1, "bfloat16"), _manifest(2, 2, "bfloat16"), _gap(1.39e-2, "old_logprobs"))
    assert "(A: tp 1, dp 1, bfloat16; B: tp 2, dp 2, bfloat16) and part by 0.014 relative, a gap bfloat16" in bf16
    for a, b, gap in (
        (_manifest(1, 1, "float32"), _manifest(1, 2, "bfloat16"), _gap(NOISE_GAP["bfloat16"], "grads")),
        (_manifest(1, 1, "bfloat16"), _manifest(2, 2, "bfloat16"), _gap(1.39e-2, "old_logprobs")),  # 4B on 4 GPUs
        (_manifest(1, 1, "float32"), _manifest(2, 1, "float32"), _gap(NOISE_GAP["float32"])),
        (_manifest(1, 1, "float64"), _manifest(2, 1, "float32"), _gap(1e-7, "old_logprobs")),
    ):
        assert layout_advice(a, b, gap) is not None, (a, b)


@pytest.mark.parametrize(
    "a, b, first",
    [
        (_manifest(1, 1, "float32"), _manifest(1, 1, "float32"), _gap(2.4e-6)),  # the same layout
        (_manifest(2, 1, "float32"), _manifest(2, 1, "float32"), _gap(2.4e-6)),
        (_manifest(1, 1, "float64"), _manifest(2, 1, "float64"), _gap(2.4e-6)),  # float64 already
        (_manifest(1, 1, "float32"), _manifest(2, 1, "float32"), None),  # no difference
        (_manifest(1, 1, "float32"), _manifest(2, 1, "float32"), _gap(2 * NOISE_GAP["float32"])),  # too large
        (_manifest(1, 1, "float32"), _manifest(2, 1, "float32"), _gap(1.39e-2)),  # bf16's noise, not float32's
        (_manifest(1, 1, "bfloat16"), _manifest(2, 2, "bfloat16"), _gap(2 * NOISE_GAP["bfloat16"])),
        (_manifest(1, 1, "float32"), _manifest(2, 1, "float32"), _gap(None, "grads")),  # a checksum only: gap unknown
        (_manifest(1, 1, "float32"), _manifest(2, 1, "float32"), _gap(1e-7, "rewards")),  # rounding does not reach it
        ({"config": {"model": {"dtype": "float32"}}}, _manifest(2, 1, "float32"), _gap(1e-7)),  # A's layout unknown
        (_manifest(1, 1, "float32"), {"config": {"tp": 2, "dp": 1}}, _gap(1e-7)),  # B's dtype unknown
    ],
)
def test_no_advice_otherwise(a, b, first):
    assert layout_advice(a, b, first) is None
