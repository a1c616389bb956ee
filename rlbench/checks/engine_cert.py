"""`rlbench check engine URL`: a determinism certificate for an SGLang server or router, before any training.

An RL run needs of its engine that a prompt's answer (its output ids and their log-probs) depend on the prompt and
its seed alone: not on the requests it shares a batch with, its row in that batch, what the prefix cache holds, or
how many times it was asked. The modes mirror SGLang's own test of that (python/sglang/test/test_deterministic.py in
sgl-project/sglang, run in CI by test/srt/test_deterministic.py: its "single", "mixed" and "prefix"), over SGLang's
native API only (POST /generate with input_ids, sampling_params, return_logprob; /flush_cache):

- single: each prompt alone, `repeats` times. Its first answer is the prompt's reference.
- mixed: each prompt at every position of batches of each size in `batch_sizes` (one /generate whose input_ids is a
  list of lists: the server schedules them together), the prompts rotated through the rows so that short ones share
  batches with a long one and, where a batch is larger than the set, with copies of themselves; `repeats` times.
- prefix: prompts sharing a long common prefix (the longest prompt, followed by each of the others), each alone after
  a /flush_cache (cold; the first repeat's is the reference) and again with its prefix cached (warm), then all of them
  in one batch, cold and warm; `repeats` times.

Every answer is held to its prompt's reference bit for bit: each output id and each log-prob's 64 bits. The first
difference is named (mode, prompt, batch size, position, repeat, cache, token, both values) and every answer that
differs is counted. Beside the verdict, a figure: each reference's log-probs against the same server's prefill of
the finished sequence (max_new_tokens 0, logprob_start_len one before the output: input_token_logprobs), max |delta|;
reported, and judged only with a gate (`max_prefill_delta`).

Text prompts are made ids once, by the server itself (a prefill with logprob_start_len 0 returns every prompt token's
id), and every request after sends input_ids, as an RL run does. Deliberate simplifications: requests go one at a
time (batches are formed inside one request, not by concurrent arrivals); every request carries one sampling_params
object with the one seed (sglang-router refuses lists of them), so a prompt's noise is the same wherever it sits.

Verdicts (design.md): "deterministic" only once every comparison was made, with the counts; "not deterministic" on a
difference (exit 1); "undetermined" where the server answered an error or an abort, changed its weight version midway,
or left nothing to compare (exit 2, as every check's undetermined: the server, not the certificate, must change).
"""

from __future__ import annotations

import json
import math
import struct
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rlbench.errors import BadInput

MODES = ("single", "mixed", "prefix")
REQUEST_TIMEOUT_S = 300.0
# The built-in prompts: plain text the server tokenizes, short ones and one long one (mixed mode's lengths; the
# shared prefix of prefix mode), short enough for a model of 256 positions.
PROMPTS = (
    "The capital of France is",
    "Count from one to ten:",
    "Q: What is 12 times 7?\nA:",
    "def add(a, b):",
    "You are a careful assistant. Answer the question below in one short sentence, with no working shown.\n",
)

Post = Callable[[str, dict], Any]  # (path, JSON body) -> the parsed answer; Refused on an error answer


class Refused(Exception):
    """The server answered an error (or an answer that cannot be read) where an answer was needed."""


@dataclass(frozen=True)
class Settings:
    repeats: int = 2
    batch_sizes: tuple[int, ...] = (2, 4, 8)
    max_new_tokens: int = 16
    temperature: float = 1.0
    seed: int = 42
    max_prefill_delta: float | None = None

    def __post_init__(self) -> None:
        if not 2 <= self.repeats <= 1000:
            raise BadInput(
                f"expected 2 to 1000 (the first answer is the reference), got {self.repeats}", field="--repeats"
            )
        if not self.batch_sizes or any(not 1 <= b <= 1024 for b in self.batch_sizes):
            raise BadInput(f"expected sizes from 1 to 1024, got {list(self.batch_sizes)}", field="--batch-sizes")
        if not 1 <= self.max_new_tokens <= 1 << 16:
            raise BadInput(f"expected 1 to 65536, got {self.max_new_tokens}", field="--max-new-tokens")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise BadInput(f"expected a finite number >= 0, got {self.temperature}", field="--temperature")
        if not -(2**63) <= self.seed < 2**63:
            raise BadInput(f"expected a 64-bit integer, got {self.seed}", field="--seed")
        if self.max_prefill_delta is not None and not self.max_prefill_delta >= 0:
            raise BadInput(f"expected a number >= 0, got {self.max_prefill_delta}", field="--max-prefill-delta")


