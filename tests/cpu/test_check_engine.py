"""`rlbench check engine URL`, the determinism certificate of an SGLang server (rlbench/checks/engine_cert.py).

Against `rlbench serve` started as a process of its own, as a user starts it: deterministic, exit 0, with the counts
of what was compared; against the same server started `--batch-variant` (its batched decode's lm-head product split
by the batch's size, rlbench/backends/batch_variant.py): exit 1, naming the first prompt, batch size and position
that differ. Then the comparison and the verdict rules alone, against a stand-in server function: a difference at
each place is named there; none is "deterministic" with the counts each mode's plan gives; an error or abort answer,
a weight version that changes, or nothing compared is "undetermined", never a pass.
"""

from __future__ import annotations

import json
import math
import re
import threading

import pytest

from rlbench.checks.engine_cert import (
    PROMPTS,
    Answer,
    Place,
    Refused,
    Settings,
    certify,
    compare,
    read_answer,
    read_prompts,
    same_bits,
)
from rlbench.errors import BadInput
from tests.conftest import cli
from tests.helpers import serve_url, start_serve, stop_serve

QUICK = ("--repeats", "2", "--batch-sizes", "2,4", "--max-new-tokens", "6")


@pytest.fixture(scope="module")
def servers():
    """Two `rlbench serve` processes started together: the fixture model as served, and the same `--batch-variant`;
    their URLs. Stopped by their PIDs with Ctrl-C's signal at the end."""
    started = {"plain": start_serve(), "variant": start_serve("--batch-variant")}
    try:
        yield {name: serve_url(each) for name, each in started.items()}
    finally:
        for proc, _, _ in started.values():
            stop_serve(proc)


def _plan(prompts: int, repeats: int, sizes: tuple[int, ...]) -> dict[str, int]:
    """Answers each mode holds to a reference: single, every repeat but the first; mixed, every row of every batch
    (each size, one batch per prompt, rotated); prefix (the others joined to the longest): alone cold and warm, the
    batch cold and warm, but the first alone."""
    shared = prompts - 1
    return {
        "single": prompts * (repeats - 1),
        "mixed": repeats * prompts * sum(sizes),
        "prefix": repeats * 4 * shared - shared,
    }


def test_rlbench_serve_is_deterministic_with_the_counts(servers):
    res = cli("check", "engine", servers["plain"], *QUICK)
    assert res.returncode == 0, res.stdout + res.stderr
    plan = _plan(len(PROMPTS), 2, (2, 4))
    assert f"{servers['plain']}: deterministic: {sum(plan.values())} answers held to their prompt's reference" in (
        res.stdout
    )
    assert "weight version default" in res.stdout and "reported, not judged (no --max-prefill-delta)" in res.stdout
    for mode, answers in plan.items():
        assert re.search(rf"{mode}\s*\S?\s+{answers}\s+\S?\s*\d+\s+\S?\s*0\b", res.stdout), (mode, res.stdout)
    doc = json.loads(cli("check", "engine", servers["plain"], *QUICK, "--json").stdout)
    assert doc["verdict"] == "deterministic" and doc["first"] is None and doc["weight_versions"] == ["default"]
    assert {mode: tally["answers"] for mode, tally in doc["counts"].items()} == plan
    assert all(tally["tokens"] > 0 and tally["differing"] == 0 for tally in doc["counts"].values())
    assert doc["prefill"]["tokens"] > 0 and math.isfinite(doc["prefill"]["max_abs_delta"])


