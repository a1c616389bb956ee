"""The SGLang path's parts that need no server: the /generate body the client sends and how it holds an
answer to it, the /weights_checker answer, what `rlbench serve` admits and refuses (in SGLang's three
error shapes), the options and config fields (bad ones: exit 2, one line), and the server command lines."""

from __future__ import annotations

import pytest

from rlbench.backends.sglang import wire
from rlbench.config import load_config
from rlbench.serve import request as rq
from rlbench.serve import request_gates as gates
from rlbench.core.types import GenerateRequest
from rlbench.errors import BadInput
from tests.conftest import cli

ROUTER_KEEPS = {
    "temperature",
    "max_new_tokens",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "no_stop_trim",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "sampling_seed",
}  # research.md section 5


def test_the_request_body_holds_only_what_the_router_keeps():
    body = wire.request_body(GenerateRequest((4, 5), 2**63 - 1, 3, 0.5, (2,), 0, 0.9))
    assert set(body) == {"input_ids", "return_logprob", "sampling_params"} and body["return_logprob"] is True
    assert set(body["sampling_params"]) <= ROUTER_KEEPS
    assert body["sampling_params"]["top_k"] == -1  # rlbench's 0 ("off") is SGLang's -1; SGLang refuses 0
    assert body["sampling_params"]["sampling_seed"] == 2**63 - 1


GOOD = {
    "text": None,
    "output_ids": [7, 2],
    "meta_info": {
        "id": "r",
        "finish_reason": {"type": "stop", "matched": 2},
        "prompt_tokens": 2,
        "weight_version": "3",
        "num_retractions": 0,
        "output_token_logprobs": [[-1.5, 7, None], [-0.25, 2, None]],
        "output_token_logprobs_length": 2,
        "reasoning_tokens": 0,
        "completion_tokens": 2,
        "cached_tokens": 0,
        "weight_versions": [{"version": "3", "start": 0, "end": 2}],
        "e2e_latency": 0.1,
        "a_key_of_a_later_sglang": 1,
    },
}
ASKED = GenerateRequest((4, 5), 1, 3, 1.0, (2,))


def _with(meta=None, **top):
    return {**GOOD, **top, "meta_info": {**GOOD["meta_info"], **(meta or {})}}


def _entries(ids, logprob=-0.5):
    return {"output_token_logprobs": [[logprob, t, None] for t in ids]}


def test_an_answer_is_read_and_held_to_its_shape():
    """SGLang 0.5.23's answer (a null text, extra meta_info keys) is read; what does not fit the request is
    BadAnswer naming the server and the field, and an aborted answer is never kept."""
    answer = wire.parse_answer(GOOD, "http://s/generate", ASKED, vocab=10)
    assert (answer.output_ids, answer.logprobs, answer.finish_reason, answer.weight_version) == (
        (7, 2),
        (-1.5, -0.25),
        "stop",
        "3",
    )
    length = _with({**_entries([7, 8, 9]), "finish_reason": {"type": "length", "length": 3}}, output_ids=[7, 8, 9])
    assert wire.parse_answer(length, "s", ASKED, 10).finish_reason == "length"
    for bad, field in [
        ({"text": "x"}, "meta_info"),
        (_with(output_ids=[7, 3]), "output_ids"),
        (_with({"finish_reason": "stop"}), "finish_reason"),
        (_with({"output_token_logprobs": [[-1.0]]}), r"output_token_logprobs\[0\]"),
        (_with({"output_token_logprobs": {"0": 1}}), "output_token_logprobs"),
        (_with(_entries([10, 2]), output_ids=[10, 2]), "token id: expected an id in \\[0, 10\\)"),
        (_with(_entries([-1, 2]), output_ids=[-1, 2]), "token id"),
        (_with(_entries([True, 2]), output_ids=[True, 2]), "token id"),
        (_with(_entries([7, 2], 0.5)), "logprob: expected a finite log-probability <= 0"),
        (_with(_entries([7, 2], float("nan"))), "logprob"),
        (
            _with({**_entries([7, 8, 9, 2]), "finish_reason": {"type": "stop", "matched": 2}}, output_ids=[7, 8, 9, 2]),
            "at most max_new_tokens = 3",
        ),
        (
            _with({**_entries([]), "finish_reason": {"type": "length", "length": 3}}, output_ids=[]),
            "length only with exactly max_new_tokens = 3",
        ),
        (
            _with({**_entries([7, 2, 9]), "finish_reason": {"type": "length", "length": 3}}, output_ids=[7, 2, 9]),
            "no token of stop_token_ids before the last",
        ),
        (_with({"finish_reason": {"type": "stop", "matched": "NaN happened"}}), "matched = the last"),
        (
            _with({**_entries([7, 5]), "finish_reason": {"type": "stop", "matched": 5}}, output_ids=[7, 5]),
            "own end-of-sequence token",
        ),
    ]:
        with pytest.raises(wire.BadAnswer, match=field) as info:
            wire.parse_answer(bad, "http://s/generate", ASKED, vocab=10)
        assert str(info.value).startswith("http://s/generate: ") and not info.value.aborted
    aborted = _with({"finish_reason": {"type": "abort", "message": "Abort in waiting queue"}})
    with pytest.raises(wire.BadAnswer, match="aborted the request \\(Abort in waiting queue\\)") as info:
        wire.parse_answer(aborted, "http://s/generate", ASKED, vocab=10)
    assert info.value.aborted


