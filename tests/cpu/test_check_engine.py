"""`rlbench check engine URL`, the determinism certificate of an SGLang server (rlbench/checks/engine_cert.py).

Against `rlbench serve` started as a process of its own, as a user starts it: deterministic, exit 0, with the counts
of what was compared; against the same server started `--batch-variant` (its batched decode's lm-head product split
by the batch's size, rlbench/backends/batch_variant.py): exit 1, naming the first prompt, batch size and position
that differ. Then the comparison and the verdict rules alone, against a stand-in server function: a difference at
each place is named there; none is "deterministic" with the counts each mode's plan gives; an error or abort answer,
a weight version that changes, or nothing compared is "undetermined", never a pass. Over HTTP, that stand-in behind
a local server: the JSON certificate whole, every request body as the server receives it, and an error answer or a
server that does not answer as one line. Each option's range, each prompts file line and each unreadable answer is
refused with its own message.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import socket
import threading

import pytest

from rlbench.checks.engine_cert import (
    PROMPTS,
    Answer,
    Place,
    Refused,
    Server,
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


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ({"repeats": 1001}, "--repeats: expected 2 to 1000 (the first answer is the reference), got 1001"),
        ({"batch_sizes": ()}, "--batch-sizes: expected sizes from 1 to 1024, got []"),
        ({"batch_sizes": (2, 1025)}, "--batch-sizes: expected sizes from 1 to 1024, got [2, 1025]"),
        ({"max_new_tokens": 0}, "--max-new-tokens: expected 1 to 65536, got 0"),
        ({"max_new_tokens": 65537}, "--max-new-tokens: expected 1 to 65536, got 65537"),
        ({"temperature": -0.5}, "--temperature: expected a finite number >= 0, got -0.5"),
        ({"temperature": math.inf}, "--temperature: expected a finite number >= 0, got inf"),
        ({"seed": -(2**63) - 1}, "--seed: expected a 64-bit integer, got -9223372036854775809"),
        ({"seed": 2**63}, "--seed: expected a 64-bit integer, got 9223372036854775808"),
        ({"max_prefill_delta": -0.1}, "--max-prefill-delta: expected a number >= 0, got -0.1"),
        ({"max_prefill_delta": math.nan}, "--max-prefill-delta: expected a number >= 0, got nan"),
    ],
)
def test_a_setting_out_of_range_is_refused_naming_its_option(given, said):
    with pytest.raises(BadInput) as refused:
        Settings(**given)
    assert str(refused.value) == said


def test_each_settings_range_takes_both_its_ends():
    ends = [{"repeats": 2}, {"repeats": 1000}, {"batch_sizes": (1, 1024)}, {"max_new_tokens": 1}]
    ends += [{"max_new_tokens": 65536}, {"temperature": 0.0}, {"temperature": 0.5}, {"seed": -(2**63)}]
    ends += [{"seed": 2**63 - 1}, {"max_prefill_delta": 0.0}]
    for given in ends:
        Settings(**given)  # taken: no BadInput


@pytest.mark.parametrize("url", ["ftp://host:1", "127.0.0.1:30000", "http://", "https://"])
def test_an_address_that_is_not_http_is_refused(url):
    with pytest.raises(BadInput) as refused:
        Server(url)
    assert str(refused.value) == f"URL: expected an http:// or https:// address, got {url!r}"


def test_http_and_https_addresses_are_taken_even_with_a_one_letter_host_less_a_trailing_slash():
    taken = [Server(url).url for url in ("http://e", "http://X/", "https://e:8443/v1/")]
    assert taken == ["http://e", "http://X", "https://e:8443/v1"]


@contextlib.contextmanager
def _wire(answer):
    """A stand-in server over HTTP on a free local port: each POST's (path, Content-Type, JSON body) recorded in the
    list given with its URL, and answered `answer(path, body)`: (status, the bytes of the answer)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, self.headers["Content-Type"], body))
            status, data = answer(self.path, body)
            self.send_response(status)
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True).start()  # shutdown() waits a poll
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def test_over_http_the_json_is_the_whole_certificate_and_the_requests_are_sglangs(tmp_path, monkeypatch):
    """Two prompts, text and ids (the longest first); the address with a trailing slash; a proxy in the environment,
    which the check does not use; /flush_cache's line of text not UTF-8, read all the same."""
    for name in ("no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "xyz"}\n{"input_ids": [0, 98]}\n')
    stand = Stand()

    def answer(path, body):
        said = stand(path, body)
        return 200, b"Cache flushed \xff\n" if path == "/flush_cache" else json.dumps(said).encode()

    options = ("--repeats", "2", "--batch-sizes", "2", "--max-new-tokens", "3", "--temperature", "0.5", "--seed", "7")
    with _wire(answer) as (url, seen):
        res = cli(
            "check", "engine", url + "/", "--prompts", str(prompts), *options, "--max-prefill-delta", "0.5", "--json"
        )
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(res.stdout) == {
        "url": url,
        "settings": {
            "repeats": 2,
            "batch_sizes": [2],
            "max_new_tokens": 3,
            "temperature": 0.5,
            "seed": 7,
            "max_prefill_delta": 0.5,
        },
        "prompts": [
            {"tokens": 3, "source": "xyz"},
            {"tokens": 2, "source": "input_ids"},
            {"tokens": 5, "source": "prompt 0 + prompt 1"},
        ],
        "counts": {mode: {"answers": n, "tokens": 3 * n, "differing": 0} for mode, n in _plan(2, 2, (2,)).items()},
        "first": None,
        "prefill": {"tokens": 9, "differing": 0, "max_abs_delta": 0.0, "gate": 0.5},
        "weight_versions": ["v1"],
        "stopped": None,
        "verdict": "deterministic",
        "failures": [],
    }
    assert {kind for _, kind, _ in seen} == {"application/json"}
    text, ids, joined = [120, 121, 122], [0, 98], [120, 121, 122, 0, 98]  # the stand-in's ids: one per character
    sampling = {"max_new_tokens": 3, "temperature": 0.5, "sampling_seed": 7}

    def generate(input_ids):
        return "/generate", {"input_ids": input_ids, "sampling_params": sampling, "return_logprob": True}

    def prefill(prompt):  # the prompt and its answer, scored from the prompt's last token on
        body = {"input_ids": prompt + Stand.decode(tuple(prompt), 3)[0], "return_logprob": True}
        return "/generate", {
            **body,
            "sampling_params": {**sampling, "max_new_tokens": 0},
            "logprob_start_len": len(prompt) - 1,
        }

    flush = ("/flush_cache", {})
    tokenize = {"text": "xyz", "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": 0}
    assert [(path, body) for path, _, body in seen] == [
        ("/generate", tokenize),  # the ids prompt is sent as given
        *[generate(text), generate(ids)] * 2,  # single: each alone, twice
        *[generate([text, ids]), generate([ids, text])] * 2,  # mixed: each prompt at each row of a batch of 2, twice
        *[flush, generate(joined), generate(joined), flush, generate(joined), generate(joined)] * 2,  # prefix
        prefill(text),
        prefill(ids),
        prefill(joined),
    ]


def test_an_error_answer_is_refused_with_what_the_server_said_cut_at_200_characters():
    said = {"/a": b'  {"error": "bad \xff input"}\n', "/b": b"x" * 200, "/c": b"y" * 201}
    with _wire(lambda path, body: (400 if path == "/a" else 503, said[path])) as (url, seen):
        server = Server(url)
        refusals = []
        for path in said:
            with pytest.raises(Refused) as refused:
                server(path, {"n": 1})
            refusals.append(str(refused.value))
    assert [(path, body) for path, _, body in seen] == [(path, {"n": 1}) for path in said]
    assert refusals == [
        'POST /a answered 400: {"error": "bad \ufffd input"}',
        "POST /b answered 503: " + "x" * 200,
        "POST /c answered 503: " + "y" * 200 + "...",
    ]


def test_a_server_that_does_not_answer_in_time_is_one_line():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()  # connections are accepted, never answered
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        with pytest.raises(BadInput) as refused:  # the client's own timeout is the only way out: no clock here
            Server(url, timeout=0.2)("/generate", {})
    assert str(refused.value) == f"{url}: cannot reach the server (timed out)"


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
    (seen: times this prompt was asked before; warm: anything asked since the last /flush_cache). It keeps each
    request it was sent, (path, body), in `requests`. Its log-probs are eighths: sums and differences are exact."""

    def __init__(self, new_tokens: int = 3, fault=None, empty: bool = False, version=lambda call: "v1"):
        self.fault, self.new_tokens, self.empty, self.version = fault, new_tokens, empty, version
        self.seen: dict[tuple, int] = {}
        self.cached: set[tuple] = set()
        self.calls = 0
        self.requests: list[tuple[str, dict]] = []

    @staticmethod
    def decode(prompt: tuple[int, ...], n: int) -> tuple[list[int], list[float]]:
        return [(sum(prompt) + k) % 97 for k in range(n)], [-((sum(prompt) + k) % 13 + 1) / 8 for k in range(n)]

    def __call__(self, path: str, body: dict):
        self.calls += 1
        self.requests.append((path, body))
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
    assert str(cert.first) == (
        "mode prefix, prompt 5, batch size 1, position 0, repeat 0, warm cache: token 2's length is 2 "
        "(the reference's: 3)"
    )


@pytest.mark.parametrize(
    ("size", "seen", "place"),
    [
        (1, 4, Place("prefix", 5, 1, 0, 1, "cold")),  # alone after a /flush_cache, the second repeat
        (4, 2, Place("prefix", 5, 4, 0, 0, "cold")),  # all four in one batch after a /flush_cache
        (4, 3, Place("prefix", 5, 4, 0, 0, "warm")),  # the same batch again
    ],
)
def test_a_difference_in_prefix_mode_is_named_alone_or_batched_and_cold_or_warm(size, seen, place):
    """Prefix mode's prompts (the longest joined to each other) are asked, each repeat: alone cold, alone warm, in
    one batch cold, in one batch warm; `seen` picks one of those askings."""
    long = len(PROMPTS[LONGEST])

    def fault(prompt, batch_size, position, times, warm):
        return _nudge_logprob(0) if len(prompt) > long and (batch_size, times) == (size, seen) else None

    assert _certify(Stand(fault=fault)).first.place == place


def _refuse(path):
    raise Refused(f'POST {path} answered 400: {{"error":{{"message":"no"}}}}')


def _flushes(stand: Stand) -> int:
    return sum(path == "/flush_cache" for path, _ in stand.requests)


def _batched(body: dict) -> bool:
    return isinstance(body.get("input_ids", [0])[0], list)


def _prefill_of(body: dict, prompt: str) -> bool:
    """A prefill request (max_new_tokens 0) of the finished answer of the stand-in's `prompt`."""
    ids = [ord(c) for c in prompt]
    return body.get("sampling_params", {}).get("max_new_tokens") == 0 and body.get("input_ids", [])[: len(ids)] == ids


def _certify_through(change, settings: Settings = SETTINGS):
    """certify against the stand-in, with `change(stand, path, body, answer)` the answer the server gives instead."""
    stand = Stand()
    return certify(lambda path, body: change(stand, path, body, stand(path, body)), PROMPTS, settings, "http://stand")


REFUSED = ': POST /generate answered 400: {"error":{"message":"no"}}'


@pytest.mark.parametrize(
    ("change", "stopped"),
    [
        (
            lambda stand, path, body, answer: (
                _refuse(path) if _batched(body) and len(body["input_ids"]) == 4 else answer
            ),
            "mode mixed, a batch of 4 (prompts [0, 1, 2, 3]), repeat 0" + REFUSED,
        ),
        (
            lambda stand, path, body, answer: _refuse(path) if body.get("text") == PROMPTS[1] else answer,
            "the tokenization of prompt 1" + REFUSED,
        ),
        (
            lambda stand, path, body, answer: (
                _refuse(path) if len(body.get("input_ids", ())) > len(PROMPTS[LONGEST]) else answer
            ),
            "mode prefix, prompt 5 alone, repeat 0, cold cache" + REFUSED,
        ),
        (
            lambda stand, path, body, answer: _refuse(path) if _flushes(stand) == 1 else answer,
            'mode prefix, before prompt 5 alone, repeat 0: POST /flush_cache answered 400: {"error":{"message":"no"}}',
        ),
        (
            lambda stand, path, body, answer: _refuse(path) if _flushes(stand) == 5 else answer,
            'mode prefix, before the batch of 4, repeat 0: POST /flush_cache answered 400: {"error":{"message":"no"}}',
        ),
        (
            lambda stand, path, body, answer: _refuse(path) if _prefill_of(body, PROMPTS[2]) else answer,
            "the prefill of prompt 2's answer" + REFUSED,
        ),
    ],
    ids=["mixed", "tokenization", "prefix-alone", "flush-alone", "flush-batch", "prefill"],
)
def test_an_error_answer_is_undetermined_naming_the_request(change, stopped):
    cert = _certify_through(change)
    assert (cert.verdict, cert.first, cert.stopped) == ("undetermined", None, stopped)


def _prefill_entries(answer: dict) -> list:
    return answer["meta_info"]["input_token_logprobs"]


@pytest.mark.parametrize(
    ("change", "stopped"),
    [
        (
            lambda stand, path, body, answer: "Internal Server Error" if "text" in body else answer,
            "the tokenization of prompt 0: no input_token_logprobs in the answer: Internal Server Error",
        ),
        (
            lambda stand, path, body, answer: {"meta_info": None} if body.get("text") == PROMPTS[3] else answer,
            'the tokenization of prompt 3: no input_token_logprobs in the answer: {"meta_info": null}',
        ),
        (
            lambda stand, path, body, answer: (
                {"meta_info": {"prompt_tokens": 4, "input_token_logprobs": [[None, 1], [-1.0, 2], [-1.0, 3]]}}
                if "text" in body
                else answer
            ),
            "the tokenization of prompt 0: 3 input_token_logprobs for 4 prompt tokens",
        ),
        (
            lambda stand, path, body, answer: {"error": "busy"} if _batched(body) else answer,
            'mode mixed, a batch of 2 (prompts [0, 1]), repeat 0: expected 2 answers, got {"error": "busy"}',
        ),
        (
            lambda stand, path, body, answer: [] if _batched(body) else answer,
            "mode mixed, a batch of 2 (prompts [0, 1]), repeat 0: expected 2 answers, got []",
        ),
        (
            lambda stand, path, body, answer: {"meta_info": {}} if _prefill_of(body, PROMPTS[0]) else answer,
            'the prefill of prompt 0\'s answer: no input_token_logprobs in the answer: {"meta_info": {}}',
        ),
        (
            lambda stand, path, body, answer: (
                {"meta_info": {"input_token_logprobs": [[None, 5, None], [-1.0, 6, None]]}}
                if _prefill_of(body, PROMPTS[0])
                else answer
            ),
            "the prefill of prompt 0's answer: no log-prob for each output token: [[null, 5], [-1.0, 6]]",
        ),
        (
            lambda stand, path, body, answer: (
                {"meta_info": {"input_token_logprobs": [*_prefill_entries(answer)[:-1], [None, 43, None]]}}
                if _prefill_of(body, PROMPTS[0])
                else answer
            ),
            "the prefill of prompt 0's answer: no log-prob for each output token: [[null, 115], [-0.625, 41], "
            "[-0.75, 42], [null, 43]]",
        ),
    ],
    ids=[
        "tokenization-text",
        "tokenization-null",
        "tokenization-count",
        "batch-dict",
        "batch-short",
        "prefill-none",
        "prefill-ids",
        "prefill-null",
    ],
)
def test_an_answer_that_cannot_be_read_is_undetermined_naming_the_request_and_what_it_lacks(change, stopped):
    cert = _certify_through(change)
    assert (cert.verdict, cert.first, cert.stopped) == ("undetermined", None, stopped)


def test_an_abort_is_undetermined_and_a_difference_before_a_stop_still_fails():
    cert = _certify(Stand(fault=lambda prompt, size, position, seen, cached: "abort" if size == 4 else None))
    assert cert.verdict == "undetermined" and cert.stopped.endswith("repeat 0: aborted (Aborted)")

    def fault(prompt, size, position, seen, cached):
        return "abort" if size == 4 else _nudge_logprob(0) if size == 2 else None

    cert = _certify(Stand(fault=fault))
    assert cert.verdict == "not deterministic" and cert.first.place.batch_size == 2 and cert.stopped
    gated = _certify(Stand(fault=fault), Settings(repeats=2, batch_sizes=(2, 4), max_new_tokens=3, max_prefill_delta=0))
    assert (gated.verdict, gated.stopped, gated.failures) == ("not deterministic", cert.stopped, [])  # still a finding


def test_nothing_compared_never_passes():
    cert = _certify(Stand(empty=True))  # every answer ends at once: the same, and nothing compared
    assert cert.verdict == "undetermined" and cert.stopped.startswith("nothing compared in any output token")
    assert sum(t.answers for t in cert.counts.values()) > 0 and sum(t.tokens for t in cert.counts.values()) == 0
    gated = _certify(Stand(empty=True), Settings(repeats=2, batch_sizes=(2,), max_prefill_delta=0.0))
    assert (gated.verdict, gated.stopped, gated.failures) == ("undetermined", cert.stopped, [])
    assert cert.stopped == "nothing compared in any output token (every answer empty)"


def test_an_empty_answer_is_compared_but_not_prefilled():
    first = tuple(ord(c) for c in PROMPTS[0])
    stand = Stand(
        fault=lambda prompt, size, position, seen, warm: (lambda o, lp: ([], [])) if prompt == first else None
    )
    cert = _certify(stand)
    assert cert.verdict == "deterministic" and cert.prefill.tokens == 3 * (len(cert.prompts) - 1)
    assert not any(_prefill_of(body, PROMPTS[0]) for path, body in stand.requests if "input_ids" in body)


def test_a_weight_version_that_changes_midway_is_undetermined():
    cert = _certify(Stand(version=lambda call: "v1" if call < 30 else "v2"))
    assert cert.verdict == "undetermined" and cert.weight_versions == ["v1", "v2"]
    assert cert.stopped == "the weight version changed during the check (v1, v2): its answers are not of one model"


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
    assert cert.prefill.gate == 0.1
    nan = Stand(fault=lambda prompt, size, position, seen, cached: lambda o, lp: (o, [math.nan] * len(lp)))
    assert certify(nan, PROMPTS, gated, "u").failures[0].startswith("decode vs prefill: max |delta| nan")
    null = Stand(fault=lambda prompt, size, position, seen, cached: lambda o, lp: (o, [None] * len(lp)))
    cert = certify(null, PROMPTS, gated, "u")  # SGLang's null log-prob: no delta to take, so NaN
    assert cert.verdict == "deterministic" and cert.prefill.differing == 27
    assert cert.failures == ["decode vs prefill: max |delta| nan over 27 tokens exceeds --max-prefill-delta 0.1"]


def test_the_prefill_gate_holds_the_largest_delta_of_any_token_and_takes_its_bound():
    def shifted(path, body):  # each prefill's first output token 0.25 off; the rest exact
        answer = stand(path, body)
        if body.get("logprob_start_len", -1) > 0:
            answer["meta_info"]["input_token_logprobs"][-3][0] += 0.25
        return answer

    stand = Stand()
    cert = certify(
        shifted, PROMPTS, Settings(repeats=2, batch_sizes=(2,), max_new_tokens=3, max_prefill_delta=0.25), "u"
    )
    assert (cert.prefill.max_abs_delta, cert.prefill.differing, cert.failures) == (0.25, 9, [])
    stand = Stand()
    stopped = certify(  # a refusal after some prefills: undetermined, and the gate judges nothing
        lambda path, body: _refuse(path) if _prefill_of(body, PROMPTS[4]) else shifted(path, body),
        PROMPTS,
        Settings(repeats=2, batch_sizes=(2,), max_new_tokens=3, max_prefill_delta=0.1),
        "u",
    )
    assert (stopped.verdict, stopped.prefill.max_abs_delta, stopped.failures) == ("undetermined", 0.25, [])


@pytest.mark.parametrize(
    ("doc", "said"),
    [
        ({"error": "x"}, 'where: an answer without meta_info: {"error": "x"}'),
        ("Internal Server Error", "where: an answer without meta_info: Internal Server Error"),
        (
            {"meta_info": {"output_token_logprobs": []}},
            'where: no output_ids with one output_token_logprobs entry each: {"meta_info": {"output_token_logprobs": '
            "[]}}",
        ),
        (
            {"output_ids": [1, 2], "meta_info": {"output_token_logprobs": [[-1.0, 1, None]]}},
            'where: no output_ids with one output_token_logprobs entry each: {"output_ids": [1, 2], "meta_info": '
            '{"output_token_logprobs": [[-1.0, 1, null]]}}',
        ),
        (
            {"output_ids": [1], "meta_info": {"output_token_logprobs": [[-1.0, 2, None]]}},
            "where: output_token_logprobs' ids are not output_ids",
        ),
        (
            {"output_ids": [1], "meta_info": {"output_token_logprobs": [[-1.0]]}},
            "where: unreadable output_token_logprobs: [[-1.0]]",
        ),
        (
            {"output_ids": [], "meta_info": {"finish_reason": {"type": "abort", "message": "Aborted"}}},
            "where: aborted (Aborted)",
        ),
    ],
)
def test_an_answer_that_cannot_be_read_is_refused_saying_why(doc, said):
    with pytest.raises(Refused) as refused:
        read_answer(doc, "where")
    assert str(refused.value) == said


def test_an_answer_is_read_with_its_null_log_probs_and_its_weight_version_if_any():
    entries = [[None, 3, None], [-0.5, 4, None]]
    assert read_answer({"output_ids": [3, 4], "meta_info": {"output_token_logprobs": entries}}, "w") == Answer(
        (3, 4), (None, -0.5), None
    )
    meta = {"output_token_logprobs": entries, "weight_version": 7}
    assert read_answer({"output_ids": [3, 4], "meta_info": meta}, "w") == Answer((3, 4), (None, -0.5), "7")


def test_a_prompts_file_takes_text_or_ids(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "a b"}\n\n{"input_ids": [0, 2, 3]}\n  \n', encoding="utf-8")
    assert read_prompts(good) == ["a b", (0, 2, 3)]
    one = tmp_path / "one.jsonl"
    one.write_text('{"prompt": "a"}\n')
    with pytest.raises(BadInput) as refused:
        read_prompts(one)
    assert str(refused.value) == f"{one}: expected at least 2 prompts (prefix mode joins them), got 1"


def test_a_prompts_file_is_read_as_utf8_whatever_the_locale(tmp_path):
    import locale

    accented = tmp_path / "p.jsonl"
    accented.write_text('{"prompt": "café"}\n{"prompt": "naïve"}\n', encoding="utf-8")
    saved = locale.setlocale(locale.LC_CTYPE)
    locale.setlocale(locale.LC_CTYPE, "C")  # an ASCII locale, as a bare container's
    try:
        assert read_prompts(accented) == ["café", "naïve"]
    finally:
        locale.setlocale(locale.LC_CTYPE, saved)


@pytest.mark.parametrize(
    "line",
    [
        "not json",
        "[1, 2]",
        '"text"',
        '{"prompt": ""}',
        '{"prompt": ["a"]}',
        '{"input_ids": []}',
        '{"input_ids": [1, -2]}',
        '{"input_ids": [1, 2.0]}',
        '{"input_ids": [true]}',
        '{"text": "a"}',
    ],
)
def test_a_prompts_file_refuses_any_other_line_naming_it(tmp_path, line):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(f'{{"prompt": "a"}}\n{line}\n{{"prompt": "b"}}\n')
    with pytest.raises(BadInput) as refused:
        read_prompts(bad)
    assert (
        str(refused.value) == f'{bad}: line 2: expected {{"prompt": "non-empty text"}} or {{"input_ids": [ids >= 0]}}'
    )


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
