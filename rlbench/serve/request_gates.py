"""The first two of `rlbench serve`'s checks of a /generate body (request.py has the third and the result),
in SGLang 0.5.23's order, each refusal in the shape of the layer that refuses it there
(srt/entrypoints/http_server.py):

1. FastAPI parses the body into GenerateReqInput (srt/managers/io_struct.py), pydantic in lax mode
   ("3" is an int, "yes" a bool): `envelope` (400 `{"object": "error", "message", "type": "Bad
   Request", "param": null, "code": 400}`). A body that is not JSON, not sent as application/json,
   or not an object is refused here.
2. The API contract gate (sglang/api/v1/api_types.py, GenerateRequest.from_json_value): strict JSON
   types, serde's texts, unknown sampling fields refused, unknown top-level fields ignored: `contract`
   (400 `{"error": "<text>"}`).

Also the error shapes every stage answers with (`RequestError`, `value` for the third's `{"error": {"message"}}`)
and SGLang's limits and field lists the stages share.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

SAMPLING_EPS = 1e-6  # SGLang: a temperature below this is greedy
TOP_K_ALL = 1 << 30  # SGLang's top_k for "every token"
MAX_STOP_COUNT = 32  # SGLang: at most this many stop strings
MAX_BATCH = 4096  # items of one /generate (after n): more is refused, not queued (rlbench's bound)
I64 = (-(2**63), 2**63 - 1)

SAMPLING_FIELDS = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
    "custom_params",
    "beam_width",
    "watermark",
    "choice",
)
# Sampling fields the embedded engine does not implement: accepted at SGLang's default (or its "unset") only.
UNSUPPORTED_SAMPLING = {
    "stop_regex": None,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "beam_width": None,
    "watermark": None,
    "choice": None,
}
# Top-level fields rlbench serve does not implement: accepted at their default (or null) only.
UNSUPPORTED_FIELDS = {
    "input_embeds": None,
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "return_hidden_states": False,
    "return_routed_experts": False,
    "return_indexer_topk": False,
    "lora_path": None,
    "session_params": None,
    "session_id": None,
    "custom_logit_processor": None,
    "return_sampling_mask": None,
    "bootstrap_host": None,
    "max_thinking_tokens": None,
    "return_flat_raw_top_logprobs": False,
    "return_flat_raw_output_top_logprobs": False,
    "positional_embed_overrides": None,
}


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
    return RequestError(
        {"object": "error", "message": message, "type": str(status), "param": None, "code": status}, status
    )


def pydantic_error(loc: str, kind: str, msg: str, got: Any) -> RequestError:
    """One pydantic error in FastAPI's text, as SGLang's handler joins it."""
    error = {"type": kind, "loc": ("body", *loc.split(".")) if loc else ("body",), "msg": msg, "input": _cut(got)}
    return _validation(error, "POST /generate")


def json_invalid(position: int, why: str, route: str) -> RequestError:
    """A body orjson cannot parse (SGLang 0.5.23's ORJSONRequest: a UTF-8 byte-order mark, NaN, Infinity, bad
    UTF-8, broken JSON), as FastAPI reports it on any route that takes a body: `json_invalid` at the offset."""
    error = {
        "type": "json_invalid",
        "loc": ("body", position),
        "msg": "JSON decode error",
        "input": {},
        "ctx": {"error": why},
    }
    return _validation(error, route)


def _validation(error: dict, route: str) -> RequestError:
    return envelope(f"1 validation error:\n  {error}\n\n  Endpoint: {route} [{error}]")


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
    "sampling_params": _optional(
        lambda x: isinstance(x, dict) or (isinstance(x, list) and all(isinstance(e, dict) for e in x))
    ),
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
        raise pydantic_error(
            "", "dataclass_type", "Input should be a dictionary or an instance of GenerateReqInput", body
        )
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
    "max_new_tokens": _int,
    "stop": _or_list("StringOrList", _str),
    "stop_token_ids": lambda v: _seq(v, _int),
    "stop_regex": _or_list("StringOrList", _str),
    "temperature": _number,
    "top_p": _number,
    "top_k": _int,
    "min_p": _number,
    "frequency_penalty": _number,
    "presence_penalty": _number,
    "repetition_penalty": _number,
    "min_new_tokens": _int,
    "n": _int,
    "json_schema": _str,
    "regex": _str,
    "ebnf": _str,
    "structural_tag": _str,
    "ignore_eos": _bool,
    "skip_special_tokens": _bool,
    "spaces_between_special_tokens": _bool,
    "no_stop_trim": _bool,
    "stream_interval": _int,
    "sampling_seed": _int,
    "beam_width": _int,
    "logit_bias": lambda v: (_expect(isinstance(v, dict), v, "a map"), [_number(e) for e in v.values()]),
    "custom_params": lambda v: None,
    "watermark": lambda v: _expect(isinstance(v, dict), v, "struct WatermarkRequestConfig"),
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
    "rid": _or_list("StringOrList", _str),
    "text": _or_list("StringOrList", _str),
    "input_ids": _token_ids_or_list,
    "stream": _bool,
    "return_logprob": _or_list("BoolOrList", _bool),
    "logprob_start_len": _or_list("Int64OrList", _int),
    "top_logprobs_num": _or_list("Int64OrList", _int),
    "token_ids_logprob": _token_ids_or_list,
    "return_hidden_states": _or_list("BoolOrList", _bool),
    "return_text_in_logprobs": _bool,
    "routed_dp_rank": _int,
    "priority": _int,
    "session_id": _str,
    "routing_key": _str,
    "extra_key": _or_list("StringOrList", _str),
    "cache_salt": _or_list("StringOrList", _str),
    "lora_path": _or_list("OptionalStringOrList", _optional_each(_str)),
    "custom_logit_processor": _or_list("OptionalStringOrList", _optional_each(_str)),
    "require_reasoning": _bool,
    "return_sampling_mask": _or_list("BoolOrList", _bool),
    "sampling_params": lambda v: (
        _seq(v, _contract_sampling)
        if isinstance(v, list)
        else _contract_sampling(v, "a value or an array of values for SamplingParamsOrList")
    ),
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