@dataclass(frozen=True)
class Place:
    """Where an answer was asked: its mode, the prompt's index, the batch's size, its row, the repeat, and the prefix
    cache ("cold": just after a /flush_cache; "warm": with the shared prefix served since; "" where not set)."""

    mode: str
    prompt: int
    batch_size: int
    position: int
    repeat: int
    cache: str = ""

    def __str__(self) -> str:
        cache = f", {self.cache} cache" if self.cache else ""
        return (
            f"mode {self.mode}, prompt {self.prompt}, batch size {self.batch_size}, position {self.position}, "
            f"repeat {self.repeat}{cache}"
        )


@dataclass(frozen=True)
class Answer:
    ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]
    weight_version: str | None


@dataclass(frozen=True)
class Difference:
    """The first place an answer parts from its prompt's reference: at `token` (an output index), `what` differs
    ("output id", "log-prob", or "length": one answer ended there)."""

    place: Place
    token: int
    what: str
    reference: Any
    got: Any

    def __str__(self) -> str:
        return f"{self.place}: token {self.token}'s {self.what} is {self.got!r} (the reference's: {self.reference!r})"


@dataclass
class Tally:
    answers: int = 0  # answers held to their reference
    tokens: int = 0  # output tokens compared (id and log-prob)
    differing: int = 0  # answers that differ


@dataclass
class Prefill:
    """Each reference's log-probs against the server's prefill of its finished sequence."""

    tokens: int = 0
    differing: int = 0
    max_abs_delta: float = 0.0
    gate: float | None = None


@dataclass
class Certificate:
    url: str
    settings: dict
    prompts: list[dict] = field(default_factory=list)  # each prompt: its ids' count, its source (text or ids)
    counts: dict[str, Tally] = field(default_factory=lambda: {mode: Tally() for mode in MODES})
    first: Difference | None = None
    prefill: Prefill = field(default_factory=Prefill)
    weight_versions: list[str] = field(default_factory=list)
    stopped: str | None = None  # why the check stopped before every comparison was made
    verdict: str = "undetermined"
    failures: list[str] = field(default_factory=list)  # gates failed (--max-prefill-delta)

    def to_json(self) -> dict:
        return asdict(self)


def same_bits(a: float | None, b: float | None) -> bool:
    """Two log-probs are the same 64 bits (None, SGLang's null, equals only None; NaN equals a NaN of its bits)."""
    if a is None or b is None:
        return a is b
    return struct.pack("<d", a) == struct.pack("<d", b)


def compare(reference: Answer, got: Answer, place: Place) -> tuple[int, Difference | None]:
    """How many tokens were compared, and the first difference of `got` from `reference` (None: the same bits)."""
    shared = min(len(reference.ids), len(got.ids))
    for t in range(shared):
        if reference.ids[t] != got.ids[t]:
            return t + 1, Difference(place, t, "output id", reference.ids[t], got.ids[t])
        if not same_bits(reference.logprobs[t], got.logprobs[t]):
            return t + 1, Difference(place, t, "log-prob", reference.logprobs[t], got.logprobs[t])
    if len(reference.ids) != len(got.ids):
        return shared, Difference(place, shared, "length", len(reference.ids), len(got.ids))
    return shared, None


