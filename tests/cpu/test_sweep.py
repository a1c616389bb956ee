"""The hostile-input sweep: hypothesis corrupts each kind of file rlbench reads (a run directory's every
file: bytes, JSON structure, tensor dtype, shape and values, links; golden files; slime dumps; TOML;
datasets), every command that reads it runs on it, and each must answer as the contract says: exit 0,
1 or 2, a one-line error for 2, no traceback, and no byte changed outside the directory the command owns.

The default keeps to the CPU suite's budget; `RLBENCH_SWEEP_EXAMPLES=300 pytest -m sweep tests/cpu` runs a
larger one. Counts of inputs and commands are collected and printed at the end of the session."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from rlbench.errors import BadInput
from tests.conftest import REPO, cli, record_sweep, RANDOM_INIT_MODEL

# Examples per target: the CPU suite's budget by default; RLBENCH_SWEEP_EXAMPLES=300 for a long sweep. Derandomized,
# so CI meets the same inputs every time (a failure is a finding to fix, never a flaky rerun).
EXAMPLES = int(os.environ.get("RLBENCH_SWEEP_EXAMPLES", "8"))
BUDGET = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
pytestmark = pytest.mark.sweep
RUN_FILES = (
    "manifest.json",
    "metrics.jsonl",
    "checksums.jsonl",
    "rollouts/000001.safetensors",
    "rollouts/000001.json",
    "checkpoints/000002/state.json",
    "checkpoints/000002/model.safetensors",
    "checkpoints/000002/optimizer.json",
    "checkpoints/000002/optimizer.safetensors",
)
ODD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**30), 10**30),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.lists(st.integers(), max_size=3),
    st.just({"nested": {"deeper": [1, 2]}}),
    st.just([[[[]]]]),
)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny complete run (checkpoints at 0 and 2), its golden file, and a directory standing for
    everything outside what the commands own."""
    root = tmp_path_factory.mktemp("sweep")
    config = root / "c.toml"
    config.write_text(
        "steps = 2\ncheckpoint_every = 2\n[data]\nprompts_per_step = 2\n[rollout]\n"
        "n_samples_per_prompt = 2\n[train]\nminibatches = 1\n"
    )
    assert cli("run", "-c", str(config), "--out", str(root / "good"), "--json").returncode == 0
    assert cli("golden", "update", str(root / "good"), str(root / "golden.json"), "--reason", "sweep").returncode == 0
    (root / "outside").mkdir()
    (root / "outside" / "users-file").write_text("precious")
    return root


def _snapshot(*roots: Path) -> dict[str, bytes]:
    files = {}
    for root in roots:
        for p in sorted(root.rglob("*")) if root.is_dir() else [root]:
            if p.is_file() and not p.is_symlink():
                files[str(p)] = p.read_bytes()
    return files


def _check(res, command: list[str]) -> None:
    text = res.stdout + res.stderr
    assert res.returncode in (0, 1, 2), (command, res.returncode, text[-2000:])
    assert "Traceback" not in text, (command, text[-2000:])
    if res.returncode == 2:
        lines = res.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("rlbench: error: "), (command, res.stderr)


def _run_all(commands: list[list[str]], watched: list[Path], owned: list[Path] = ()) -> None:
    """Run each command; nothing outside `owned` may change, and each answers by the contract."""
    before = _snapshot(*watched)
    for command in commands:
        _check(cli(*command), command)
    after = _snapshot(*watched)
    changed = sorted(
        k
        for k in set(before) | set(after)
        if before.get(k) != after.get(k) and not any(k.startswith(str(o)) for o in owned)
    )
    assert not changed, f"written outside what the commands own: {changed[:5]}"
    record_sweep(inputs=1, commands=len(commands), outside_writes=len(changed))


# --------------------------------------------------------------------------- corruptions


def _mutate_json(value, path: list, replacement):
    if not path:
        return replacement
    key = path[0]
    value[key] = _mutate_json(value[key], path[1:], replacement)
    return value


