"""What `rlbench serve` accepts on /generate, checked in SGLang 0.5.23's order, each refusal in the
shape of the layer that refuses it there (srt/entrypoints/http_server.py):

1. FastAPI parses the body into GenerateReqInput (srt/managers/io_struct.py), pydantic in lax mode
   ("3" is an int, "yes" a bool): `envelope` (400 `{"object": "error", "message", "type": "Bad
   Request", "param": null, "code": 400}`). A body that is not JSON, not sent as application/json,
   or not an object is refused here.
2. The API contract gate (sglang/api/v1/api_types.py, GenerateRequest.from_json_value): strict JSON
   types, serde's texts, unknown sampling fields refused, unknown top-level fields ignored: `contract`
   (400 `{"error": "<text>"}`).
3. The tokenizer manager and the scheduler (normalize_batch_and_arguments, the context-length checks,
   SamplingParams.verify, the prompt and logprob_start_len checks): `value` (400 `{"error":
   {"message"}}`). What rlbench serve cannot do is refused here too, by name, never ignored.

The result, a `GenerateCall`, holds one `Item` per engine request (n > 1 expands an item n times).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlbench.core.types import GenerateRequest

SAMPLING_EPS = 1e-6  # SGLang: a temperature below this is greedy
TOP_K_ALL = 1 << 30  # SGLang's top_k for "every token"
MAX_STOP_COUNT = 32  # SGLang: at most this many stop strings
MAX_BATCH = 4096  # items of one /generate (after n): more is refused, not queued (rlbench's bound)
I64 = (-(2**63), 2**63 - 1)

SAMPLING_FIELDS = ("max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
                   "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
                   "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
                   "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
                   "custom_params", "beam_width", "watermark", "choice")
# Sampling fields the embedded engine does not implement: accepted at SGLang's default (or its "unset") only.
UNSUPPORTED_SAMPLING = {"stop_regex": None, "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                        "repetition_penalty": 1.0, "min_new_tokens": 0, "json_schema": None, "regex": None,
                        "ebnf": None, "structural_tag": None, "logit_bias": None, "beam_width": None,
                        "watermark": None, "choice": None}
# Top-level fields rlbench serve does not implement: accepted at their default (or null) only.
UNSUPPORTED_FIELDS = {"input_embeds": None, "image_data": None, "video_data": None, "audio_data": None,
                      "token_ids_logprob": None, "return_hidden_states": False, "return_routed_experts": False,
                      "return_indexer_topk": False, "lora_path": None, "session_params": None, "session_id": None,
                      "custom_logit_processor": None, "return_sampling_mask": None, "bootstrap_host": None,
                      "max_thinking_tokens": None, "return_flat_raw_top_logprobs": False,
                      "return_flat_raw_output_top_logprobs": False, "positional_embed_overrides": None}


class RequestError(Exception):
    """A request the server refuses: the HTTP status and SGLang's JSON answer for it."""

    def __init__(self, body: dict, status: int = 400):
        super().__init__(str(body))
        self.status, self.body = status, body