def test_a_batch_variant_server_fails_naming_the_first_prompt_batch_size_and_position(servers):
    res = cli("check", "engine", servers["variant"], *QUICK)
    assert res.returncode == 1, res.stdout + res.stderr
    named = re.search(
        r"not deterministic: (\d+) of \d+ answers differ; the first at mode mixed, prompt (\d+), batch size (\d+), "
        r"position (\d+), repeat 0: token (\d+)'s (log-prob|output id) is (\S+) \(the reference's: (\S+)\)",
        res.stdout,
    )
    assert named, res.stdout
    assert int(named[3]) in (2, 4) and named[7] != named[8]
    doc = json.loads(cli("check", "engine", servers["variant"], *QUICK, "--json").stdout)
    first = doc["first"]
    assert doc["verdict"] == "not deterministic" and first["place"]["batch_size"] == int(named[3])
    assert (first["place"]["prompt"], first["place"]["position"], first["token"]) == tuple(
        map(int, named.group(2, 4, 5))
    )
    assert doc["counts"]["single"]["differing"] == 0 and doc["counts"]["mixed"]["differing"] > 0  # alone: its bits


def test_an_error_answer_is_undetermined_exit_2_naming_the_request_and_json_carries_it(servers):
    """A prompt of 18 tokens and 250 new ones do not fit the fixture model's 256 positions: the server's 400."""
    res = cli("check", "engine", servers["plain"], "--max-new-tokens", "250", "--json")
    assert res.returncode == 2, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["verdict"] == "undetermined" and doc["first"] is None
    where = "mode single, prompt 0 alone, repeat 0: POST /generate answered 400: "
    assert res.stderr.startswith(f"rlbench: error: {servers['plain']}: undetermined: {where}")
    assert len(res.stderr.strip().splitlines()) == 1 and doc["stopped"].startswith(where)


def test_the_api_key_is_sent_as_a_bearer_token_and_a_401_says_to_give_it():
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen = []

    class Keyed(BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(self.headers.get("Authorization"))
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(401)
            self.end_headers()
            self.wfile.write(b'{"error":"Unauthorized"}')

        def log_message(self, *args):  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Keyed)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        res = cli("check", "engine", url, "--api-key", "s3cret")
    finally:
        server.shutdown()
        server.server_close()
    assert seen == ["Bearer s3cret"] and res.returncode == 2 and "s3cret" not in res.stdout + res.stderr
    assert res.stderr.strip() == (
        f"rlbench: error: {url}: POST /generate answered 401 Unauthorized: give the server's key (--api-key)"
    )


def test_a_server_that_is_not_there_is_one_line_and_exit_2():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"  # bound, not listening: refused
        res = cli("check", "engine", url)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip() == f"rlbench: error: {url}: cannot reach the server ([Errno 111] Connection refused)"


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--repeats", "1"), "--repeats: expected 2 to 1000 (the first answer is the reference), got 1"),
        (("--batch-sizes", "2,x"), "--batch-sizes: expected whole numbers, e.g. 2,4,8, got '2,x'"),
        (("--batch-sizes", "0"), "--batch-sizes: expected sizes from 1 to 1024, got [0]"),
    ],
)
def test_bad_options_are_one_line_and_exit_2(args, said):
    res = cli("check", "engine", "http://127.0.0.1:9", *args)
    assert res.returncode == 2 and res.stderr.strip() == f"rlbench: error: {said}", res.stderr


# ---------------------------------------------------------------- the comparison and the verdict, alone

PLACE = Place("mixed", 3, 4, 2, 1)


def test_compare_names_each_kind_of_difference_and_counts_what_it_compared():
    ref = Answer((5, 6, 7), (-0.5, -1.25, -2.0), "v")
    assert compare(ref, Answer((5, 6, 7), (-0.5, -1.25, -2.0), "v"), PLACE) == (3, None)
    tokens, diff = compare(ref, Answer((5, 9, 7), (-0.5, -1.25, -2.0), "v"), PLACE)
    assert (tokens, diff.token, diff.what, diff.reference, diff.got) == (2, 1, "output id", 6, 9)
    nudged = math.nextafter(-2.0, 0.0)  # one bit apart
    tokens, diff = compare(ref, Answer((5, 6, 7), (-0.5, -1.25, nudged), "v"), PLACE)
    assert (tokens, diff.token, diff.what, diff.reference, diff.got) == (3, 2, "log-prob", -2.0, nudged)
    tokens, diff = compare(ref, Answer((5, 6), (-0.5, -1.25), "v"), PLACE)
    assert (tokens, diff.token, diff.what, diff.reference, diff.got) == (2, 2, "length", 3, 2)
    assert (
        str(diff)
        == "mode mixed, prompt 3, batch size 4, position 2, repeat 1: token 2's length is 2 (the reference's: 3)"
    )