@st.composite
def json_edit(draw, doc):
    """A path to some value inside `doc`, and what to put there."""
    path, node = [], doc
    while isinstance(node, (dict, list)) and node and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else list(range(len(node)))))
        path.append(key)
        node = node[key]
    return path, draw(ODD_VALUES)


@st.composite
def corruption(draw):
    name = draw(st.sampled_from(RUN_FILES))
    kind = draw(st.sampled_from(["truncate", "flip", "garbage", "json", "tensor", "link", "remove", "directory"]))
    return name, kind, draw(st.integers(0, 2**31)), draw(st.floats(0, 1)), draw(ODD_VALUES), draw(st.data())


def _corrupt(run: Path, outside: Path, spec) -> None:
    name, kind, number, fraction, value, data = spec
    path = run / name
    raw = path.read_bytes()
    if kind == "truncate":
        path.write_bytes(raw[: int(len(raw) * fraction)])
    elif kind == "flip":
        i = number % len(raw)
        path.write_bytes(raw[:i] + bytes([raw[i] ^ (1 << (number % 8))]) + raw[i + 1 :])
    elif kind == "garbage":
        path.write_bytes(data.draw(st.binary(max_size=64)))
    elif kind == "link":
        path.unlink()
        path.symlink_to(outside / "users-file")
    elif kind == "remove":
        path.unlink()
    elif kind == "directory":
        path.unlink()
        path.mkdir()
    elif kind == "json" and name.endswith((".json", ".jsonl")):
        lines = raw.decode().splitlines(keepends=True) if name.endswith(".jsonl") else [raw.decode()]
        k = number % len(lines)
        doc = json.loads(lines[k])
        where, replacement = data.draw(json_edit(doc))
        lines[k] = json.dumps(_mutate_json(doc, where, replacement)) + ("\n" if name.endswith(".jsonl") else "")
        path.write_text("".join(lines))
    elif kind == "tensor" and name.endswith(".safetensors"):
        from safetensors.torch import load, save

        tensors = load(raw)
        key = sorted(tensors)[number % len(tensors)]
        t = tensors[key]
        how = data.draw(st.sampled_from(["dtype", "shape", "nan", "negative", "huge", "empty"]))
        t = {
            "dtype": lambda: t.double() if not t.is_floating_point() else t.long(),
            "shape": lambda: t.reshape(1, -1),
            "nan": lambda: t.double().fill_(float("nan")).to(t.dtype) if t.is_floating_point() else t,
            "negative": lambda: -t - 1,
            "huge": lambda: t * 10**9,
            "empty": lambda: t[:0],
        }[how]()
        tensors[key] = t.contiguous()
        if name.startswith("rollouts/"):  # keep the file's own digest consistent: the edit must be caught deeper
            from rlbench.rundir.recording import encode_step

            meta = json.loads((run / "rollouts" / "000001.json").read_text())
            extra = {k: v for k, v in meta.items() if k not in ("schema", "step", "samples", "samples_sha256")}
            path.write_bytes(encode_step(1, tensors, meta["samples"], extra)[0])
        else:
            path.write_bytes(save(tensors))
    else:
        path.write_bytes(raw + b"\x00")  # a kind that does not apply to this file: a stray byte instead


@BUDGET
@given(spec=corruption())
def test_commands_on_a_corrupted_run_directory(base, tmp_path_factory, spec):
    work = tmp_path_factory.mktemp("case")
    run = work / "run"
    shutil.copytree(base / "good", run)
    _corrupt(run, base / "outside", spec)
    resumed = work / "resumed"
    shutil.copytree(run, resumed, symlinks=True)
    commands = [
        ["diff", str(base / "good"), str(run)],
        ["replay", str(run), "--out", str(work / "replay")],
        ["check", "logprobs", str(run)],
        ["check", "tito", str(run)],
        ["check", "golden", str(run), str(base / "golden.json"), "--ignore", "perf/*"],
        ["golden", "update", str(run), str(work / "g.json"), "--reason", "sweep"],
        ["run", "--resume", str(resumed)],
    ]
    _run_all(commands, [base, run, resumed], owned=[work / "replay", work / "g.json", resumed])


