"""SGLang's native API as the client speaks it: the /generate body it sends for one `GenerateRequest`,
how it reads and checks the answer, and how it reads /weights_checker. What `rlbench serve` accepts
is rlbench/serve/request.py. Field names and answer shapes follow SGLang 0.5.23 (srt/managers/
io_struct.py, tokenizer_manager.py, schedule_batch.py; /work/shared/sglang-api.md):

- The client sends `input_ids`, `return_logprob: true` and, in `sampling_params`, temperature, top_p,
  top_k, max_new_tokens, stop_token_ids and the request's own `sampling_seed`: only fields
  sglang-router keeps (it re-serialises the request and drops others, `seed` among them). rlbench's
  top_k 0 ("off") is sent as -1, SGLang's off (SGLang refuses 0).
- It reads the sampled ids and log-probs from `meta_info.output_token_logprobs` (as slime does) and
  holds the answer to what was asked before anything of it is kept (`parse_answer`): ids inside the
  model's vocabulary (core/vocab.py: padded ids too, as SGLang samples them) and equal to `output_ids`,
  log-probs finite and <= 0, no more tokens than asked, and a finish reason that agrees with them
  ("length": exactly max_new_tokens, none of them a stop token;
  "stop": the last token, one the request listed). An aborted answer (HTTP 200, finish type "abort",
  what SGLang sends for /abort_request, a pause or a timeout, with the partial output) is never kept.
  Either is `BadAnswer`: a failed attempt, which the engine sends again (same seed, same tokens).
  Extra meta_info keys, a null `text`, a string `matched` are SGLang's and read as such.
- Every other answer the client reads is held to its shape too (/weights_checker, /update_weights_from_disk,
  /server_info, the router's /workers): a garbled one is ValueError naming the server, the endpoint and the
  field, which the engine treats as a failed attempt, as it does a wrong /generate answer.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlbench.core.types import GenerateRequest
from rlbench.core.vocab import valid_id
from rlbench.validate import normalize_url  # noqa: F401 - the client's and the fleet's, as the server's

if TYPE_CHECKING:
    import torch

# The first line `rlbench serve` prints once it is ready; a launcher reads the URL after it.
LISTENING = "rlbench serve: listening on "


def request_body(req: GenerateRequest) -> dict:
    """One /generate body for one request: its ids, its sampling parameters, its own seed."""
    return {
        "input_ids": list(req.prompt_ids),
        "return_logprob": True,
        "sampling_params": {
            "max_new_tokens": req.max_new_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k if req.top_k > 0 else -1,
            "stop_token_ids": list(req.stop_token_ids),
            "sampling_seed": req.seed,
        },
    }


@dataclass(frozen=True)
class Answer:
    """What one /generate answer says about its request, checked against it."""

    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    weight_version: str


class BadAnswer(Exception):
    """An answer that cannot be kept (aborted, or not what was asked): a failed attempt, naming the
    server and the field. `aborted`: the server said it aborted the request."""

    def __init__(self, message: str, aborted: bool = False):
        super().__init__(message)
        self.aborted = aborted


def _show(got: Any) -> str:
    return str(got)[:120]


def parse_answer(body: Any, source: str, req: GenerateRequest, vocab: int) -> Answer:
    """Read one /generate answer and hold it to `req`; BadAnswer naming `source` and the field otherwise."""

    def bad(field: str, expected: str, got: Any) -> BadAnswer:
        return BadAnswer(f"{source}: {field}: expected {expected}, got {_show(got)}")

    meta = body.get("meta_info") if isinstance(body, dict) else None
    if not isinstance(meta, dict):
        raise bad("meta_info", "an object (an SGLang /generate answer)", body)
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else None
    if kind == "abort":
        raise BadAnswer(
            f"{source}: meta_info.finish_reason: the server aborted the request "
            f"({_show(finish.get('message'))}); its partial output is not kept",
            aborted=True,
        )
    if kind not in ("stop", "length"):
        raise bad("meta_info.finish_reason", '{"type": "stop" | "length" | "abort", ...}', finish)
    ids, logprobs = _entries(meta.get("output_token_logprobs"), vocab, bad)
    if "output_ids" in body and body["output_ids"] != list(ids):
        raise bad("output_ids", f"the ids of meta_info.output_token_logprobs ({list(ids)[:8]}...)", body["output_ids"])
    if len(ids) > req.max_new_tokens:
        raise bad(
            "meta_info.output_token_logprobs",
            f"at most max_new_tokens = {req.max_new_tokens} tokens",
            f"{len(ids)} tokens",
        )
    _agrees(finish, ids, req, bad)
    return Answer(ids, logprobs, kind, str(meta.get("weight_version")))


def _entries(entries: Any, vocab: int, bad) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """output_token_logprobs: [[logprob, token_id, text|null], ...], each id in [0, vocab), each log-prob
    finite and <= 0."""
    field = "meta_info.output_token_logprobs"
    if not isinstance(entries, list):
        raise bad(field, "[[logprob, token_id, text], ...] (return_logprob)", entries)
    ids, logprobs = [], []
    for i, entry in enumerate(entries):
        if not isinstance(entry, list) or len(entry) < 2:
            raise bad(f"{field}[{i}]", "[logprob, token_id, text]", entry)
        logprob, token = entry[0], entry[1]
        if not valid_id(token, vocab):
            raise bad(f"{field}[{i}] token id", f"an id in [0, {vocab}) (the model's vocabulary)", token)
        if (
            not isinstance(logprob, (int, float))
            or isinstance(logprob, bool)
            or not math.isfinite(logprob)
            or logprob > 0
        ):
            raise bad(f"{field}[{i}] logprob", "a finite log-probability <= 0", logprob)
        ids.append(token)
        logprobs.append(float(logprob))
    return tuple(ids), tuple(logprobs)


def _agrees(finish: dict, ids: tuple[int, ...], req: GenerateRequest, bad) -> None:
    """The finish reason agrees with the tokens and the request."""
    field = "meta_info.finish_reason"
    stops = set(req.stop_token_ids)
    early = [t for t in ids[:-1] if t in stops]
    if early:
        raise bad(field, f"no token of stop_token_ids before the last (the request stops at {early[0]})", list(ids))
    if finish["type"] == "length":
        if len(ids) != req.max_new_tokens or (ids and ids[-1] in stops):
            raise bad(
                field,
                f"length only with exactly max_new_tokens = {req.max_new_tokens} tokens, the last not a stop token",
                f"{finish} with {len(ids)} tokens",
            )
        return
    matched = finish.get("matched")
    if not ids or not isinstance(matched, int) or isinstance(matched, bool) or matched != ids[-1]:
        raise bad(field, "stop with matched = the last output token", f"{finish} after {list(ids)[-3:]}")
    if matched not in stops:
        raise bad(
            field,
            f"a stop at one of the request's stop_token_ids {sorted(stops)} (a server stopping at its "
            "own end-of-sequence token? add it to rollout.stop_token_ids)",
            finish,
        )


# ---- /weights_checker ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Checksums:
    """One server's /weights_checker "checksum" answer: tensor name -> SGLang's 16-hex-digit hash, and
    how many ranks (shards) it came from."""

    checksums: dict[str, str]
    ranks: int


def parse_checksums(body: Any, source: str) -> Checksums:
    """SGLang 0.5.23's answer: {success, message, ranks: [{checksums, per_gpu_checksum, parallelism_info}],
    per_engine_checksum}; anything else is ValueError naming `source` and the field."""

    def bad(field: str, expected: str, got: Any) -> ValueError:
        return ValueError(f"{source}: {field}: expected {expected}, got {_show(got)}")

    if not isinstance(body, dict):
        raise bad("(answer)", "an object {success, message, ranks, ...}", body)
    if body.get("success") is not True:
        raise bad("success", f"true (message: {_show(body.get('message'))})", body.get("success"))
    ranks = body.get("ranks")
    if not isinstance(ranks, list) or not ranks:
        raise bad("ranks", "a non-empty list, one object per rank", ranks)
    merged: dict[str, str] = {}
    for i, rank in enumerate(ranks):
        checksums = rank.get("checksums") if isinstance(rank, dict) else None
        if not isinstance(checksums, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in checksums.items()
        ):
            raise bad(f"ranks[{i}].checksums", "an object of tensor name -> hex string", checksums)
        merged.update(checksums)
    return Checksums(merged, len(ranks))


# ---- the other answers the client reads ------------------------------------------------------------


def parse_object(body: Any, source: str, what: str) -> dict:
    """An answer that must be a JSON object (/server_info's server arguments, say); ValueError naming `source`."""
    if not isinstance(body, dict):
        raise ValueError(f"{source}: (answer): expected {what} (a JSON object), got {_show(body)}")
    return body


def parse_update(body: Any, source: str) -> dict:
    """/update_weights_from_disk's answer, SGLang 0.5.23's {success, message, num_paused_requests}
    (http_server.py); ValueError naming `source` when it is not that shape. Whether it succeeded is the
    caller's to judge: `success: false` is the server refusing, not a garbled answer."""
    body = parse_object(body, source, "{success, message, num_paused_requests}")
    if not isinstance(body.get("success"), bool):
        raise ValueError(f"{source}: success: expected true or false, got {_show(body.get('success'))}")
    return body


def parse_workers(body: Any, source: str) -> list[dict]:
    """sglang-router's GET /workers answer, {"workers": [{"id", "url", "is_healthy", ...}], ...}: the
    workers, each an object with a string url; ValueError naming `source` and the field otherwise."""
    workers = parse_object(body, source, '{"workers": [...]}').get("workers")
    if not isinstance(workers, list):
        raise ValueError(f"{source}: workers: expected a list of workers, got {_show(workers)}")
    for i, worker in enumerate(workers):
        if not isinstance(worker, dict) or not isinstance(worker.get("url"), str):
            raise ValueError(f"{source}: workers[{i}]: expected an object with a string url, got {_show(worker)}")
    return workers


def healthy(workers: list[dict]) -> set[str]:
    """The URLs of the workers a router lists as healthy (no `is_healthy` key: healthy, as older routers say)."""
    return {w["url"] for w in workers if w.get("is_healthy", True)}


def tensor_hash(tensor: torch.Tensor) -> str:
    """SGLang's /weights_checker hash of a tensor on the CPU (srt/managers/mm_utils.py tensor_hash): the first
    8 bytes of the sha256 of its bytes, as 16 hex digits. On a GPU SGLang hashes with a kernel of its own."""
    import torch

    data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).hexdigest()[:16]