def read_answer(doc: Any, what: str) -> Answer:
    """An SGLang /generate answer's output ids, their log-probs (meta_info.output_token_logprobs) and weight version;
    Refused for an error, an abort, or an answer without them."""
    meta = doc.get("meta_info") if isinstance(doc, dict) else None
    if not isinstance(meta, dict):
        raise Refused(f"{what}: an answer without meta_info: {_short(doc)}")
    finish = meta.get("finish_reason")
    if isinstance(finish, dict) and finish.get("type") == "abort":
        raise Refused(f"{what}: aborted ({finish.get('message')})")
    ids, entries = doc.get("output_ids"), meta.get("output_token_logprobs")
    if not isinstance(ids, list) or not isinstance(entries, list) or len(entries) != len(ids):
        raise Refused(f"{what}: no output_ids with one output_token_logprobs entry each: {_short(doc)}")
    try:
        if [int(e[1]) for e in entries] != ids:
            raise Refused(f"{what}: output_token_logprobs' ids are not output_ids")
        logprobs = tuple(None if e[0] is None else float(e[0]) for e in entries)
    except (TypeError, ValueError, IndexError):
        raise Refused(f"{what}: unreadable output_token_logprobs: {_short(entries)}") from None
    version = meta.get("weight_version")
    return Answer(tuple(ids), logprobs, None if version is None else str(version))


def asking(post: Post, path: str, body: dict, what: str) -> Any:
    """`post(path, body)`, its refusal naming what was asked."""
    try:
        return post(path, body)
    except Refused as exc:
        raise Refused(f"{what}: {exc}") from None


def _short(value: Any, limit: int = 200) -> str:
    text = value if isinstance(value, str) else json.dumps(value)  # answers are parsed JSON: they dump
    return text if len(text) <= limit else text[:limit] + "..."


class Check:
    """One certificate's requests and comparisons: the references, the tallies, the first difference."""

    def __init__(self, post: Post, settings: Settings, certificate: Certificate):
        self.post, self.settings, self.cert = post, settings, certificate
        self.references: dict[int, Answer] = {}

    def params(self, max_new_tokens: int) -> dict:
        s = self.settings
        return {"max_new_tokens": max_new_tokens, "temperature": s.temperature, "sampling_seed": s.seed}

    def ask(self, prompts: list[tuple[int, ...]], what: str) -> list[Answer]:
        """One /generate: one prompt alone, or several as one batch; their answers in order."""
        body = {
            "input_ids": list(prompts[0]) if len(prompts) == 1 else [list(p) for p in prompts],
            "sampling_params": self.params(self.settings.max_new_tokens),
            "return_logprob": True,
        }
        doc = asking(self.post, "/generate", body, what)
        docs = [doc] if len(prompts) == 1 and isinstance(doc, dict) else doc
        if not isinstance(docs, list) or len(docs) != len(prompts):
            raise Refused(f"{what}: expected {len(prompts)} answers, got {_short(doc)}")
        answers = [read_answer(d, what) for d in docs]
        for answer in answers:
            if answer.weight_version is not None and answer.weight_version not in self.cert.weight_versions:
                self.cert.weight_versions.append(answer.weight_version)
        return answers

    def judge(self, place: Place, answer: Answer) -> None:
        """Hold `answer` to its prompt's reference; the first answer of a prompt is its reference."""
        reference = self.references.setdefault(place.prompt, answer)
        if reference is answer:
            return
        tally = self.cert.counts[place.mode]
        tokens, difference = compare(reference, answer, place)
        tally.answers += 1
        tally.tokens += tokens
        if difference is not None:
            tally.differing += 1
            self.cert.first = self.cert.first or difference

    def batch(self, mode: str, indices: list[int], ids: Sequence[tuple[int, ...]], repeat: int, cache: str = ""):
        size = len(indices)
        rows = f"prompt {indices[0]} alone" if size == 1 else f"a batch of {size} (prompts {indices})"
        where = f"mode {mode}, {rows}, repeat {repeat}" + (f", {cache} cache" if cache else "")
        answers = self.ask([ids[i] for i in indices], where)
        for position, (i, answer) in enumerate(zip(indices, answers)):
            self.judge(Place(mode, i, size, position, repeat, cache), answer)

    def single(self, ids: Sequence[tuple[int, ...]], indices: range) -> None:
        for repeat in range(self.settings.repeats):
            for i in indices:
                self.batch("single", [i], ids, repeat)

    def mixed(self, ids: Sequence[tuple[int, ...]], indices: range) -> None:
        n = len(indices)
        for repeat in range(self.settings.repeats):
            for size in self.settings.batch_sizes:
                for start in range(n):  # row k holds prompt start + k: every prompt at every position
                    self.batch("mixed", [indices[(start + k) % n] for k in range(size)], ids, repeat)

    def prefix(self, ids: Sequence[tuple[int, ...]], indices: range) -> None:
        for repeat in range(self.settings.repeats):
            for i in indices:
                asking(self.post, "/flush_cache", {}, f"mode prefix, before prompt {i} alone, repeat {repeat}")
                self.batch("prefix", [i], ids, repeat, "cold")
            for i in indices:
                self.batch("prefix", [i], ids, repeat, "warm")
            asking(self.post, "/flush_cache", {}, f"mode prefix, before the batch of {len(indices)}, repeat {repeat}")
            self.batch("prefix", list(indices), ids, repeat, "cold")
            self.batch("prefix", list(indices), ids, repeat, "warm")

    def prefill(self, ids: Sequence[tuple[int, ...]]) -> None:
        """Each reference's log-probs against the server's prefill of prompt + output (max_new_tokens 0)."""
        figure = self.cert.prefill
        for i, reference in sorted(self.references.items()):
            out = reference.ids
            if not out:
                continue
            start = len(ids[i]) - 1  # one before the output: SGLang's entry at logprob_start_len has a null logprob
            body = {
                "input_ids": list(ids[i]) + list(out),
                "sampling_params": self.params(0),
                "return_logprob": True,
                "logprob_start_len": start,
            }
            what = f"the prefill of prompt {i}'s answer"
            entries = _input_logprobs(asking(self.post, "/generate", body, what), what)
            scored = entries[-len(out) :]  # fewer entries than output tokens: their ids are not the output's
            if [e[1] for e in scored] != list(out) or any(e[0] is None for e in scored):
                raise Refused(
                    f"the prefill of prompt {i}'s answer: no log-prob for each output token: {_short(entries)}"
                )
            for (logprob, _), decoded in zip(scored, reference.logprobs):
                delta = abs(logprob - decoded) if decoded is not None else math.nan
                figure.tokens += 1
                figure.differing += not same_bits(logprob, decoded)
                figure.max_abs_delta = delta if math.isnan(delta) else max(figure.max_abs_delta, delta)


