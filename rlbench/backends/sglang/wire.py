"""SGLang's native `/generate`, both sides of the wire: the body the client sends for one
`GenerateRequest` and how it reads the answer; the bodies `rlbench serve` accepts and what it answers.

Field names, defaults and error shapes follow SGLang (python/sglang/srt/managers/io_struct.py
GenerateReqInput, srt/sampling/sampling_params.py, srt/entrypoints/http_server.py;
/work/shared/sglang-api.md):

- The client sends `input_ids`, `return_logprob: true` and, in `sampling_params`, temperature,
  top_p, top_k, max_new_tokens, stop_token_ids and the request's own `sampling_seed`: only
  fields sglang-router keeps (it re-serialises the request and drops others, `seed` among them).
  rlbench's top_k 0 ("off") is sent as -1, SGLang's off (SGLang refuses 0).
- It reads the sampled ids and log-probs from `meta_info.output_token_logprobs` (as slime does),
  holds them to `output_ids`, and `meta_info.finish_reason.type` (stop, length, abort).
- A server's errors are 400s: a body that is not a JSON object gets FastAPI's envelope as SGLang
  rewrites it (`{"object": "error", "message", "type": "Bad Request", "param", "code": 400}`); a
  field of the wrong type or an unknown sampling field gets SGLang's schema-gate answer
  (`{"error": "<text>"}`); a value out of range gets its ValueError answer (`{"error": {"message"}}`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlbench.core.types import GenerateRequest
from rlbench.errors import BadInput
from rlbench.rundir.algorithm import CHECKSUM
from rlbench.validate import normalize_url  # noqa: F401 - the client's and the fleet's, as the server's

# The first line `rlbench serve` prints once it is ready; a launcher reads the URL after it.
LISTENING = "rlbench serve: listening on "
SAMPLING_EPS = 1e-6  # SGLang: a temperature below this is greedy
DEFAULT_SEED = 42  # SGLang's sampling_seed when a request gives none (deterministic inference)
MAX_BATCH = 4096  # items of one batched /generate; more is refused, not queued
# What `rlbench serve` says its /weights_checker checksums are (SGLang's own server hashes otherwise).
CHECKSUM_ALGORITHM = f"{CHECKSUM} of (name, dtype, shape, bytes): rlbench.rundir.digest"
SEED_MAX = 2**63 - 1  # SGLang's sampling_seed is an i64, the router's a u64, negative ones are refused

# SGLang's SamplingParams fields; the router keeps the first group and drops the rest.
_SAMPLING_FIELDS = ("max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
                    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
                    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
                    "spaces_between_special_tokens", "no_stop_trim", "custom_params", "stream_interval",
                    "logit_bias", "sampling_seed")
# Fields the embedded engine cannot honour: accepted at their SGLang default only.
_DEFAULT_ONLY = {"stop": None, "stop_regex": None, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                 "repetition_penalty": 1.0, "min_new_tokens": 0, "n": 1, "json_schema": None, "regex": None,
                 "ebnf": None, "structural_tag": None, "ignore_eos": False, "logit_bias": None}
_TEXT_ONLY = ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim")  # change `text` alone


# ---- the client's side ----------------------------------------------------------------------------


def request_body(req: GenerateRequest) -> dict:
    """One /generate body for one request: its ids, its sampling parameters, its own seed."""
    return {"input_ids": list(req.prompt_ids), "return_logprob": True,
            "sampling_params": {"max_new_tokens": req.max_new_tokens, "temperature": req.temperature,
                                "top_p": req.top_p, "top_k": req.top_k if req.top_k > 0 else -1,
                                "stop_token_ids": list(req.stop_token_ids), "sampling_seed": req.seed}}


@dataclass(frozen=True)
class Answer:
    """What one /generate answer says about its request."""

    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    weight_version: str


def parse_answer(body: Any, source: str) -> Answer:
    """Read one /generate answer; anything not in SGLang's shape is BadInput naming `source` and the field."""
    def bad(field: str, expected: str, got: Any) -> BadInput:
        return BadInput(f"expected {expected}, got {str(got)[:120]}", path=source, field=field)

    meta = body.get("meta_info") if isinstance(body, dict) else None
    if not isinstance(meta, dict):
        raise bad("meta_info", "an object (an SGLang /generate answer)", body)
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list) or not all(isinstance(e, list) and len(e) >= 2 for e in entries):
        raise bad("meta_info.output_token_logprobs", "[[logprob, token_id, text], ...] (return_logprob)", entries)
    ids, logprobs = [], []
    for entry in entries:
        logprob, token = entry[0], entry[1]
        if not isinstance(token, int) or isinstance(token, bool) or not isinstance(logprob, (int, float)) \
                or isinstance(logprob, bool):
            raise bad("meta_info.output_token_logprobs", "[logprob: number, token_id: int, ...] entries", entry)
        ids.append(token)
        logprobs.append(float(logprob))
    if "output_ids" in body and body["output_ids"] != ids:
        raise bad("output_ids", f"the ids of meta_info.output_token_logprobs ({ids[:8]}...)", body["output_ids"])
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else None
    if kind not in ("stop", "length", "abort"):
        raise bad("meta_info.finish_reason", '{"type": "stop" | "length" | "abort", ...}', finish)
    return Answer(tuple(ids), tuple(logprobs), kind, str(meta.get("weight_version")))


