"""`check tito RUN|JSONL`, lens by lens, each verdict both ways: a default run trains on exactly what its
engine sampled (no drift, however non-canonical the sampled ids: a random policy's are); an edit between engine
and trainer is caught where it is; an imported dump with no engine ids is judged by its evidence; a JSONL is held to
the template's re-render without calling its closing whitespace or a truncated reply drift."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from rlbench.checks import tito
from rlbench.checks.tito_run import EVIDENCE_NATS, check_run
from rlbench.core.model import load_tokenizer
from tests.conftest import REPO, run_cli, RANDOM_INIT_MODEL
from tests.cpu.recordings import bump_response_token, copy_run
from tests.cpu.test_import_slime import slime_sample

QWEN = REPO / "rlbench" / "fixtures" / "tokenizers" / "qwen-tiny"
TOK = load_tokenizer(QWEN)


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    from rlbench.config import load_config
    from rlbench.session import run

    out = tmp_path_factory.mktemp("tito") / "run"
    run(load_config(out=str(out), steps=3, data__prompts_per_step=4, rollout__n_samples_per_prompt=8))
    return out


@pytest.fixture(scope="module")
def random_policy_run(tmp_path_factory):
    """The default run's task and size from random weights: a random policy samples non-canonical ids all the time
    (the default's warm-started policy answers in its trained format, whose ids are canonical)."""
    from rlbench.config import load_config
    from rlbench.session import run

    out = tmp_path_factory.mktemp("tito-random") / "run"
    run(
        load_config(
            out=str(out),
            steps=3,
            data__prompts_per_step=4,
            rollout__n_samples_per_prompt=8,
            model__path=str(RANDOM_INIT_MODEL),
            model__init="random",
        )
    )
    return out


# --------------------------------------------------------------------------- trained vs sampled


def test_a_default_run_trains_on_what_its_engine_sampled(default_run):
    report = check_run(default_run)
    assert report.lens == "sampled" and report.findings == [] and report.compared == report.samples == 96
    res = run_cli("check", "tito", str(default_run))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no drift: the trained ids of all 96 samples are the ids the engine sampled" in res.stdout


def test_a_random_policys_non_canonical_ids_are_reported_apart_never_a_finding(random_policy_run):
    report = check_run(random_policy_run)
    assert report.lens == "sampled" and report.findings == [] and report.compared == report.samples == 96
    assert report.non_canonical > 0
    res = run_cli("check", "tito", str(random_policy_run))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "no drift: the trained ids of all 96 samples are the ids the engine sampled" in res.stdout
    assert "canonical re-tokenisation" in res.stdout
    ex = report.example
    assert tito.canonical(TOK, ex["sampled"]) == ex["canonical"] != ex["sampled"]


def test_an_id_changed_between_engine_and_trainer_is_found_where_it_is(default_run, tmp_path):
    edited = copy_run(default_run, tmp_path / "edited")
    step, sample = 1, 5
    bump_response_token(edited, step, sample, 0)
    report = check_run(edited)
    [f] = report.findings
    prompt = len(
        json.loads((edited / "rollouts" / "000001.json").read_text())["samples"][sample]["turns"][0]["prompt_ids"]
    )
    assert (f.step, f.sample, f.finding.index, f.finding.strict) == (step, sample, prompt, True)
    assert f.where == "turn 0 vs the trained ids" and f.finding.got != f.finding.expected
    res = run_cli("check", "tito", str(edited))
    assert res.returncode == 1 and "no drift" not in res.stdout


# --------------------------------------------------------------------------- evidence (imported dumps)


def _same_length_resegmentation() -> tuple[str, list[int], list[int]]:
    """A text whose canonical ids and a piecewise encoding of it differ at equal length (two vocabulary
    words joined: 'tantool' is ['tant', 'ool'] but ['tan', 'tool'] when encoded in two pieces)."""
    vocab = TOK.backend_tokenizer.get_vocab(with_added_tokens=False)
    words = sorted((w for w in vocab if len(w) >= 3 and w.isalpha()), key=lambda w: (-len(w), w))
    for a in words:
        for b in words:
            text = TOK.decode([vocab[a], vocab[b]])
            canon = TOK.encode(text)
            for k in range(1, len(text)):
                pieces = TOK.encode(text[:k]) + TOK.encode(text[k:])
                if len(pieces) == len(canon) and pieces != canon:
                    return text, canon, pieces
    raise AssertionError("no equal-length re-segmentation in the fixture vocabulary")


@pytest.fixture(scope="module")
def peaky_model(tmp_path_factory):
    """The fixture model with large weights: its log-probs of different ids are nats apart, as a trained
    model's are (the seeded init is near uniform), so log-prob evidence can tell ids apart."""
    from safetensors.torch import save_file

    from rlbench.core.model import build_model, named_weights

    model = build_model(RANDOM_INIT_MODEL, 7, init="random")
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(40)
    out = tmp_path_factory.mktemp("peaky") / "model"
    out.mkdir()
    shutil.copy(RANDOM_INIT_MODEL / "config.json", out / "config.json")
    save_file({k: v.contiguous() for k, v in named_weights(model).items()}, str(out / "model.safetensors"))
    return out, model


def _logprobs(model, ids: list[int], prompt: int) -> list[float]:
    from rlbench.core.algo import sequence_logprobs

    return sequence_logprobs(model, torch.tensor(ids), 1.0, "cpu")[prompt:].tolist()


def _dump(tmp_path, model, special: list[int], engine_ids: list[int]) -> list:
    """8 samples of slime's format; sample 3 trains on `special` response ids while its engine log-probs
    are those of `engine_ids` (the same ids: it sampled them; other ids: it did not)."""
    samples = []
    for j in range(8):
        s = slime_sample(TOK, 0, j, 7 + j, ["even", "odd"][j % 2], float(j % 2))
        prompt = len(s["tokens"]) - s["response_length"]
        if j == 3:
            s["tokens"] = s["tokens"][:prompt] + special
            s["response_length"] = len(special)
            s["loss_mask"] = [1] * len(special)
            s["rollout_log_probs"] = _logprobs(model, s["tokens"][:prompt] + engine_ids, prompt)
        else:
            s["rollout_log_probs"] = _logprobs(model, s["tokens"], prompt)
        samples.append(s)
    path = tmp_path / "rollout_0.pt"
    torch.save({"rollout_id": 0, "samples": samples}, path)
    return path


def _import(tmp_path, dump, model_dir) -> str:
    out = tmp_path / "imported"
    res = run_cli("import", "slime", str(dump), "--out", str(out), "--model", str(model_dir), "--tokenizer", str(QWEN))
    assert res.returncode == 0, res.stderr
    return str(out)


def test_an_imported_non_canonical_sample_the_engine_sampled_is_not_drift(tmp_path, peaky_model):
    model_dir, model = peaky_model
    _, canon, pieces = _same_length_resegmentation()
    run = _import(tmp_path, _dump(tmp_path, model, pieces, pieces), model_dir)
    undetermined = run_cli("check", "tito", run)
    assert undetermined.returncode == 0, undetermined.stdout + undetermined.stderr
    assert (
        "1 of 8 samples are not the canonical encoding" in undetermined.stdout
        and "no drift" not in undetermined.stdout
        and "separator" not in undetermined.stdout
    )  # 7 clean samples: no noise
    report = check_run(run, model_dir=model_dir)
    assert report.lens == "evidence" and report.findings == [] and report.evidence == {"sampled": 1}
    res = run_cli("check", "tito", run, "--model", str(model_dir))
    assert res.returncode == 0 and "no drift found by evidence over 8 samples" in res.stdout


def test_an_imported_sample_built_from_other_ids_than_the_engine_sampled_is_mode_1(tmp_path, peaky_model):
    model_dir, model = peaky_model
    answer, canon, pieces = _same_length_resegmentation()
    run = _import(tmp_path, _dump(tmp_path, model, pieces, canon), model_dir)
    report = check_run(run, model_dir=model_dir)
    [f] = report.findings
    prompt = len(
        TOK.apply_chat_template(
            [{"role": "user", "content": "Is 10 even or odd?"}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
    )
    p = next(i for i in range(len(pieces)) if pieces[i] != canon[i])
    assert (f.sample, f.finding.mode, f.finding.number, f.finding.index) == (3, "reencode", 1, prompt + p)
    assert f.finding.got[0] == pieces[p] and f.finding.expected[0] == canon[p]
    assert f"> {EVIDENCE_NATS}" in f.where and report.evidence == {"retokenised": 1}
    assert run_cli("check", "tito", run, "--model", str(model_dir)).returncode == 1


def test_a_dump_whose_engine_scored_another_number_of_tokens_is_refused_naming_the_drift(tmp_path, peaky_model):
    model_dir, model = peaky_model
    dump = _dump(
        tmp_path,
        model,
        TOK.encode("odd") + [TOK.eos_token_id],
        TOK.encode("o") + TOK.encode("d") + TOK.encode("d") + [TOK.eos_token_id],
    )
    res = run_cli("import", "slime", str(dump), "--out", str(tmp_path / "x"), "--tokenizer", str(QWEN))
    assert res.returncode == 2 and "re-tokenised after generation" in res.stderr and not (tmp_path / "x").exists()


def test_import_without_a_model_holds_ids_to_the_tokenizers_vocabulary(tmp_path):
    """A bigger tokenizer than the fixture model's vocabulary: its ids are fine without --model."""
    from tests.cpu.test_import_slime import write_dumps

    big = REPO / "rlbench" / "fixtures" / "tokenizers" / "tito-clean"  # the fixture vocabulary plus 4 added tokens
    dumps = write_dumps(tmp_path)
    data = torch.load(dumps[0], weights_only=True)
    extra = len(TOK)  # the first id past qwen-tiny's vocabulary: <think> in tito-clean
    data["samples"][0]["tokens"][-2] = extra
    torch.save(data, dumps[0])
    res = run_cli("import", "slime", *map(str, dumps), "--out", str(tmp_path / "ok"), "--tokenizer", str(big))
    assert res.returncode == 0, res.stderr
    res = run_cli("import", "slime", *map(str, dumps), "--out", str(tmp_path / "no"), "--tokenizer", str(QWEN))
    assert res.returncode == 2 and f"token id {extra} is outside the tokenizer's vocabulary ({QWEN})" in res.stderr
    res = run_cli(
        "import",
        "slime",
        *map(str, dumps),
        "--out",
        str(tmp_path / "m"),
        "--tokenizer",
        str(big),
        "--model",
        str(RANDOM_INIT_MODEL),
    )
    assert res.returncode == 2 and "outside the model's vocabulary" in res.stderr


# --------------------------------------------------------------------------- JSONL: the template's re-render


def _jsonl(tmp_path, rows) -> str:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _prompt(n=7):
    messages = [{"role": "user", "content": f"Is {n} even or odd?"}]
    return messages, TOK.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]


def test_jsonl_closing_whitespace_and_a_truncated_reply_are_not_drift(tmp_path):
    """qwen-tiny renders '<|im_end|>\\n' after the last message (as Qwen does); the engine stops at
    <|im_end|>. And a reply cut at max_tokens is closed by the rendering with an <|im_end|> never sampled."""
    messages, prompt = _prompt()
    clean = prompt + TOK.encode("odd") + [TOK.eos_token_id]
    cut = prompt + TOK.encode("The answer")
    rows = [
        {"messages": messages + [{"role": "assistant", "content": "odd"}], "token_ids": clean},
        {"messages": messages + [{"role": "assistant", "content": "The answer", "truncated": True}], "token_ids": cut},
    ]
    report = check_run(_jsonl(tmp_path, rows), QWEN)
    assert report.samples == 2 and report.findings == []


def test_jsonl_same_text_other_ids_is_mode_1_despite_closing_whitespace(tmp_path):
    messages, prompt = _prompt()
    answer, canon, pieces = _same_length_resegmentation()
    ids = prompt + pieces + [TOK.eos_token_id]
    report = check_run(
        _jsonl(tmp_path, [{"messages": messages + [{"role": "assistant", "content": answer}], "token_ids": ids}]), QWEN
    )
    [f] = report.findings
    p = next(i for i in range(len(pieces)) if pieces[i] != canon[i])
    assert (f.finding.mode, f.finding.index) == ("reencode", len(prompt) + p)
    assert f.finding.got[0] == pieces[p] and f.finding.expected[0] == canon[p]


TITO_CLEAN = REPO / "rlbench" / "fixtures" / "tokenizers" / "tito-clean"


def _clean_row(tools=None, **extra):
    """A tool conversation as tito-clean renders it, its trained ids that rendering (with or without tools)."""
    tok = load_tokenizer(TITO_CLEAN)
    messages = [
        {"role": "user", "content": "Is 3 plus 4 odd?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "3+4"}}}
            ],
        },
        {"role": "tool", "content": "7"},
        {"role": "assistant", "content": "odd"},
    ]
    ids = tok.apply_chat_template(messages, tools=tools, tokenize=True)["input_ids"]
    return {"messages": messages, "token_ids": ids, **({"tools": tools} if tools else {}), **extra}, tok


def test_jsonl_rows_render_with_their_tools_and_without_none_valued_keys(tmp_path):
    """`tools` is read (a row rendered with tools is not drift), and `content: None` is no key, as transformers
    gives it to the template, not the text "None"."""
    from rlbench.checks.tito_shapes import CALCULATOR

    row, _ = _clean_row(tools=[CALCULATOR])
    report = check_run(_jsonl(tmp_path, [row]), TITO_CLEAN)
    assert (report.samples, report.findings, report.notes) == (1, [], [])
    row.pop("tools")
    assert check_run(_jsonl(tmp_path, [row]), TITO_CLEAN).findings  # the same ids held to a render without tools


def test_jsonl_template_kwargs_from_the_command_and_from_each_row(tmp_path):
    """A template that reads a kwarg: the command's kwargs render every row, a row's own chat_template_kwargs win;
    both recorded."""
    tok = load_tokenizer(TITO_CLEAN)
    tok.chat_template = tok.chat_template.replace(
        "'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n' + ('<think>\\n' if enable_thinking else '')"
    )
    tok.save_pretrained(tmp_path / "tok")
    messages, _ = _prompt()
    ids = (
        tok.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=True, tokenize=True)["input_ids"]
        + tok.encode("odd")
        + [tok.eos_token_id]
    )
    row = {"messages": messages + [{"role": "assistant", "content": "<think>\nodd"}], "token_ids": ids}
    path = _jsonl(tmp_path, [row])
    assert check_run(path, tmp_path / "tok", kwargs={"enable_thinking": True}).findings == []
    assert check_run(path, tmp_path / "tok").kwargs == {}
    own = _jsonl(tmp_path, [{**row, "chat_template_kwargs": {"enable_thinking": False}}])
    report = check_run(own, tmp_path / "tok", kwargs={"enable_thinking": True})
    assert report.kwargs == {"enable_thinking": True} and report.findings == []  # the row's kwarg is not rendered