def envelope(message: str) -> RequestError:
    """FastAPI's request-validation answer, as SGLang rewrites it (400, not 422)."""
    return RequestError({"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400})


def contract(message: str) -> RequestError:
    return RequestError({"error": message})


def value(message: str, status: int = 400) -> RequestError:
    return RequestError({"error": {"message": message}}, status)


def http_error(status: int, message: str) -> RequestError:
    """An HTTPException as SGLang answers it (`type` is the status as text)."""
    return RequestError({"object": "error", "message": message, "type": str(status), "param": None, "code": status},
                        status)


def pydantic_error(loc: str, kind: str, msg: str, got: Any) -> RequestError:
    """One pydantic error in FastAPI's text, as SGLang's handler joins it."""
    error = {"type": kind, "loc": ("body", *loc.split(".")) if loc else ("body",), "msg": msg, "input": _cut(got)}
    return envelope(f"1 validation error:\n  {error}\n\n  Endpoint: POST /generate [{error}]")


def _cut(got: Any) -> Any:
    text = repr(got)
    return got if len(text) <= 200 else text[:200] + "..."


# ---- 1. the pydantic envelope (lax) ----------------------------------------------------------------

_TRUE = {"1", "on", "t", "true", "y", "yes"}
_FALSE = {"0", "off", "f", "false", "n", "no"}


def _lax_bool(x: Any) -> bool:
    if isinstance(x, bool):
        return True
    if isinstance(x, (int, float)):
        return x in (0, 1)
    return isinstance(x, str) and x.strip().lower() in _TRUE | _FALSE


def _lax_int(x: Any) -> bool:
    if isinstance(x, (bool, int)):
        return True
    if isinstance(x, float):
        return math.isfinite(x) and x == int(x)
    if isinstance(x, str):
        try:
            int(x.strip())
        except ValueError:
            return False
        return True
    return False


def _lax_float(x: Any) -> bool:
    if isinstance(x, (bool, int, float)):
        return True
    if isinstance(x, str):
        try:
            float(x.strip())
        except ValueError:
            return False
        return True
    return False


def _one_or_list(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda x: check(x) or (isinstance(x, list) and all(check(e) for e in x))


def _optional(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda x: x is None or check(x)


def _is_str(x: Any) -> bool:
    return isinstance(x, str)


def _i64(x: Any) -> bool:
    return isinstance(x, int) and I64[0] <= x <= I64[1]


def _token_rows(x: Any) -> str | None:
    """SGLang's input_ids validator (validate_optional_list_i64_1d_2d): why it refuses `x`, or None."""
    if x is None or x == []:
        return None
    if not isinstance(x, list):
        return f"must be list or null; got {type(x).__name__}"
    rows = x if isinstance(x[0], list) else [x] if isinstance(x[0], int) else None
    if rows is None:
        return f"elements must be int or list; got {type(x[0]).__name__}"
    for i, row in enumerate(rows):
        if not isinstance(row, list):
            return f"row {i}: must be list; got {type(row).__name__}"
        if row and not isinstance(row[0], int):
            return f"row {i}: elements must be int; got {type(row[0]).__name__}"
        if not all(isinstance(t, int) and I64[0] <= t <= I64[1] for t in row):
            return f"row {i}: contains non-int64 element"
    return None


_ENVELOPE: dict[str, Callable[[Any], bool]] = {
    "rid": _optional(_one_or_list(_is_str)),
    "text": _optional(_one_or_list(_is_str)),
    "sampling_params": _optional(lambda x: isinstance(x, dict) or (isinstance(x, list) and all(
        isinstance(e, dict) for e in x))),
    "return_logprob": _optional(_one_or_list(_lax_bool)),
    "logprob_start_len": _optional(_one_or_list(_lax_int)),
    "top_logprobs_num": _optional(_one_or_list(_lax_int)),
    "return_text_in_logprobs": _lax_bool,
    "stream": _lax_bool,
    "log_metrics": _lax_bool,
    "return_routed_experts": _lax_bool,
    "return_prompt_token_ids": _lax_bool,
    "routed_experts_start_len": _lax_int,
    "priority": _optional(_lax_int),
    "routed_dp_rank": _optional(_lax_int),
    "session_id": _optional(_is_str),
    "routing_key": _optional(_is_str),
    "input_embeds": _optional(lambda x: isinstance(x, list)),
}


def check_envelope(body: Any) -> dict:
    """The body as pydantic would take it into GenerateReqInput, or its 400 (envelope)."""
    if not isinstance(body, dict):
        raise pydantic_error("", "dataclass_type", "Input should be a dictionary or an instance of GenerateReqInput",
                             body)
    for key, ok in _ENVELOPE.items():
        if key in body and not ok(body[key]):
            raise pydantic_error(key, "type_error", f"Input is not a valid {key}", body[key])
    if "input_ids" in body and (why := _token_rows(body["input_ids"])) is not None:
        raise pydantic_error("input_ids", "value_error", f"Value error, {why}", body["input_ids"])
    return body


# ---- 2. the API contract gate (strict, serde's texts) ----------------------------------------------


def _unexpected(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v[:100]}"'
    return "sequence" if isinstance(v, list) else "map"


def _expect(ok: bool, v: Any, expected: str) -> None:
    if not ok:
        raise contract(f"invalid type: {_unexpected(v)}, expected {expected}")


def _int(v: Any, expected: str = "i64") -> None:
    _expect(isinstance(v, int) and not isinstance(v, bool), v, expected)


def _number(v: Any, expected: str = "f64") -> None:
    _expect(isinstance(v, (int, float)) and not isinstance(v, bool), v, expected)


def _bool(v: Any, expected: str = "a boolean") -> None:
    _expect(isinstance(v, bool), v, expected)


def _str(v: Any, expected: str = "a string") -> None:
    _expect(isinstance(v, str), v, expected)


def _seq(v: Any, each: Callable[[Any], None]) -> None:
    _expect(isinstance(v, list), v, "a sequence")
    for e in v:
        each(e)


def _or_list(kind: str, each: Callable[..., None]) -> Callable[[Any], None]:
    def check(v: Any) -> None:
        if isinstance(v, list):
            _seq(v, each)
        else:
            each(v, f"a value or an array of values for {kind}")
    return check


def _token_ids_or_list(v: Any) -> None:
    if not isinstance(v, list):
        raise contract(f"invalid type: {_unexpected(v)}, expected a value or an array of values for TokenIdsOrList")
    if not v or (isinstance(v[0], (int, float)) and not isinstance(v[0], bool)):
        _seq(v, _int)
    else:
        _seq(v, lambda row: _seq(row, _int))


def _optional_each(each: Callable[..., None]) -> Callable[..., None]:
    return lambda v, *expected: None if v is None else each(v, *expected)


_CONTRACT_SAMPLING: dict[str, Callable[[Any], None]] = {
    "max_new_tokens": _int, "stop": _or_list("StringOrList", _str), "stop_token_ids": lambda v: _seq(v, _int),
    "stop_regex": _or_list("StringOrList", _str), "temperature": _number, "top_p": _number, "top_k": _int,
    "min_p": _number, "frequency_penalty": _number, "presence_penalty": _number, "repetition_penalty": _number,
    "min_new_tokens": _int, "n": _int, "json_schema": _str, "regex": _str, "ebnf": _str, "structural_tag": _str,
    "ignore_eos": _bool, "skip_special_tokens": _bool, "spaces_between_special_tokens": _bool,
    "no_stop_trim": _bool, "stream_interval": _int, "sampling_seed": _int, "beam_width": _int,
    "logit_bias": lambda v: (_expect(isinstance(v, dict), v, "a map"), [_number(e) for e in v.values()]),
    "custom_params": lambda v: None, "watermark": lambda v: _expect(isinstance(v, dict), v,
                                                                    "struct WatermarkRequestConfig"),
    "choice": lambda v: _seq(v, _str),
}


def _contract_sampling(v: Any, expected: str = "struct SamplingParams") -> None:
    _expect(isinstance(v, dict), v, expected)
    for key, x in v.items():
        check = _CONTRACT_SAMPLING.get(key)
        if check is None:
            raise contract(f"unknown field `{key}`, expected one of " + ", ".join(f"`{f}`" for f in SAMPLING_FIELDS))
        if x is not None:
            check(x)


_CONTRACT: dict[str, Callable[[Any], None]] = {
    "rid": _or_list("StringOrList", _str), "text": _or_list("StringOrList", _str), "input_ids": _token_ids_or_list,
    "stream": _bool, "return_logprob": _or_list("BoolOrList", _bool),
    "logprob_start_len": _or_list("Int64OrList", _int), "top_logprobs_num": _or_list("Int64OrList", _int),
    "token_ids_logprob": _token_ids_or_list, "return_hidden_states": _or_list("BoolOrList", _bool),
    "return_text_in_logprobs": _bool, "routed_dp_rank": _int, "priority": _int, "session_id": _str,
    "routing_key": _str, "extra_key": _or_list("StringOrList", _str), "cache_salt": _or_list("StringOrList", _str),
    "lora_path": _or_list("OptionalStringOrList", _optional_each(_str)),
    "custom_logit_processor": _or_list("OptionalStringOrList", _optional_each(_str)),
    "require_reasoning": _bool, "return_sampling_mask": _or_list("BoolOrList", _bool),
    "sampling_params": lambda v: _seq(v, _contract_sampling) if isinstance(v, list) else _contract_sampling(
        v, "a value or an array of values for SamplingParamsOrList"),
}


def check_contract(body: dict) -> None:
    """SGLang's contract gate over a body the envelope took: strict JSON types (serde's texts)."""
    for key, x in body.items():
        if key in ("return_prompt_token_ids",):
            _bool(x)
        elif key == "routed_experts_start_len":
            _int(x)
        elif key == "max_thinking_tokens" and x is not None:
            _int(x, "u64")
            if x < 0:
                raise contract(f"invalid value: integer `{x}`, expected u64")
        elif key in _CONTRACT and x is not None:
            _CONTRACT[key](x)


# ---- 3. normalisation and values (ValueError: {"error": {"message"}}) --------------------------------


@dataclass(frozen=True)
class Sampling:
    """One item's sampling parameters as SGLang's SamplingParams holds them after __post_init__."""

    max_new_tokens: int | None
    temperature: float  # 0.0: greedy (SGLang: below 1e-6)
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: tuple[int, ...]
    stop: tuple[str, ...]
    ignore_eos: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    no_stop_trim: bool
    n: int
    stream_interval: int  # tokens per stream chunk


@dataclass
class Item:
    """One engine request of a /generate call, and what its answer needs."""

    rid: str
    prompt_ids: tuple[int, ...]
    sampling: Sampling
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    request: GenerateRequest | None = None  # made once the context length is known (`finish`)
    index: int = 0


@dataclass
class GenerateCall:
    """A checked /generate body: its items (in answer order) and how it answers."""

    items: list[Item]
    batched: bool
    stream: bool
    return_text_in_logprobs: bool
    extra: dict = field(default_factory=dict)


def _sampling(params: dict) -> Sampling:
    """SamplingParams(**params) and its verify (srt/sampling/sampling_params.py), with its texts."""
    get = params.get
    temperature = 1.0 if get("temperature") is None else float(get("temperature"))
    top_p = 1.0 if get("top_p") is None else float(get("top_p"))
    top_k = TOP_K_ALL if get("top_k") is None else get("top_k")
    greedy = 0 <= temperature < SAMPLING_EPS  # SGLang: top_k 1 at temperature 1 (the engine: temperature 0)
    if greedy:
        top_k = 1
    if top_k == -1:
        top_k = TOP_K_ALL
    if not math.isfinite(temperature) or temperature < 0.0:
        raise value(f"temperature must be a non-negative finite number, got {temperature}.")
    if not 0.0 < top_p <= 1.0:
        raise value(f"top_p must be in (0, 1], got {top_p}.")
    if top_k < 1:
        raise value(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
    max_new = get("max_new_tokens", 128)
    if max_new is not None and max_new < 0:
        raise value(f"max_new_tokens must be at least 0, got {max_new}.")
    seed = get("sampling_seed")
    if seed is not None and not I64[0] <= seed <= I64[1]:
        raise value(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}.")
    stop = get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stop) > MAX_STOP_COUNT:
        raise value(f"at most {MAX_STOP_COUNT} stop strings are allowed, got {len(stop)}")
    for key, default in UNSUPPORTED_SAMPLING.items():
        if get(key) not in (None, default) and get(key) not in ("", [], {}):
            raise value(f"rlbench serve does not implement sampling_params.{key} (got {str(get(key))[:60]}); "
                        f"leave it at {default!r} (docs/sglang-ray.md, what rlbench serve refuses)")
    stops = tuple(sorted({int(t) for t in (get("stop_token_ids") or [])}))  # one outside the vocabulary never matches
    n = 1 if get("n") is None else get("n")
    interval = 1 if get("stream_interval") is None else get("stream_interval")
    if interval < 1:
        raise value(f"stream_interval must be at least 1, got {interval}.")

    def flag(key: str, default: bool) -> bool:
        return default if get(key) is None else bool(get(key))

    return Sampling(max_new, 0.0 if greedy else temperature, top_p, top_k, seed, stops, stop, flag("ignore_eos", False),
                    flag("skip_special_tokens", True), flag("spaces_between_special_tokens", True),
                    flag("no_stop_trim", False), n, interval)


def _pick(values: Any, i: int, default: Any) -> Any:
    """Item i's value of a field given for one item or as a list per item."""
    if values is None:
        return default
    if isinstance(values, list):
        return values[i] if i < len(values) else default
    return values


def _prompts(body: dict, encode: Callable[[str], list[int]]) -> tuple[list[list[int]], bool, str]:
    """normalize_batch_and_arguments' inputs: the prompts, whether a batch, and the field they came from.
    With text and input_ids both given, input_ids are what is generated from (SGLang tokenises only text
    that comes alone); the batch shape follows text, as SGLang decides it from text first."""
    text, ids = body.get("text"), body.get("input_ids")
    if text is None and ids is None:
        raise value("Either text, input_ids or input_embeds should be provided.")
    if text is not None:
        batched = not isinstance(text, str)
        if ids is None:
            return ([encode(t) for t in text] if batched else [encode(text)]), batched, "text"
    if ids == []:
        raise value("input_ids cannot be empty.")
    ids_batched = isinstance(ids[0], list)
    batched = batched if text is not None else ids_batched
    if batched != ids_batched:
        raise value("text and input_ids describe different batches; send one of them.")
    return (list(ids) if ids_batched else [ids]), batched, "input_ids"


def parse_generate(body: Any, vocab: int, encode: Callable[[str], list[int]],
                   new_rid: Callable[[], str] = lambda: uuid.uuid4().hex) -> GenerateCall:
    """A parsed JSON /generate body through SGLang's three gates, or RequestError with the answer of the
    gate that refuses it. The context length is checked later (`limit_items`), per item, as SGLang does."""
    body = check_envelope(body)
    check_contract(body)
    if body.get("input_embeds") is not None and body.get("text") is not None and body.get("input_ids") is not None:
        raise value("Either text, input_ids or input_embeds should be provided.")
    for key, default in UNSUPPORTED_FIELDS.items():
        if body.get(key) not in (None, default, [], {}):
            raise value(f"rlbench serve does not implement {key} (got {str(body[key])[:60]}) (docs/sglang-ray.md, "
                        "what rlbench serve refuses)")
    prompts, batched, source = _prompts(body, encode)
    params = body.get("sampling_params")
    params_of = (lambda i: params[i] if i < len(params) else None) if isinstance(params, list) else (lambda i: params)
    if isinstance(params, list) and (not batched or len(params) != len(prompts)):
        raise value(f"sampling_params is a list of {len(params)}; give one object per batch item ({len(prompts)}).")
    ns = {int((params_of(i) or {}).get("n") or 1) for i in range(len(prompts))}
    if len(ns) > 1:
        raise value("The parallel_sample_num should be the same for all samples in sample params.")
    n = max(ns.pop() if ns else 1, 1)
    if len(prompts) * n > MAX_BATCH:
        raise value(f"a /generate holds at most {MAX_BATCH} items (with n), got {len(prompts) * n}.")
    if n > 1:
        for key in ("return_logprob", "logprob_start_len", "top_logprobs_num"):
            if isinstance(body.get(key), list):
                raise value(f"Cannot use list {key} with parallel_sample_num > 1")
    rids = _rids(body.get("rid"), len(prompts), n, batched or n > 1, new_rid)
    items = []
    for i, ids in enumerate(prompts):
        if not ids:
            raise value(f"{source}{f'[{i}]' if batched else ''} is empty: a prompt needs at least one token.")
        outside = [t for t in ids if not 0 <= t < vocab]
        if outside:
            raise value(f"The input_ids {outside[:4]} are outside the vocabulary [0, {vocab - 1}].")
        sampling = _sampling(params_of(i) or {})
        for copy in range(n):
            items.append(Item(rids[i * n + copy] if n > 1 else rids[i], tuple(ids), sampling,
                              bool(_pick(body.get("return_logprob"), i, False)),
                              int(_pick(body.get("logprob_start_len"), i, -1)),
                              int(_pick(body.get("top_logprobs_num"), i, 0))))
    for index, item in enumerate(items):
        item.index = index
    return GenerateCall(items, batched or n > 1, bool(body.get("stream", False)),
                        bool(body.get("return_text_in_logprobs", False)),
                        {"return_prompt_token_ids": bool(body.get("return_prompt_token_ids", False))})


def _rids(rid: Any, count: int, n: int, batched: bool, new_rid: Callable[[], str]) -> list[str]:
    """SGLang's rids: a uuid each when none is given; a string rid of a batch is a prefix (rid_0, ...);
    a list gives one per prompt; with n > 1 every copy gets a fresh uuid (its own request)."""
    if n > 1:
        return [new_rid() for _ in range(count * n)]
    if rid is None:
        return [new_rid() for _ in range(count)]
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(count)] if batched else [rid]
    if not batched:
        raise value("The rid should be a string for a single request.")
    if len(rid) != count:
        raise value("The specified rids length mismatch with the batch_size for batch processing.")
    if len(set(rid)) != len(rid):
        duplicates = sorted({r for r in rid if rid.count(r) > 1})
        raise value(f"Duplicate request IDs detected within the request: {duplicates}")
    return list(rid)


def limit_items(call: GenerateCall, context_len: int, eos: tuple[int, ...], default_seed: int) -> None:
    """Each item's engine request, with SGLang's length rules for this context length: the input must be
    shorter than the context; prompt + max_new_tokens must fit it; the scheduler then clips max_new_tokens
    to context - 2 - prompt (null: that much), refuses a prompt of context - 6 tokens or more, and a
    logprob_start_len past the prompt. The model's EOS stops a request unless it sets ignore_eos (which
    disables its stop_token_ids too, as in SGLang)."""
    max_req_len = context_len - 1
    max_input = max_req_len - 5
    for item in call.items:
        length, sampling = len(item.prompt_ids), item.sampling
        if length >= context_len:
            raise value(f"The input ({length} tokens) is longer than the model's context length ({context_len} "
                        "tokens).")
        wanted = sampling.max_new_tokens
        if wanted is not None and wanted + length > context_len:
            raise value(f"Requested token count exceeds the model's maximum context length of {context_len} tokens. "
                        f"You requested a total of {wanted + length} tokens: {length} tokens from the input messages "
                        f"and {wanted} tokens for the completion. Please reduce the number of tokens in the input "
                        "messages or the completion to fit within the limit.")
        if length >= max_input:
            raise value(f"Input length ({length} tokens) exceeds the maximum allowed length ({max_input} tokens). "
                        "Use a shorter input or enable --allow-auto-truncate.")
        start = item.logprob_start_len if item.return_logprob else -1
        if start < -1:
            raise value(f"logprob_start_len must be -1 (output tokens only) or a prompt position, got {start}.")
        if start > length:
            raise value(f"req.logprob_start_len={start} is higher than the number of input tokens "
                        f"len(req.origin_input_ids)={length}. Please use a smaller logprob_start_len.")
        max_new = max(0, min(TOP_K_ALL if wanted is None else wanted, max_req_len - length - 1))
        stops = () if sampling.ignore_eos else tuple(sorted(set(sampling.stop_token_ids) | set(eos)))
        top_k = -1 if sampling.top_k >= TOP_K_ALL else sampling.top_k  # every token: the engine's -1
        seed = default_seed if sampling.seed is None else sampling.seed
        item.request = GenerateRequest(item.prompt_ids, seed, max_new, sampling.temperature, stops, top_k,
                                       sampling.top_p)