@BUDGET
@given(edit=st.data())
def test_commands_on_a_corrupted_golden_file(base, tmp_path_factory, edit):
    work = tmp_path_factory.mktemp("golden")
    golden = work / "golden.json"
    doc = json.loads((base / "golden.json").read_text())
    where, value = edit.draw(json_edit(doc))
    golden.write_text(json.dumps(_mutate_json(doc, where, value)))
    commands = [
        ["check", "golden", str(base / "good"), str(golden)],
        ["check", "golden", str(base / "good"), str(golden), "--tier", "approx", "--ignore", "perf/*"],
        ["golden", "update", str(base / "good"), str(golden), "--reason", "sweep"],
    ]
    _run_all(commands, [base, golden], owned=[golden])


@BUDGET
@given(edit=st.data(), sample=st.integers(0, 7))
def test_import_of_a_corrupted_slime_dump(base, tmp_path_factory, edit, sample):
    work = tmp_path_factory.mktemp("slime")
    dump = torch.load(REPO / "examples" / "slime-dumps" / "rollout_0.pt", weights_only=True)
    where, value = edit.draw(json_edit(dump["samples"][sample]))
    _mutate_json(dump["samples"][sample], where, value)
    path = work / "rollout_0.pt"
    torch.save(dump, path)
    _run_all([["import", "slime", str(path), "--out", str(work / "out")]], [base, path], owned=[work / "out"])
    if not (work / "out").exists():
        return
    _run_all(
        [["check", "tito", str(work / "out")], ["replay", str(work / "out"), "--out", str(work / "r")]],
        [base, work / "out"],
        owned=[work / "r"],
    )


TOML_KEYS = (
    "seed",
    "steps",
    "out",
    "threads",
    "device",
    "checkpoint_every",
    "record",
    "[data] prompts_per_step",
    "[rollout] temperature",
    "[rollout] max_new_tokens",
    "[rollout] sampling_seed",
    "[train] lr",
    "[train] betas",
    "[train] grad_clip",
    "[algo] kl_coef",
    "[algo] eps_clip",
    "[model] path",
    "[data] path",
)


@BUDGET
@given(
    key=st.sampled_from(TOML_KEYS),
    value=st.one_of(
        st.integers(-(10**20), 10**20),
        st.floats(allow_nan=True),
        st.booleans(),
        st.text(max_size=12),
        st.lists(st.integers(-3, 3), max_size=3),
        st.just("inf"),
        st.just(-1),
    ),
)
def test_run_with_a_hostile_toml_value(base, tmp_path_factory, key, value):
    work = tmp_path_factory.mktemp("toml")
    table, _, name = key.rpartition(" ")
    rendered = (
        json.dumps(value) if not isinstance(value, float) else repr(value).replace("nan", "nan").replace("inf", "inf")
    )
    text = "steps = 1\n" if name != "steps" else ""
    body = f"{name} = {rendered}\n"
    text = (body + text) if not table else (text + f"{table}\n{body}")
    config = work / "c.toml"
    config.write_text(text)
    _run_all(
        [["run", "-c", str(config), "--out", str(work / "out"), "--json"]],
        [base, config],
        owned=[work / "out", REPO / "runs"],
    )