def test_jsonl_sampled_ids_say_whether_it_trained_on_what_was_sampled(tmp_path):
    """With each assistant turn's engine ids, a row is held to them too: found unchanged, in order, the row trained
    on what was sampled; a turn the trainer re-encoded is a finding even where the re-render agrees with it."""
    messages, prompt = _prompt()
    answer, canon, pieces = _same_length_resegmentation()
    row = {
        "messages": messages + [{"role": "assistant", "content": answer}],
        "token_ids": prompt + canon + [TOK.eos_token_id],
        "sampled": [pieces + [TOK.eos_token_id]],
    }
    report = check_run(_jsonl(tmp_path, [row]), QWEN)
    [f] = report.findings
    assert (f.finding.mode, f.finding.where, report.sampled_rows) == (
        "reencode",
        "assistant turn 0: sampled vs trained",
        1,
    )
    row["sampled"] = [canon + [TOK.eos_token_id]]
    assert check_run(_jsonl(tmp_path, [row]), QWEN).findings == []
    res = run_cli("check", "tito", _jsonl(tmp_path, [row]), "--tokenizer", str(QWEN))
    assert res.returncode == 0 and "trained on what was sampled" in res.stdout
    # sampled ids that match, trained ids that differ from the re-render inside them: a hazard, not drift
    row = {**row, "token_ids": prompt + pieces + [TOK.eos_token_id], "sampled": [pieces + [TOK.eos_token_id]]}
    [f] = check_run(_jsonl(tmp_path, [row]), QWEN).findings
    assert (f.finding.mode, f.finding.strict) == ("reencode", False)
    strict = run_cli("check", "tito", _jsonl(tmp_path, [row]), "--tokenizer", str(QWEN), "--strict")
    assert strict.returncode == 1 and "(hazard)" in strict.stdout
    assert run_cli("check", "tito", _jsonl(tmp_path, [row]), "--tokenizer", str(QWEN)).returncode == 0