def _input_logprobs(doc: Any, what: str) -> list[tuple[float | None, int]]:
    meta = doc.get("meta_info") if isinstance(doc, dict) else None
    entries = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
    try:
        return [(None if e[0] is None else float(e[0]), int(e[1])) for e in entries]
    except (TypeError, ValueError, IndexError):
        raise Refused(f"{what}: no input_token_logprobs in the answer: {_short(doc)}") from None


def tokenize(post: Post, prompt: str | tuple[int, ...], index: int) -> tuple[int, ...]:
    """A prompt's ids: given, or the server's own tokenization of its text (a prefill with logprob_start_len 0
    returns every prompt token's id, the first with a null log-prob)."""
    if not isinstance(prompt, str):
        return prompt
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": 0}
    what = f"the tokenization of prompt {index}"
    doc = asking(post, "/generate", body, what)
    ids = tuple(e[1] for e in _input_logprobs(doc, what))
    counted = doc["meta_info"].get("prompt_tokens")
    if not ids or (counted is not None and counted != len(ids)):
        raise Refused(
            f"the tokenization of prompt {index}: {len(ids)} input_token_logprobs for {counted} prompt tokens"
        )
    return ids


def certify(post: Post, prompts: Sequence[str | tuple[int, ...]], settings: Settings, url: str) -> Certificate:
    """Run every mode against the server `post` talks to and give the certificate (its verdict decided)."""
    cert = Certificate(url, asdict(settings))
    check = Check(post, settings, cert)
    try:
        ids = [tokenize(post, p, i) for i, p in enumerate(prompts)]
        longest = max(range(len(ids)), key=lambda i: len(ids[i]))
        others = [i for i in range(len(ids)) if i != longest]
        everything = ids + [ids[longest] + ids[i] for i in others]  # then prefix mode's prompts
        sources = [p if isinstance(p, str) else "input_ids" for p in prompts]
        sources += [f"prompt {longest} + prompt {i}" for i in others]
        cert.prompts = [{"tokens": len(p), "source": source} for p, source in zip(everything, sources)]
        main, prefixed = range(len(ids)), range(len(ids), len(everything))
        check.single(everything, main)
        check.mixed(everything, main)
        check.prefix(everything, prefixed)
        check.prefill(everything)
    except Refused as exc:
        cert.stopped = str(exc)
    decide(cert, settings)
    return cert


