"""The SGLang path's parts that need no server: the /generate body and answer on both sides of the
wire, the options and config fields (bad ones: exit 2, one line), and the server command lines."""

from __future__ import annotations

import pytest

from rlbench.backends.sglang import wire
from rlbench.config import load_config
from rlbench.core.types import GenerateRequest
from rlbench.errors import BadInput
from tests.conftest import cli

ROUTER_KEEPS = {"temperature", "max_new_tokens", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens", "no_stop_trim",
                "min_new_tokens", "n", "json_schema", "regex", "ebnf", "sampling_seed"}  # research.md section 5


def test_the_request_body_holds_only_what_the_router_keeps():
    body = wire.request_body(GenerateRequest((4, 5), 2**63 - 1, 3, 0.5, (2,), 0, 0.9))
    assert set(body) == {"input_ids", "return_logprob", "sampling_params"} and body["return_logprob"] is True
    assert set(body["sampling_params"]) <= ROUTER_KEEPS
    assert body["sampling_params"]["top_k"] == -1  # rlbench's 0 ("off") is SGLang's -1; SGLang refuses 0
    assert body["sampling_params"]["sampling_seed"] == 2**63 - 1


GOOD = {"text": "ab", "output_ids": [7, 2], "meta_info": {"finish_reason": {"type": "stop", "matched": 2},
                                                          "weight_version": "3",
                                                          "output_token_logprobs": [[-1.5, 7, None], [-0.25, 2, None]]}}


def test_an_answer_is_read_and_held_to_its_shape():
    answer = wire.parse_answer(GOOD, "http://s/generate")
    assert (answer.output_ids, answer.logprobs, answer.finish_reason, answer.weight_version) == \
        ((7, 2), (-1.5, -0.25), "stop", "3")
    for bad, field in [({"text": "x"}, "meta_info"),
                       ({**GOOD, "output_ids": [7, 3]}, "output_ids"),
                       ({**GOOD, "meta_info": {**GOOD["meta_info"], "finish_reason": "stop"}}, "finish_reason"),
                       ({**GOOD, "meta_info": {**GOOD["meta_info"], "output_token_logprobs": [[-1.0]]}},
                        "output_token_logprobs")]:
        with pytest.raises(BadInput, match=field):
            wire.parse_answer(bad, "http://s/generate")


def _parse(body):
    return wire.parse_generate(body, vocab=100, context_len=136, encode=lambda t: [ord(c) % 100 for c in t],
                               new_rid=lambda: "r")


@pytest.mark.parametrize("body, answer", [
    ([1, 2], {"object": "error", "type": "Bad Request", "code": 400}),
    ({"input_ids": [1], "sampling_params": {"seed": 3}}, {"error": "unknown field `seed`"}),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 8.0}}, {"error": "invalid type: floating point `8.0`"}),
    ({"input_ids": [1], "sampling_params": {"top_k": 0}}, {"error": {"message": "top_k must be -1"}}),
    ({"input_ids": [1, 100]}, {"error": {"message": "outside the vocabulary"}}),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": 136}}, {"error": {"message": "maximum context length"}}),
    ({"input_ids": [[1], [2]], "rid": ["a", "a"]}, {"error": {"message": "Duplicate request IDs"}}),
    ({}, {"error": {"message": "Either text, input_ids or input_embeds"}}),
])
def test_a_refused_body_gets_sglangs_answer(body, answer):
    with pytest.raises(wire.RequestError) as info:
        _parse(body)
    assert info.value.status == 400
    for key, value in answer.items():
        got = info.value.body[key]
        if isinstance(value, dict):
            assert value["message"] in got["message"]
        else:
            assert value in got if isinstance(value, str) else got == value


def test_a_batch_with_its_own_sampling_params_and_rids():
    call = _parse({"input_ids": [[1, 2], [3]], "rid": "q", "return_logprob": True,
                   "sampling_params": [{"max_new_tokens": 2, "sampling_seed": 9}, {"temperature": 1e-7}]})
    assert call.batched and call.rids == ["q_0", "q_1"] and call.return_logprob
    first, second = call.requests
    assert (first.prompt_ids, first.seed, first.max_new_tokens) == ((1, 2), 9, 2)
    assert (second.temperature, second.seed, second.max_new_tokens) == (0.0, wire.DEFAULT_SEED, 128)  # SGLang's