@BUDGET
@given(
    rows=st.lists(
        st.one_of(
            st.fixed_dictionaries({"prompt": st.text(max_size=30), "label": st.sampled_from(["even", "odd"])}),
            st.dictionaries(st.sampled_from(["prompt", "label", "x"]), ODD_VALUES, max_size=3),
            st.just({"prompt": [{"role": "wizard", "content": 1}], "label": "even"}),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_run_with_a_hostile_dataset(base, tmp_path_factory, rows):
    work = tmp_path_factory.mktemp("data")
    data = work / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = work / "c.toml"
    config.write_text(
        f"steps = 1\n[data]\npath = '{data}'\nprompts_per_step = 1\n[rollout]\nn_samples_per_prompt = 2\n"
        "[train]\nminibatches = 1\n"
    )
    _run_all([["run", "-c", str(config), "--out", str(work / "out"), "--json"]], [base, data], owned=[work / "out"])


# --------------------------------------------------------------------------- issue 26: the second round's surfaces


MEGATRON_KEYS = (
    "sequence_parallel",
    "init_method_std",
    "num_moe_experts",
    "recompute_granularity",
    "window_size",
    "init_method",
    "attention_backend",
    "bf16",
    "fp16",
    "fp8",
    "fp8_param",
    "no_such_field",
    "hidden_size",
    "layernorm_zero_centered_gamma",
    "moe_router_topk",
    "cuda_graph_scope",
)
TOML_VALUES = st.one_of(
    st.integers(-(10**20), 10**20),
    st.floats(allow_nan=True),
    st.booleans(),
    st.text(max_size=12),
    st.lists(st.integers(-3, 3), max_size=3),
    st.just("full"),
    st.just(0.02),
    st.just(True),
)


def _toml_value(value) -> str:
    """A drawn value as TOML writes it: JSON's, but a float as Python writes it (nan, inf, 1e+20)."""
    return repr(value) if isinstance(value, float) else json.dumps(value)


@BUDGET
@given(
    key=st.sampled_from(MEGATRON_KEYS), value=TOML_VALUES, ranks=st.sampled_from([(1, 1), (1, 2), (2, 512), (64, 16)])
)
def test_megatron_run_with_a_hostile_table_or_rank_count(base, tmp_path_factory, monkeypatch, key, value, ranks):
    """Refused before any rank starts (one line), or a one-rank run: a rank process is never started here
    (this machine is held to one CPU, so every tp * dp above 1 is refused)."""
    from rlbench.backends import registry
    from rlbench.backends.megatron import launch

    monkeypatch.setattr(registry, "available_cpus", lambda: 1)
    monkeypatch.setattr(launch.Processes, "start", lambda *a: pytest.fail("a rank process was started"))
    work = tmp_path_factory.mktemp("megatron")
    config = work / "c.toml"
    config.write_text(
        f"steps = 1\n[data]\nprompts_per_step = 1\n[rollout]\nn_samples_per_prompt = 2\n[train]\n"
        f"backend = 'megatron'\nminibatches = 1\n[train.megatron]\n{key} = {_toml_value(value)}\n"
    )
    tp, dp = ranks
    _run_all(
        [["run", "-c", str(config), "--tp", str(tp), "--dp", str(dp), "--out", str(work / "out"), "--json"]],
        [base, config],
        owned=[work / "out"],
    )


RAY_HOSTS = st.sampled_from(["127.0.0.1", "[::1]", "", "::1", "a b", "localhost", "[zz]"])
RAY_ADDRESSES = st.one_of(
    st.builds(
        lambda scheme, host, port: f"{scheme}{host}:{port}",
        st.sampled_from(["", "ray://", "http://", "grpc://"]),
        RAY_HOSTS,
        st.integers(-5, 70_000),
    ),
    st.text(max_size=20).filter(lambda t: "\x00" not in t),
    st.just("auto"),
)


@BUDGET
@given(address=RAY_ADDRESSES)
def test_run_with_a_hostile_ray_address(base, tmp_path_factory, monkeypatch, address):
    """Refused by the config, by the probe (nothing listens, not a gRPC server) or by Ray, in one line within
    --ray-timeout. Ray is never really joined here: ray.init refuses (a cluster of this machine may listen on a
    port the sweep draws)."""
    import ray

    def refuse(*args, **kwargs):
        raise ConnectionError("the sweep does not join clusters")

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    work = tmp_path_factory.mktemp("ray")
    config = work / "c.toml"
    config.write_text(
        "steps = 1\n[data]\nprompts_per_step = 1\n[rollout]\nn_samples_per_prompt = 2\n[train]\nminibatches = 1\n"
    )
    _run_all(
        [
            [
                "run",
                "-c",
                str(config),
                "--placement",
                "ray",
                "--ray-address",
                address,
                "--ray-timeout",
                "1",
                "--out",
                str(work / "out"),
                "--json",
            ]
        ],
        [base, config],
        owned=[work / "out"],
    )


@BUDGET
@given(edit=st.data(), sample=st.integers(0, 3))
def test_commands_on_a_recording_whose_sample_json_is_edited_consistently(base, tmp_path_factory, edit, sample):
    """A sample's JSON edited and its digest recomputed (a deliberate edit, or another tool's writer): only the
    readers' own checks stand between it and the loop."""
    from rlbench.rundir.recording import _samples_digest

    work = tmp_path_factory.mktemp("samples")
    run = work / "run"
    shutil.copytree(base / "good", run)
    path = run / "rollouts" / "000000.json"
    meta = json.loads(path.read_text())
    if edit.draw(st.booleans()):
        meta["samples"][sample].pop(edit.draw(st.sampled_from(sorted(meta["samples"][sample]))))
    else:
        where, value = edit.draw(json_edit(meta["samples"][sample]))
        meta["samples"][sample] = _mutate_json(meta["samples"][sample], where, value)
    meta["samples_sha256"] = _samples_digest(meta["samples"])
    path.write_text(json.dumps(meta))
    _run_all(
        [
            ["replay", str(run), "--steps", "0:1", "--out", str(work / "replay")],
            ["diff", str(base / "good"), str(run)],
            ["run", "--mode", "train-only", "--rollouts", str(run), "--steps", "1", "--out", str(work / "t")],
        ],
        [base, run],
        owned=[work / "replay", work / "t"],
    )


MODEL_KEYS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "head_dim",
    "max_position_embeddings",
)


@BUDGET
@given(
    key=st.sampled_from(MODEL_KEYS),
    value=st.one_of(
        st.integers(-(10**30), 0),
        st.integers(2**31, 10**30),
        st.floats(allow_nan=True),
        st.booleans(),
        st.text(max_size=8),
        st.lists(st.integers(), max_size=2),
    ),
)
def test_run_with_a_model_config_of_hostile_sizes(base, tmp_path_factory, key, value):

    work = tmp_path_factory.mktemp("model")
    model = work / "model"
    shutil.copytree(RANDOM_INIT_MODEL, model)
    doc = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**doc, key: value}))
    config = work / "c.toml"
    config.write_text(f"steps = 1\n[model]\npath = '{model}'\ninit = 'random'\n")
    _run_all([["run", "-c", str(config), "--out", str(work / "out"), "--json"]], [base, model], owned=[work / "out"])