def test_same_bits_is_bitwise():
    assert same_bits(-1.5, -1.5) and same_bits(None, None) and same_bits(math.nan, math.nan)
    assert not same_bits(0.0, -0.0) and not same_bits(None, -1.0) and not same_bits(-1.0, math.nextafter(-1.0, 0))


class Stand:
    """A stand-in SGLang server, as a function: text is tokenized one id per character; an answer's ids and
    log-probs are a function of its prompt; `fault(prompt, size, position, seen, warm)` may change an answer
    (seen: times this prompt was asked before; warm: anything asked since the last /flush_cache)."""

    def __init__(self, new_tokens: int = 3, fault=None, empty: bool = False, version=lambda call: "v1"):
        self.fault, self.new_tokens, self.empty, self.version = fault, new_tokens, empty, version
        self.seen: dict[tuple, int] = {}
        self.cached: set[tuple] = set()
        self.calls = 0

    @staticmethod
    def decode(prompt: tuple[int, ...], n: int) -> tuple[list[int], list[float]]:
        return [(sum(prompt) + k) % 97 for k in range(n)], [-((sum(prompt) + k) % 13 + 1) / 7 for k in range(n)]

    def __call__(self, path: str, body: dict):
        self.calls += 1
        if path == "/flush_cache":
            self.cached.clear()
            return "Cache flushed.\n"
        params = body["sampling_params"]
        if "text" in body:
            ids = [ord(c) % 300 for c in body["text"]]
            entries = [[None, ids[0], None]] + [[-1.0, i, None] for i in ids[1:]]
            return {"output_ids": [], "meta_info": {"prompt_tokens": len(ids), "input_token_logprobs": entries}}
        if params["max_new_tokens"] == 0:  # the prefill of a finished sequence: the decode's own log-probs
            ids, start = body["input_ids"], body["logprob_start_len"]
            out, logprobs = self.decode(tuple(ids[: start + 1]), len(ids) - start - 1)
            entries = [[None, ids[start], None]] + [[lp, t, None] for lp, t in zip(logprobs, out)]
            return {"output_ids": [], "meta_info": {"input_token_logprobs": entries}}
        batch = body["input_ids"] if isinstance(body["input_ids"][0], list) else [body["input_ids"]]
        answers = [self.answer(tuple(p), len(batch), position) for position, p in enumerate(batch)]
        return answers if isinstance(body["input_ids"][0], list) else answers[0]

    def answer(self, prompt: tuple[int, ...], size: int, position: int) -> dict:
        out, logprobs = self.decode(prompt, 0 if self.empty else self.new_tokens)
        seen, warm = self.seen.get(prompt, 0), bool(self.cached)
        self.seen[prompt] = seen + 1
        self.cached.add(prompt)
        changed = self.fault(prompt, size, position, seen, warm) if self.fault else None
        if changed == "abort":
            return {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "Aborted"}}}
        if changed is not None:
            out, logprobs = changed(out, logprobs)
        meta = {"weight_version": self.version(self.calls), "finish_reason": {"type": "length"}}
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logprobs, out)]
        return {"output_ids": out, "meta_info": meta}


SETTINGS = Settings(repeats=2, batch_sizes=(2, 4), max_new_tokens=3)
LONGEST = max(range(len(PROMPTS)), key=lambda i: len(PROMPTS[i]))


def _certify(stand: Stand, settings: Settings = SETTINGS):
    return certify(stand, PROMPTS, settings, "http://stand")