def test_a_weights_checker_answer_is_read_or_refused_by_field():
    rank = {"checksums": {"a": "00ff00ff00ff00ff"}, "per_gpu_checksum": "x", "parallelism_info": [{"role": "target"}]}
    got = wire.parse_checksums(
        {"success": True, "message": "Success.", "ranks": [rank], "per_engine_checksum": "y"}, "s"
    )
    assert got == wire.Checksums({"a": "00ff00ff00ff00ff"}, 1)
    for body, field in [
        ([rank], r"\(answer\)"),
        ({"success": False, "message": "no"}, "success"),
        ({"success": True, "ranks": {"0": rank}}, "ranks"),
        ({"success": True, "ranks": [{"checksums": ["a"]}]}, r"ranks\[0\].checksums"),
    ]:
        with pytest.raises(ValueError, match=field):
            wire.parse_checksums(body, "s")


def _parse(body, context_len=136):
    call = rq.parse_generate(body, vocab=100, encode=lambda t: [ord(c) % 100 for c in t], new_rid=lambda: "r")
    rq.limit_items(call, context_len, eos=(2,), default_seed=42)
    return call


@pytest.mark.parametrize(
    "body, answer",
    [
        ([1, 2], {"object": "error", "type": "Bad Request", "code": 400}),
        ({"text": 5}, {"object": "error", "type": "Bad Request", "code": 400}),
        ({"input_ids": [1], "stream": None}, {"object": "error", "type": "Bad Request", "code": 400}),
        ({"input_ids": [1], "sampling_params": {"seed": 3}}, {"error": "unknown field `seed`"}),
        (
            {"input_ids": [1], "sampling_params": {"max_new_tokens": 8.0}},
            {"error": "invalid type: floating point `8.0`"},
        ),
        ({"input_ids": [1], "return_logprob": "yes"}, {"error": 'invalid type: string "yes"'}),
        ({"input_ids": [1], "sampling_params": {"top_k": 0}}, {"error": {"message": "top_k must be -1"}}),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, {"error": {"message": "top_p must be in (0, 1]"}}),
        ({"input_ids": [1, 100]}, {"error": {"message": "outside the vocabulary"}}),
        (
            {"input_ids": [1], "sampling_params": {"max_new_tokens": 136}},
            {"error": {"message": "maximum context length"}},
        ),
        (
            {"input_ids": [1] * 130, "sampling_params": {"max_new_tokens": 1}},
            {"error": {"message": "exceeds the maximum allowed length (130 tokens)"}},
        ),
        (
            {"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 3},
            {"error": {"message": "is higher than the number of input tokens"}},
        ),
        ({"input_ids": [[1], [2]], "rid": ["a", "a"]}, {"error": {"message": "Duplicate request IDs"}}),
        ({}, {"error": {"message": "Either text, input_ids or input_embeds"}}),
        ({"input_ids": []}, {"error": {"message": "input_ids cannot be empty."}}),
        (
            {"input_ids": [1], "sampling_params": {"frequency_penalty": 0.5}},
            {"error": {"message": "does not implement sampling_params.frequency_penalty"}},
        ),
    ],
)
def test_a_refused_body_gets_sglangs_answer(body, answer):
    with pytest.raises(gates.RequestError) as info:
        _parse(body)
    assert info.value.status == 400
    for key, value in answer.items():
        got = info.value.body[key]
        if isinstance(value, dict):
            assert value["message"] in got["message"]
        else:
            assert value in got if isinstance(value, str) else got == value