TEMPLATES = st.one_of(
    st.text(max_size=40),
    st.sampled_from(
        [
            "{{ messages | no_such_filter }}",
            "{% if %}",
            "{{ raise_exception('no system prompt') }}",
            "{{ 1 / 0 }}",
            "{% for m in messages %}{{ m.content }}",
            "{{ messages[99].content.upper() }}",
            "{{ messages[0]['content'] * 3 }}",
            "{{ ''.join(messages) }}",
            "{% set x = undefined_thing.attr %}",
        ]
    ),
)


@BUDGET
@given(template=TEMPLATES)
def test_run_with_a_hostile_chat_template(base, tmp_path_factory, template):
    from rlbench.config import ModelConfig

    work = tmp_path_factory.mktemp("template")
    tok = work / "tok"
    shutil.copytree(ModelConfig().tokenizer, tok)
    doc = json.loads((tok / "tokenizer_config.json").read_text())
    (tok / "tokenizer_config.json").write_text(json.dumps({**doc, "chat_template": template}))
    config = work / "c.toml"
    config.write_text(
        f"steps = 1\n[model]\ntokenizer = '{tok}'\n[data]\nprompts_per_step = 1\n[rollout]\n"
        "n_samples_per_prompt = 2\n[train]\nminibatches = 1\n"
    )
    _run_all([["run", "-c", str(config), "--out", str(work / "out"), "--json"]], [base, tok], owned=[work / "out"])