def test_a_deterministic_server_is_certified_with_every_modes_counts():
    cert = _certify(Stand())
    plan = _plan(len(PROMPTS), 2, (2, 4))
    assert cert.verdict == "deterministic" and cert.first is None and cert.stopped is None and not cert.failures
    assert {mode: (t.answers, t.tokens, t.differing) for mode, t in cert.counts.items()} == {
        mode: (answers, 3 * answers, 0) for mode, answers in plan.items()
    }
    assert cert.weight_versions == ["v1"] and len(cert.prompts) == 2 * len(PROMPTS) - 1
    assert (cert.prefill.tokens, cert.prefill.differing, cert.prefill.max_abs_delta) == (3 * len(cert.prompts), 0, 0.0)


def _nudge_logprob(token: int):
    def change(out, logprobs):
        return out, [math.nextafter(lp, 0.0) if t == token else lp for t, lp in enumerate(logprobs)]

    return change


def test_a_difference_in_a_batch_is_named_at_its_prompt_batch_size_and_position():
    stand = Stand(
        fault=lambda prompt, size, position, seen, cached: _nudge_logprob(1) if (size, position) == (4, 2) else None
    )
    cert = _certify(stand)
    assert cert.verdict == "not deterministic"
    assert cert.first.place == Place("mixed", 2, 4, 2, 0)  # the first batch of 4 holds prompts 0..3 in order
    assert (cert.first.token, cert.first.what) == (1, "log-prob")
    assert cert.counts["mixed"].differing == 2 * len(PROMPTS) and cert.counts["single"].differing == 0


def test_a_difference_on_a_repeat_alone_is_named_in_single_mode():
    stand = Stand(
        fault=lambda prompt, size, position, seen, cached: (
            (lambda o, lp: ([o[0] + 1, *o[1:]], lp)) if seen == 1 else None
        )
    )
    cert = _certify(stand)
    assert cert.first.place == Place("single", 0, 1, 0, 1) and (cert.first.token, cert.first.what) == (0, "output id")


def test_a_difference_with_a_warm_prefix_cache_is_named_cold_or_warm():
    long = len(PROMPTS[LONGEST])

    def fault(prompt, size, position, seen, warm):
        return (lambda o, lp: (o[:-1], lp[:-1])) if len(prompt) > long and warm else None

    cert = _certify(Stand(fault=fault))
    first_shared = len(PROMPTS)  # prefix mode's prompts follow the given ones
    assert cert.first.place == Place("prefix", first_shared, 1, 0, 0, "warm") and cert.first.what == "length"
    assert cert.counts["single"].differing == cert.counts["mixed"].differing == 0


def test_an_error_answer_is_undetermined_naming_the_request():
    def post(path, body):
        if isinstance(body.get("input_ids", [0])[0], list) and len(body["input_ids"]) == 4:
            raise Refused('POST /generate answered 400: {"error":{"message":"no"}}')
        return stand(path, body)

    stand = Stand()
    cert = certify(post, PROMPTS, SETTINGS, "http://stand")
    assert cert.verdict == "undetermined" and cert.first is None
    where = "mode mixed, a batch of 4 (prompts [0, 1, 2, 3]), repeat 0"
    assert cert.stopped == f'{where}: POST /generate answered 400: {{"error":{{"message":"no"}}}}'


def test_an_abort_is_undetermined_and_a_difference_before_a_stop_still_fails():
    cert = _certify(Stand(fault=lambda prompt, size, position, seen, cached: "abort" if size == 4 else None))
    assert cert.verdict == "undetermined" and cert.stopped.endswith("repeat 0: aborted (Aborted)")

    def fault(prompt, size, position, seen, cached):
        return "abort" if size == 4 else _nudge_logprob(0) if size == 2 else None

    cert = _certify(Stand(fault=fault))
    assert cert.verdict == "not deterministic" and cert.first.place.batch_size == 2 and cert.stopped


def test_nothing_compared_never_passes():
    cert = _certify(Stand(empty=True))  # every answer ends at once: the same, and nothing compared
    assert cert.verdict == "undetermined" and cert.stopped.startswith("nothing compared in any output token")
    assert sum(t.answers for t in cert.counts.values()) > 0 and sum(t.tokens for t in cert.counts.values()) == 0
    gated = _certify(Stand(empty=True), Settings(repeats=2, batch_sizes=(2,), max_prefill_delta=0.0))
    assert gated.verdict == "undetermined"