def decide(cert: Certificate, settings: Settings) -> None:
    """The verdict from what was compared (design.md's rules), and the gate's failure where one is set."""
    cert.prefill.gate = settings.max_prefill_delta
    if len(cert.weight_versions) > 1:
        cert.stopped = cert.stopped or (
            f"the weight version changed during the check ({', '.join(cert.weight_versions)}): its answers are not "
            "of one model"
        )
        cert.verdict = "undetermined"
        return
    if cert.first is not None:
        cert.verdict = "not deterministic"
    elif cert.stopped is not None:
        cert.verdict = "undetermined"
    elif not sum(t.tokens for t in cert.counts.values()):  # every mode's plan holds answers: were any not empty?
        cert.stopped, cert.verdict = "nothing compared in any output token (every answer empty)", "undetermined"
    else:
        cert.verdict = "deterministic"
    # A deterministic certificate compared output tokens, so the prefill held some; one that is not deterministic
    # stays so (its difference is the finding), whatever the prefill held.
    gate, figure = settings.max_prefill_delta, cert.prefill
    if gate is not None and cert.verdict != "undetermined" and not figure.max_abs_delta <= gate:  # NaN fails, by name
        cert.failures.append(
            f"decode vs prefill: max |delta| {figure.max_abs_delta!r} over {figure.tokens} tokens exceeds "
            f"--max-prefill-delta {gate!r}"
        )


# ---------------------------------------------------------------- the server, over HTTP


class Server:
    """POSTs JSON to an SGLang server or router at `url` (with `Authorization: Bearer KEY` where a key is given),
    straight to it (no proxy from the environment). An error answer is Refused; no answer at all, BadInput."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = REQUEST_TIMEOUT_S):
        if not url.startswith(("http://", "https://")) or url in ("http://", "https://"):
            raise BadInput(f"expected an http:// or https:// address, got {url!r}", field="URL")
        self.url, self.timeout = url.rstrip("/"), timeout
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def __call__(self, path: str, body: dict) -> Any:
        request = urllib.request.Request(self.url + path, json.dumps(body).encode(), self.headers, method="POST")
        try:
            with self.opener.open(request, timeout=self.timeout) as answer:
                text = answer.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as exc:
            said = exc.read().decode("utf-8", "replace").strip()
            if exc.code == 401:
                raise BadInput(
                    f"POST {path} answered 401 Unauthorized: give the server's key (--api-key)", path=self.url
                ) from None
            raise Refused(f"POST {path} answered {exc.code}: {_short(said)}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise BadInput(f"cannot reach the server ({reason})", path=self.url) from None
        try:
            return json.loads(text)
        except ValueError:
            return text  # /flush_cache answers a line of text


def read_prompts(path: str | Path) -> list[str | tuple[int, ...]]:
    """A JSONL file of prompts: each line an object with "prompt" (text the server tokenizes) or "input_ids"."""
    prompts: list[str | tuple[int, ...]] = []
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        text = row.get("prompt") if isinstance(row, dict) else None
        ids = row.get("input_ids") if isinstance(row, dict) else None
        if isinstance(text, str) and text:
            prompts.append(text)
        elif isinstance(ids, list) and ids and all(type(i) is int and i >= 0 for i in ids):
            prompts.append(tuple(ids))
        else:
            raise BadInput(
                'expected {"prompt": "non-empty text"} or {"input_ids": [ids >= 0]}', path=path, field=f"line {number}"
            )
    if len(prompts) < 2:
        raise BadInput(f"expected at least 2 prompts (prefix mode joins them), got {len(prompts)}", path=path)
    return prompts