def test_jsonl_without_sampled_ids_is_never_called_no_drift(tmp_path):
    row, _ = _clean_row()
    res = run_cli("check", "tito", _jsonl(tmp_path, [row, {**row, "meta": 1}]), "--tokenizer", str(TITO_CLEAN))
    assert res.returncode == 0 and "no drift" not in res.stdout
    assert "equal to the chat template's re-render (2 of 2 trajectories gave no sampled ids" in res.stdout
    assert "note: not read: meta (1 rows)" in res.stderr


def test_jsonl_a_row_the_template_refuses_is_a_finding_not_an_internal_error(tmp_path):
    function = REPO / "rlbench" / "fixtures" / "tokenizers" / "tito-function"
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1"}}}
    row = {
        "messages": [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "", "tool_calls": [call, call]},
        ],
        "token_ids": [1, 2],
    }
    res = run_cli("check", "tito", _jsonl(tmp_path, [row]), "--tokenizer", str(function), "--json")
    assert res.returncode == 1, res.stderr
    [f] = json.loads(res.stdout)["findings"]
    assert f["where"] == "template error: This model only supports single tool-calls at once!"


@pytest.mark.parametrize(
    "row,message",
    [
        ({"messages": [], "token_ids": [1], "tools": "x"}, "(TypeError: tools)"),
        ({"messages": [], "token_ids": [1], "chat_template_kwargs": [1]}, "(TypeError: chat_template_kwargs)"),
        (
            {"messages": [{"role": "assistant", "content": "a"}], "token_ids": [1], "sampled": [[1], [2]]},
            "(sampled: one list of ids per assistant message)",
        ),
        ({"messages": [], "token_ids": [10**6]}, "(token id 1000000 is outside the tokenizer's vocabulary"),
        ({"messages": [{"content": "a"}], "token_ids": [1]}, "(TypeError: messages)"),
    ],
)
def test_jsonl_bad_rows_are_bad_input_naming_the_line_and_field(tmp_path, row, message):
    res = run_cli("check", "tito", _jsonl(tmp_path, [row]), "--tokenizer", str(QWEN))
    assert res.returncode == 2 and "line 1: expected" in res.stderr and message in res.stderr, res.stderr


