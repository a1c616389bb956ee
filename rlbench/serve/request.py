"""What `rlbench serve` accepts on /generate, checked in SGLang 0.5.23's order, each refusal in the
shape of the layer that refuses it there (srt/entrypoints/http_server.py): the pydantic envelope and the API
contract gate (request_gates.py), then here the third:

3. The tokenizer manager and the scheduler (normalize_batch_and_arguments, the context-length checks,
   SamplingParams.verify with logit_bias's ids, token_ids_logprob's, the prompt and logprob_start_len
   checks): `value` (400 `{"error": {"message"}}`). What rlbench serve cannot do is refused here too, by
   name, never ignored.

The result, a `GenerateCall`, holds one `Item` per engine request (n > 1 expands an item n times).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlbench.core.types import GenerateRequest
from rlbench.serve.request_gates import (
    I64,
    MAX_BATCH,
    MAX_STOP_COUNT,
    SAMPLING_EPS,
    TOP_K_ALL,
    UNSUPPORTED_FIELDS,
    UNSUPPORTED_SAMPLING,
    check_contract,
    check_envelope,
    value,
)

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
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), added to the logits before each choice


@dataclass
class Item:
    """One engine request of a /generate call, and what its answer needs."""

    rid: str
    prompt_ids: tuple[int, ...]
    sampling: Sampling
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    probe: tuple[int, ...] = ()  # token_ids_logprob: ids whose log-probs each position reports
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


def _sampling(params: dict, vocab: int) -> Sampling:
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
            raise value(
                f"rlbench serve does not implement sampling_params.{key} (got {str(get(key))[:60]}); "
                f"leave it at {default!r} (docs/sglang-ray.md, what rlbench serve refuses)"
            )
    stops = tuple(sorted({int(t) for t in (get("stop_token_ids") or [])}))  # one outside the vocabulary never matches
    n = 1 if get("n") is None else get("n")
    interval = 1 if get("stream_interval") is None else get("stream_interval")
    if interval < 1:
        raise value(f"stream_interval must be at least 1, got {interval}.")

    def flag(key: str, default: bool) -> bool:
        return default if get(key) is None else bool(get(key))

    return Sampling(
        max_new,
        0.0 if greedy else temperature,
        top_p,
        top_k,
        seed,
        stops,
        stop,
        flag("ignore_eos", False),
        flag("skip_special_tokens", True),
        flag("spaces_between_special_tokens", True),
        flag("no_stop_trim", False),
        n,
        interval,
        _logit_bias(get("logit_bias") or {}, vocab),
    )


def _logit_bias(bias: dict, vocab: int) -> tuple[tuple[int, float], ...]:
    """SamplingParams.verify's check of logit_bias (its keys are token ids as strings, int() of them in the
    vocabulary; "1" and "01" are one id, the last given wins, as in SamplingBatchInfo)."""
    ids = {}
    for key, bias_value in bias.items():
        try:
            token = int(key)
        except ValueError as exc:
            raise value(str(exc)) from None
        if not 0 <= token < vocab:
            raise value(f"logit_bias must has keys in [0, {vocab - 1}], got {key}.")
        ids[token] = float(bias_value)
    return tuple(ids.items())


def _probes(body: dict, count: int, n: int, batched: bool, vocab: int) -> list[tuple[int, ...]]:
    """token_ids_logprob per prompt, as normalize_batch_and_arguments splits it (one flat list for every
    item, or one list per item) and _validate_token_ids_logprob checks each."""
    probe = body.get("token_ids_logprob") or None
    if probe is None:
        return [()] * count
    if isinstance(probe[0], list):
        if n > 1:
            raise value("Cannot use list token_ids_logprob with parallel_sample_num > 1")
        if not batched:
            raise value("token_ids_logprob must be a flat list of integers.")
        if len(probe) != count:
            raise value(f"token_ids_logprob holds {len(probe)} lists; give one per batch item ({count}).")
        rows = probe
    else:
        rows = [probe] * count
    for row in rows:
        for token in row:
            if not isinstance(token, int) or isinstance(token, bool):
                raise value("token_ids_logprob must be a flat list of integers.")
            if not 0 <= token < vocab:
                raise value(
                    f"token_ids_logprob contains out-of-vocabulary token id {token}; valid range is [0, {vocab})."
                )
    return [tuple(row) for row in rows]


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


def parse_generate(
    body: Any, vocab: int, encode: Callable[[str], list[int]], new_rid: Callable[[], str] = lambda: uuid.uuid4().hex
) -> GenerateCall:
    """A parsed JSON /generate body through SGLang's three gates, or RequestError with the answer of the
    gate that refuses it. The context length is checked later (`limit_items`), per item, as SGLang does."""
    body = check_envelope(body)
    check_contract(body)
    if body.get("input_embeds") is not None and body.get("text") is not None and body.get("input_ids") is not None:
        raise value("Either text, input_ids or input_embeds should be provided.")
    for key, default in UNSUPPORTED_FIELDS.items():
        if body.get(key) not in (None, default, [], {}):
            raise value(
                f"rlbench serve does not implement {key} (got {str(body[key])[:60]}) (docs/sglang-ray.md, "
                "what rlbench serve refuses)"
            )
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
    probes = _probes(body, len(prompts), n, batched, vocab)
    items = []
    for i, ids in enumerate(prompts):
        if not ids:
            raise value(f"{source}{f'[{i}]' if batched else ''} is empty: a prompt needs at least one token.")
        outside = [t for t in ids if not 0 <= t < vocab]
        if outside:
            raise value(f"The input_ids {outside[:4]} are outside the vocabulary [0, {vocab - 1}].")
        sampling = _sampling(params_of(i) or {}, vocab)
        for copy in range(n):
            items.append(
                Item(
                    rids[i * n + copy] if n > 1 else rids[i],
                    tuple(ids),
                    sampling,
                    bool(_pick(body.get("return_logprob"), i, False)),
                    int(_pick(body.get("logprob_start_len"), i, -1)),
                    int(_pick(body.get("top_logprobs_num"), i, 0)),
                    probes[i],
                )
            )
    for index, item in enumerate(items):
        item.index = index
    return GenerateCall(
        items,
        batched or n > 1,
        bool(body.get("stream", False)),
        bool(body.get("return_text_in_logprobs", False)),
        {"return_prompt_token_ids": bool(body.get("return_prompt_token_ids", False))},
    )


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
            raise value(
                f"The input ({length} tokens) is longer than the model's context length ({context_len} tokens)."
            )
        wanted = sampling.max_new_tokens
        if wanted is not None and wanted + length > context_len:
            raise value(
                f"Requested token count exceeds the model's maximum context length of {context_len} tokens. "
                f"You requested a total of {wanted + length} tokens: {length} tokens from the input messages "
                f"and {wanted} tokens for the completion. Please reduce the number of tokens in the input "
                "messages or the completion to fit within the limit."
            )
        if length >= max_input:
            raise value(
                f"Input length ({length} tokens) exceeds the maximum allowed length ({max_input} tokens). "
                "Use a shorter input or enable --allow-auto-truncate."
            )
        start = item.logprob_start_len if item.return_logprob else -1
        if start < -1:
            raise value(f"logprob_start_len must be -1 (output tokens only) or a prompt position, got {start}.")
        if start > length:
            raise value(
                f"req.logprob_start_len={start} is higher than the number of input tokens "
                f"len(req.origin_input_ids)={length}. Please use a smaller logprob_start_len."
            )
        max_new = max(0, min(TOP_K_ALL if wanted is None else wanted, max_req_len - length - 1))
        stops = () if sampling.ignore_eos else tuple(sorted(set(sampling.stop_token_ids) | set(eos)))
        top_k = -1 if sampling.top_k >= TOP_K_ALL else sampling.top_k  # every token: the engine's -1
        seed = default_seed if sampling.seed is None else sampling.seed
        item.request = GenerateRequest(
            item.prompt_ids, seed, max_new, sampling.temperature, stops, top_k, sampling.top_p
        )