def test_a_weight_version_that_changes_midway_is_undetermined():
    cert = _certify(Stand(version=lambda call: "v1" if call < 30 else "v2"))
    assert cert.verdict == "undetermined" and cert.weight_versions == ["v1", "v2"]
    assert cert.stopped.startswith("the weight version changed during the check (v1, v2)")


def test_the_prefill_gate_judges_only_when_set_and_nan_fails_it():
    def shifted(path, body):
        answer = stand(path, body)
        if body.get("logprob_start_len", -1) > 0:
            answer["meta_info"]["input_token_logprobs"][-1][0] += 0.25
        return answer

    stand = Stand()
    assert certify(shifted, PROMPTS, SETTINGS, "u").failures == []  # reported, not judged
    gated = Settings(repeats=2, batch_sizes=(2,), max_new_tokens=3, max_prefill_delta=0.1)
    cert = certify(shifted, PROMPTS, gated, "u")
    assert cert.verdict == "deterministic" and cert.prefill.max_abs_delta == 0.25 and cert.prefill.differing == 9
    assert cert.failures == ["decode vs prefill: max |delta| 0.25 over 27 tokens exceeds --max-prefill-delta 0.1"]
    nan = Stand(fault=lambda prompt, size, position, seen, cached: lambda o, lp: (o, [math.nan] * len(lp)))
    assert certify(nan, PROMPTS, gated, "u").failures[0].startswith("decode vs prefill: max |delta| nan")


def test_answers_that_cannot_be_read_are_refused():
    with pytest.raises(Refused, match="where: an answer without meta_info"):
        read_answer({"error": "x"}, "where")
    with pytest.raises(Refused, match="no output_ids with one output_token_logprobs entry each"):
        read_answer({"output_ids": [1, 2], "meta_info": {"output_token_logprobs": [[-1.0, 1, None]]}}, "where")
    with pytest.raises(Refused, match="output_token_logprobs' ids are not output_ids"):
        read_answer({"output_ids": [1], "meta_info": {"output_token_logprobs": [[-1.0, 2, None]]}}, "where")


def test_a_prompts_file_takes_text_or_ids_and_refuses_anything_else(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "a b"}\n\n{"input_ids": [1, 2, 3]}\n')
    assert read_prompts(good) == ["a b", (1, 2, 3)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"input_ids": [1, -2]}\n')
    with pytest.raises(BadInput, match=r"bad.jsonl: line 2: expected"):
        read_prompts(bad)
    one = tmp_path / "one.jsonl"
    one.write_text('{"prompt": "a"}\n')
    with pytest.raises(BadInput, match="at least 2 prompts"):
        read_prompts(one)


def test_the_plant_leaves_a_batch_of_one_alone_and_splits_a_larger_batch():
    """batch_variant.py in the engine: alone, the engine's normal bits; in a batch of 8, other bits somewhere."""
    from rlbench.backends.hf_engine import HFEngine
    from rlbench.config_sections import FIXTURES
    from rlbench.core.model import build_model
    from rlbench.core.types import GenerateRequest

    model = build_model(str(FIXTURES / "models" / "tiny-qwen3-sft"), 1234, "float32", "cpu", init="checkpoint")
    engine = HFEngine(model, engine_id="t")
    requests = [GenerateRequest(tuple(range(5 + i, 15 + i)), 7, 6, 1.0, ()) for i in range(8)]
    normal_alone, normal_batch = engine.generate(requests[:1])[0], engine.generate(requests)[0]
    engine.batch_variant = True
    assert engine.generate(requests[:1])[0] == normal_alone == normal_batch
    varied = engine.generate(requests)[0]
    assert varied.logprobs[0] == normal_alone.logprobs[0]  # the prefill's: untouched
    assert [a == b for a, b in zip(varied.logprobs, normal_alone.logprobs)].count(False) > 0