# ---- the server's side ----------------------------------------------------------------------------


class RequestError(Exception):
    """A /generate body the server refuses: the HTTP status and SGLang's JSON answer for it."""

    def __init__(self, body: dict, status: int = 400):
        super().__init__(str(body))
        self.status, self.body = status, body


def envelope_error(message: str) -> RequestError:
    """FastAPI's request-validation answer, as SGLang rewrites it (400, not 422)."""
    return RequestError({"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400})


def schema_error(message: str) -> RequestError:
    return RequestError({"error": message})


def value_error(message: str) -> RequestError:
    return RequestError({"error": {"message": message}})


def _kind(value: Any) -> str:
    """A JSON value's kind as SGLang's schema gate names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{str(value).lower()}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f"string {value[:40]!r}"
    return "a sequence" if isinstance(value, list) else "a map"


def _int(value: Any, field: str, expected: str = "i64") -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise schema_error(f"invalid type: {_kind(value)}, expected {expected} at `{field}`")
    return value


def _number(value: Any, field: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise schema_error(f"invalid type: {_kind(value)}, expected f32 at `{field}`")
    return float(value)


def _bool(value: Any, field: str) -> bool:
    if not isinstance(value, bool):
        raise schema_error(f"invalid type: {_kind(value)}, expected a boolean at `{field}`")
    return value


@dataclass(frozen=True)
class Sampling:
    """One item's sampling parameters, checked; `greedy` follows SGLang (temperature below 1e-6)."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_token_ids: tuple[int, ...]
    seed: int
    skip_special_tokens: bool


def parse_sampling(params: Any, vocab: int, field: str = "sampling_params") -> Sampling:
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise schema_error(f"invalid type: {_kind(params)}, expected struct SamplingParams at `{field}`")
    unknown = [k for k in params if k not in _SAMPLING_FIELDS]
    if unknown:
        raise schema_error(f"unknown field `{unknown[0]}`, expected one of "
                           + ", ".join(f"`{k}`" for k in _SAMPLING_FIELDS))
    for key, default in _DEFAULT_ONLY.items():
        value = params.get(key)
        if not (value is None or value == default or (default is None and value in ("", [], {}))):
            raise value_error(f"rlbench serve does not implement {key} (got {str(params[key])[:60]}); "
                              f"leave it at {default!r}")
    get = params.get
    max_new = 128 if get("max_new_tokens") is None else _int(get("max_new_tokens"), f"{field}.max_new_tokens")
    temperature = 1.0 if get("temperature") is None else _number(get("temperature"), f"{field}.temperature")
    top_p = 1.0 if get("top_p") is None else _number(get("top_p"), f"{field}.top_p")
    top_k = -1 if get("top_k") is None else _int(get("top_k"), f"{field}.top_k")
    seed = DEFAULT_SEED if get("sampling_seed") is None else _int(get("sampling_seed"), f"{field}.sampling_seed",
                                                                   "u64")
    stops = get("stop_token_ids") or []
    if not isinstance(stops, list):
        raise schema_error(f"invalid type: {_kind(stops)}, expected a sequence at `{field}.stop_token_ids`")
    stops = tuple(sorted({_int(t, f"{field}.stop_token_ids") for t in stops}))
    for key in _TEXT_ONLY:
        if get(key) is not None:
            _bool(get(key), f"{field}.{key}")
    if get("custom_params") is not None and not isinstance(get("custom_params"), dict):
        raise schema_error(f"invalid type: {_kind(get('custom_params'))}, expected a map at `{field}.custom_params`")
    if not math.isfinite(temperature) or temperature < 0:
        raise value_error(f"temperature must be a non-negative finite number, got {temperature}.")
    if not (0.0 < top_p <= 1.0):
        raise value_error(f"top_p must be in (0, 1], got {top_p}.")
    if top_k < 1 and top_k != -1:
        raise value_error(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    if max_new < 0:
        raise value_error(f"max_new_tokens must be at least 0, got {max_new}.")
    if not 0 <= seed <= SEED_MAX:
        raise value_error(f"sampling_seed must be in [0, 2**63 - 1], got {seed}.")
    if any(not 0 <= t < vocab for t in stops):
        raise value_error(f"stop_token_ids must be in [0, {vocab - 1}], got {list(stops)[:8]}.")
    greedy = temperature < SAMPLING_EPS
    skip = True if get("skip_special_tokens") is None else get("skip_special_tokens")
    return Sampling(max_new, 0.0 if greedy else temperature, top_p, top_k, stops, seed, skip)


@dataclass(frozen=True)
class GenerateCall:
    """A checked /generate body: one item per request, and whether it came as a batch (a list answer)."""

    requests: list[GenerateRequest]
    rids: list[str]
    batched: bool
    return_logprob: bool
    return_text_in_logprobs: bool
    skip_special_tokens: list[bool]


def parse_generate(body: Any, vocab: int, context_len: int, encode: Callable[[str], list[int]],
                   new_rid: Callable[[], str]) -> GenerateCall:
    """A /generate body as engine requests, or RequestError with SGLang's answer. `encode` tokenises
    `text`; `context_len` bounds prompt + max_new_tokens (the model's positions)."""
    if not isinstance(body, dict):
        raise envelope_error(f"Input should be a valid dictionary or object to extract fields from, got {_kind(body)}")
    given = [k for k in ("text", "input_ids", "input_embeds") if body.get(k) is not None]
    if len(given) != 1:
        raise value_error("Either text, input_ids or input_embeds should be provided." if not given else
                          f"Only one of text, input_ids or input_embeds may be provided, got {', '.join(given)}.")
    if given[0] == "input_embeds":
        raise value_error("rlbench serve does not implement input_embeds; send input_ids or text.")
    for key, default in (("stream", False), ("top_logprobs_num", 0), ("token_ids_logprob", None)):
        if body.get(key) not in (default, None):
            raise value_error(f"rlbench serve does not implement {key} (got {str(body[key])[:60]}).")
    prompts, batched = _prompts(body, given[0], encode)
    if not prompts:
        raise value_error(f"{given[0]} is an empty batch.")
    if len(prompts) > MAX_BATCH:
        raise value_error(f"a batch holds at most {MAX_BATCH} items, got {len(prompts)}.")
    params = body.get("sampling_params")
    if isinstance(params, list):
        if not batched or len(params) != len(prompts):
            raise value_error(f"sampling_params is a list of {len(params)}; it must have one object per batch item "
                              f"({len(prompts)}).")
        sampling = [parse_sampling(p, vocab, f"sampling_params[{i}]") for i, p in enumerate(params)]
    else:
        sampling = [parse_sampling(params, vocab)] * len(prompts)
    requests = []
    for i, (ids, s) in enumerate(zip(prompts, sampling)):
        if not ids:
            raise value_error(f"{given[0]}{f'[{i}]' if batched else ''} is empty: a prompt needs at least one token.")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise value_error(f"The input_ids {bad[:4]} are outside the vocabulary [0, {vocab - 1}].")
        if len(ids) + s.max_new_tokens > context_len:
            raise value_error(f"Requested token count exceeds the model's maximum context length of {context_len} "
                              f"tokens. You requested a total of {len(ids) + s.max_new_tokens} tokens: {len(ids)} "
                              f"tokens from the input and {s.max_new_tokens} tokens for the completion.")
        requests.append(GenerateRequest(tuple(ids), s.seed, s.max_new_tokens, s.temperature, s.stop_token_ids,
                                        s.top_k, s.top_p))
    return GenerateCall(requests, _rids(body.get("rid"), len(prompts), batched, new_rid), batched,
                        _bool(body.get("return_logprob", False) or False, "return_logprob"),
                        _bool(body.get("return_text_in_logprobs", False) or False, "return_text_in_logprobs"),
                        [s.skip_special_tokens for s in sampling])


def _prompts(body: dict, key: str, encode: Callable[[str], list[int]]) -> tuple[list[list[int]], bool]:
    value = body[key]
    if key == "text":
        if isinstance(value, str):
            return [encode(value)], False
        if isinstance(value, list) and all(isinstance(v, str) for v in value):
            return [encode(v) for v in value], True
        raise schema_error(f"invalid type: {_kind(value)}, expected a string or a sequence of strings at `text`")
    if not isinstance(value, list):
        raise schema_error(f"invalid type: {_kind(value)}, expected a sequence at `input_ids`")
    if value and all(isinstance(v, list) for v in value):
        return [[_int(t, f"input_ids[{i}]") for t in v] for i, v in enumerate(value)], True
    return [[_int(t, "input_ids") for t in value]], False


def _rids(rid: Any, count: int, batched: bool, new_rid: Callable[[], str]) -> list[str]:
    if rid is None:
        return [new_rid() for _ in range(count)]
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(count)] if batched else [rid]
    if not isinstance(rid, list) or not all(isinstance(r, str) for r in rid):
        raise schema_error(f"invalid type: {_kind(rid)}, expected a string or a sequence of strings at `rid`")
    if len(rid) != count:
        raise value_error(f"The rid list has {len(rid)} items; the batch has {count}.")
    if len(set(rid)) != len(rid):
        raise value_error("Duplicate request IDs detected within the request.")
    return list(rid)


def finish_reason(output_ids: tuple[int, ...], reason: str, stops: tuple[int, ...]) -> dict:
    """SGLang's finish_reason object (srt/managers/schedule_batch.py)."""
    if reason == "stop":
        return {"type": "stop", "matched": output_ids[-1] if output_ids and output_ids[-1] in stops else None}
    if reason == "length":
        return {"type": "length", "length": len(output_ids)}
    return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