def test_sglang_admits_what_rlbench_serve_admits():
    """What SGLang 0.5.23 admits is admitted: text with input_ids (the ids are generated from), a negative
    sampling_seed (any i64), top_k past any vocabulary, max_new_tokens null (to the context's end)."""
    both = _parse({"text": "ab", "input_ids": [7, 8]}).items[0]
    assert both.prompt_ids == (7, 8)
    seeded = _parse({"input_ids": [1], "sampling_params": {"sampling_seed": -5, "top_k": 2**63}}).items[0].request
    assert (seeded.seed, seeded.top_k) == (-5, -1)
    open_ended = _parse({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": None}}).items[0].request
    assert open_ended.max_new_tokens == 136 - 2 - 3 and open_ended.stop_token_ids == (2,)  # the model's EOS stops it
    ignoring = _parse({"input_ids": [1], "sampling_params": {"ignore_eos": True, "stop_token_ids": [5]}})
    assert ignoring.items[0].request.stop_token_ids == ()  # SGLang: ignore_eos disables stop_token_ids too


def test_a_batch_with_its_own_sampling_params_and_rids():
    call = _parse(
        {
            "input_ids": [[1, 2], [3]],
            "rid": "q",
            "return_logprob": True,
            "sampling_params": [{"max_new_tokens": 2, "sampling_seed": 9}, {"temperature": 1e-7}],
        }
    )
    assert call.batched and [i.rid for i in call.items] == ["q_0", "q_1"] and call.items[0].return_logprob
    first, second = (item.request for item in call.items)
    assert (first.prompt_ids, first.seed, first.max_new_tokens) == ((1, 2), 9, 2)
    assert (second.temperature, second.seed, second.max_new_tokens) == (0.0, 42, 128)  # SGLang's defaults
    copies = _parse({"input_ids": [[1], [2]], "sampling_params": {"n": 2, "max_new_tokens": 1}})
    assert [i.prompt_ids for i in copies.items] == [(1,), (1,), (2,), (2,)]  # each prompt's copies together


@pytest.mark.parametrize(
    "args, says",
    [
        (
            ["--rollout", "sglang", "--rollout-external-engine-addrs", "nohost"],
            "rollout.external_engine_addrs: expected host:port",
        ),
        (["--sglang-mem-fraction-static", "0.8"], "rollout.sglang: expected no server arguments unless"),
        (["--rollout", "sglang", "--sglang-port", "5"], "rollout.sglang: expected no arguments rlbench sets itself"),
        (["--bogus"], "no such option: --bogus"),
        (["--ray-address", "auto"], "placement.ray_address: expected unset unless placement.backend is ray"),
        (
            ["--rollout", "sglang", "--sglang-router-url", "r:1", "--rollout-external-engine-addrs", "a:1"],
            "expected unset when rollout.sglang_router_url is set",
        ),
        (["--resume", "runs/x", "--rollout", "sglang"], "drop --out, --rollout"),  # --steps N extends (issue 53)
    ],
)
def test_bad_options_are_one_line_and_exit_2(tmp_path, args, says):
    res = cli("run", "--steps", "1", "--out", str(tmp_path / "r"), *args)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and says in lines[0], res.stderr
    assert not (tmp_path / "r").exists()


def test_bad_config_values(tmp_path):
    for table, says in [
        ('[rollout]\nbackend = "sglang"\ntrue_on_policy = true\n', "rollout.true_on_policy"),
        ('[rollout]\nexternal_engine_addrs = "a:1"\n', "expected a list of strings"),
        ('[rollout]\nbackend = "sglang"\n[rollout.sglang]\n"--x" = 1\n', "rollout.sglang"),
        ('[placement]\nbackend = "mars"\n', "placement.backend"),
    ]:
        (tmp_path / "c.toml").write_text(table)
        with pytest.raises(BadInput, match=says.replace(".", r"\.")):
            load_config(tmp_path / "c.toml")


def test_serve_refuses_bad_options_in_one_line():
    res = cli("serve", "--dtype", "float16", "--port", "0")
    assert res.returncode == 2 and res.stderr.strip() == (  # a choice of the option: typer's own words
        "rlbench: error: Invalid value for '--dtype': Value error, 'float16' is not one of 'float32', 'bfloat16'."
    ), res.stderr
    res = cli("serve", "--device", "tpu", "--port", "0")  # checked by ServeConfig
    assert res.returncode == 2 and res.stderr.strip() == (
        "rlbench: error: --device: expected cpu, cuda or cuda:N, got 'tpu'"
    ), res.stderr


def test_the_server_command_lines():
    """rlbench starts sglang.launch_server with its own arguments and every --sglang-* passed through
    (a bare flag for true, a list as several values); rlbench serve with the run's settings."""
    from rlbench.backends.sglang.fleet import server_command

    config = load_config(
        seed=7,
        rollout__backend="sglang",
        rollout__sglang={
            "mem-fraction-static": "0.8",
            "enable-torch-compile": True,
            "cuda-graph-bs": [1, 2],
            "skip-x": False,
        },
    )
    command = server_command(config.engine_setup(), "127.0.0.1", 31000)
    assert command[1:3] == ["-m", "sglang.launch_server"]
    joined = " ".join(command)
    for part in (
        "--host 127.0.0.1 --port 31000",
        "--random-seed 7",
        "--enable-deterministic-inference",
        "--mem-fraction-static 0.8 --enable-torch-compile --cuda-graph-bs 1 2",
    ):
        assert part in joined
    assert "skip-x" not in joined
    served = server_command(
        load_config(
            rollout__backend="sglang", rollout__sglang_server="rlbench", rollout__decode_batch_size=16
        ).engine_setup(),
        "127.0.0.1",
        0,
    )
    assert served[1:4] == ["-m", "rlbench.cli", "serve"] and "--decode-batch-size 16" in " ".join(served)


def test_sglang_server_needs_the_sglang_package(tmp_path):
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    res = cli("run", "--steps", "1", "--rollout", "sglang", "--out", str(tmp_path / "r"))
    assert res.returncode == 2 and "the sglang package is not installed here" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "r").exists()