@BUDGET
@given(cut=st.floats(0, 1), garbage=st.binary(max_size=64), kind=st.sampled_from(["empty", "cut", "garbage"]))
def test_import_of_a_dump_that_is_no_torch_file(base, tmp_path_factory, cut, garbage, kind):
    work = tmp_path_factory.mktemp("dumpbytes")
    raw = (REPO / "examples" / "slime-dumps" / "rollout_0.pt").read_bytes()
    path = work / "rollout_0.pt"
    path.write_bytes({"empty": b"", "cut": raw[: int(len(raw) * cut)], "garbage": garbage}[kind])
    _run_all([["import", "slime", str(path), "--out", str(work / "out")]], [base, path], owned=[work / "out"])


WRONG_SECTIONS = [  # a manifest section (a table) holding a value of another type, as a hand or another tool may write
    (("config", "model"), "qwen-tiny"),
    (("config", "rollout"), [1, 2]),
    (("config", "rollout", "sglang"), "x"),
    (("config", "train"), None),
    (("hashes",), "abc"),
    (("versions",), 3),
    (("numerics",), []),
    (("vocab",), 5),
]


@pytest.mark.parametrize("where, value", WRONG_SECTIONS, ids=lambda v: ".".join(v) if isinstance(v, tuple) else None)
def test_every_command_refuses_a_manifest_section_of_the_wrong_type_by_name(base, tmp_path, where, value):
    """`config.model` a string (and every other section of the wrong type): each command that reads the run
    directory answers exit 2 with one line naming manifest.json, the field and what was expected."""
    run = tmp_path / "run"
    shutil.copytree(base / "good", run)
    manifest = json.loads((run / "manifest.json").read_text())
    (run / "manifest.json").write_text(json.dumps(_mutate_json(manifest, list(where), value)))
    commands = [
        ["check", "tito", str(run)],
        ["check", "golden", str(run), str(base / "golden.json")],
        ["check", "logprobs", str(run)],
        ["replay", str(run), "--out", str(tmp_path / "replay")],
        ["diff", str(base / "good"), str(run)],
        ["report", str(run), "--out", str(tmp_path / "r.html")],
        ["golden", "update", str(run), str(tmp_path / "g.json"), "--reason", "sweep"],
        ["run", "--resume", str(run)],
    ]
    for command in commands:
        res = cli(*command)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1, (command, res.returncode, res.stderr)
        assert f"manifest.json: {'.'.join(where)}: expected an object" in lines[0], (command, lines[0])


def test_check_manifest_sections_names_the_type_it_found_and_leaves_absent_sections_to_their_readers():
    """The refusal says what the section holds (null, a string, a list, a number) and names the field; a
    section absent (no `rollout` table in the config, no `platform`) or a manifest section written as null (older
    runs) is not refused here."""
    from rlbench.rundir.sections import check_sections

    path = Path("/runs/x/manifest.json")
    for made, field, got in [
        ({"config": {"train": None}}, "config.train", "null"),
        ({"config": {"model": "qwen-tiny"}}, "config.model", "str"),
        ({"config": {"rollout": {"sglang": [1]}}}, "config.rollout.sglang", "list"),
        ({"platform": "x86"}, "platform", "str"),
        ({"vocab": 5, "config": {"model": "m"}}, "vocab", "int"),  # the manifest's own sections first
    ]:
        with pytest.raises(BadInput) as refused:
            check_sections(made, path)
        assert str(refused.value) == f"{path}: {field}: expected an object (a table), got {got}"
        assert (refused.value.path, refused.value.field) == (str(path), field)
    check_sections({"config": {"model": {}}, "platform": None, "hashes": None}, path)  # absent or null: no refusal
    check_sections({}, path)