@pytest.mark.parametrize("args, says", [
    (["--rollout", "sglang", "--rollout-external-engine-addrs", "nohost"],
     "rollout.external_engine_addrs: expected host:port"),
    (["--sglang-mem-fraction-static", "0.8"], "rollout.sglang: expected no server arguments unless"),
    (["--rollout", "sglang", "--sglang-port", "5"], "rollout.sglang: expected no arguments rlbench sets itself"),
    (["--bogus"], "no such option: --bogus"),
    (["--ray-address", "auto"], "placement.ray_address: expected unset unless placement.backend is ray"),
    (["--rollout", "sglang", "--sglang-router-url", "r:1", "--rollout-external-engine-addrs", "a:1"],
     "expected unset when rollout.sglang_router_url is set"),
    (["--resume", "runs/x", "--rollout", "sglang"], "drop --steps, --out, --rollout"),
])
def test_bad_options_are_one_line_and_exit_2(tmp_path, args, says):
    res = cli("run", "--steps", "1", "--out", str(tmp_path / "r"), *args)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and says in lines[0], res.stderr
    assert not (tmp_path / "r").exists()


def test_bad_config_values(tmp_path):
    for table, says in [('[rollout]\nbackend = "sglang"\ntrue_on_policy = true\n', "rollout.true_on_policy"),
                        ('[rollout]\nexternal_engine_addrs = "a:1"\n', "expected a list of strings"),
                        ('[rollout]\nbackend = "sglang"\n[rollout.sglang]\n"--x" = 1\n', "rollout.sglang"),
                        ('[placement]\nbackend = "mars"\n', "placement.backend")]:
        (tmp_path / "c.toml").write_text(table)
        with pytest.raises(BadInput, match=says.replace(".", r"\.")):
            load_config(tmp_path / "c.toml")


def test_serve_refuses_bad_options_in_one_line():
    res = cli("serve", "--dtype", "float16", "--port", "0")
    assert res.returncode == 2 and res.stderr.strip() == (  # a choice of the option: typer's own words
        "rlbench: error: Invalid value for '--dtype': Value error, 'float16' is not one of 'float32', 'bfloat16'."), \
        res.stderr
    res = cli("serve", "--device", "tpu", "--port", "0")  # checked by ServeConfig
    assert res.returncode == 2 and res.stderr.strip() == (
        "rlbench: error: --device: expected cpu, cuda or cuda:N, got 'tpu'"), res.stderr


def test_the_server_command_lines():
    """rlbench starts sglang.launch_server with its own arguments and every --sglang-* passed through
    (a bare flag for true, a list as several values); rlbench serve with the run's settings."""
    from rlbench.backends.sglang.fleet import server_command

    config = load_config(seed=7, rollout__backend="sglang", rollout__sglang={
        "mem-fraction-static": "0.8", "enable-torch-compile": True, "cuda-graph-bs": [1, 2], "skip-x": False})
    command = server_command(config, "127.0.0.1", 31000)
    assert command[1:3] == ["-m", "sglang.launch_server"]
    joined = " ".join(command)
    for part in ("--host 127.0.0.1 --port 31000", "--random-seed 7", "--enable-deterministic-inference",
                 "--mem-fraction-static 0.8 --enable-torch-compile --cuda-graph-bs 1 2"):
        assert part in joined
    assert "skip-x" not in joined
    served = server_command(load_config(rollout__backend="sglang", rollout__sglang_server="rlbench",
                                        rollout__decode_batch_size=16), "127.0.0.1", 0)
    assert served[1:4] == ["-m", "rlbench.cli", "serve"] and "--decode-batch-size 16" in " ".join(served)


def test_sglang_server_needs_the_sglang_package(tmp_path):
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    res = cli("run", "--steps", "1", "--rollout", "sglang", "--out", str(tmp_path / "r"))
    assert res.returncode == 2 and "the sglang package is not installed here" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "r").exists()