def test_builder_options_are_refused_outside_the_audit(tmp_path):
    row, _ = _clean_row()
    res = run_cli("check", "tito", _jsonl(tmp_path, [row]), "--tokenizer", str(TITO_CLEAN), "--tito-model", "qwen3")
    assert res.returncode == 2 and "choose the builder --audit plays" in res.stderr


# --------------------------------------------------------------------------- what the evidence lens judges


def test_the_sampled_spans_of_a_response_are_its_runs_of_loss_mask_1():
    """A tool observation (loss mask 0) splits the response into two engine outputs; the prompt is never one."""
    from rlbench.checks.tito_run import sampled_spans

    ids, mask = [1, 2, 3, 10, 11, 20, 21, 22, 12, 13], [0, 0, 0, 1, 1, 0, 0, 0, 1, 1]
    assert sampled_spans(ids, 3, mask) == [
        {"prompt_ids": [1, 2, 3], "output_ids": [10, 11]},
        {"prompt_ids": [1, 2, 3, 10, 11, 20, 21, 22], "output_ids": [12, 13]},
    ]
    assert sampled_spans(ids, 3, [0] * 10) == [] and sampled_spans(ids, 10, [1] * 10) == []
    assert sampled_spans(ids, 0, [1] * 10) == [{"prompt_ids": [], "output_ids": ids}]


def test_removed_samples_are_not_judged_and_counted(tmp_path, peaky_model):
    """Sample 3 was built from other ids than its engine sampled (mode 1 when judged); slime removed it."""
    model_dir, model = peaky_model
    _, canon, pieces = _same_length_resegmentation()
    dump = _dump(tmp_path, model, pieces, canon)
    data = torch.load(dump, weights_only=True)
    data["samples"][3]["remove_sample"] = True
    torch.save(data, dump)
    report = check_run(_import(tmp_path, dump, model_dir), model_dir=model_dir)
    assert (report.findings, report.removed, report.samples) == ([], 1, 7)
    assert report.notes == ["1 samples removed by slime (remove_sample): not trained, not judged"]
