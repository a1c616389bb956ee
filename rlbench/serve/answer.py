"""The /generate answer of `rlbench serve`, in SGLang 0.5.23's shape (srt/managers/tokenizer_manager.py
_handle_batch_output, _handle_abort_req, add_logprob_to_meta_info; detokenizer_manager.py):

    {"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens", "weight_version",
     "num_retractions", <log-prob keys>, "reasoning_tokens", "completion_tokens", "cached_tokens",
     "weight_versions", "e2e_latency"}}

- finish_reason: {"type": "stop", "matched": token id | stop string}, {"type": "length", "length": N},
  {"type": "abort", "message", "status_code", "err_type"}; a request aborted before it ran answers
  SGLang's short form ({"type": "abort", "message": "Abort in waiting queue"}, no token counts but
  completion_tokens).
- `text` is trimmed of the matched stop token (or cut at the stop string) unless no_stop_trim;
  `output_ids` keep it.
- Log-prob entries are [logprob, token_id, text|null] (text with return_text_in_logprobs).
  input_token_logprobs cover the prompt from logprob_start_len on, the first entry's logprob null;
  input_top_logprobs likewise (first entry null); output_top_logprobs one list per output token.
- cached_tokens: the prompt tokens whose prefill the engine reused (a whole prompt it prefilled before, or
  another row's of the same batch; prompt_tokens - 1, SGLang's count), 0 when the prompt's log-probs were
  asked (`prompt_logprobs` computes the whole prompt again).
- token_ids_logprob: input_token_ids_logprobs (None first) and output_token_ids_logprobs, one list per
  position of [logprob, token_id, text|null] for the asked ids, in their order.
- While streaming, every chunk is cumulative (or, with --incremental-streaming-output, only what is new:
  `delta`), finish_reason null until the last.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rlbench.serve.request import Item
from rlbench.serve.worker import WAITING_ABORT, Finish, Job


@dataclass
class Prompt:
    """A request's prompt log-probs (logprob_start_len >= 0): one (logprob|None, id) per prompt token
    from logprob_start_len on, and each position's top log-probs (None first)."""

    tokens: list[tuple[float | None, int]]
    top: list[list[tuple[float, int]] | None]
    probed: list[list[tuple[float, int]] | None]  # token_ids_logprob: the asked ids' log-probs (None first)


@torch.no_grad()
def prompt_logprobs(
    model, ids: tuple[int, ...], start: int, temperature: float, top_n: int, device: str, probe: tuple[int, ...] = ()
) -> Prompt:
    """The prompt's log-probs under the model (one teacher-forced forward of the prompt alone, at the
    request's temperature; greedy at 1): token p's is log_softmax(logits[p - 1])[ids[p]]; the first
    returned token's is None, as in SGLang (its prefix is not scored); likewise the top and probed ones."""
    if start >= len(ids):
        return Prompt([], [], [])
    logits = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0].float()
    logp = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)
    tokens: list[tuple[float | None, int]] = [(None, ids[start])]
    top: list[list[tuple[float, int]] | None] = [None]
    probed: list[list[tuple[float, int]] | None] = [None]
    for p in range(start + 1, len(ids)):
        tokens.append((float(logp[p - 1, ids[p]]), ids[p]))
        if top_n > 0:
            values, order = torch.topk(logp[p - 1], min(top_n, logp.shape[-1]))
            top.append(list(zip(values.tolist(), order.tolist())))
        if probe:
            probed.append(list(zip(logp[p - 1, list(probe)].tolist(), probe)))
    return Prompt(tokens, top if top_n > 0 else [], probed if probe else [])


class Answers:
    """Builds answers for one server: its tokenizer (None: --skip-tokenizer-init, no text) and the
    weight version of the moment."""

    def __init__(self, tokenizer, weight_version):
        self.tokenizer = tokenizer
        self.weight_version = weight_version  # a callable: the server's current version

    def piece(self, ids: list[int]) -> list[str | None]:
        """Each id's own text (return_text_in_logprobs), as SGLang's batch_decode of [[id], ...]."""
        return self.tokenizer.batch_decode([[i] for i in ids])

    def text(self, item: Item, output_ids: tuple[int, ...], finish: Finish | None) -> str:
        sampling = item.sampling
        ids = list(output_ids)
        if (
            finish is not None
            and finish.kind == "stop"
            and isinstance(finish.matched, int)
            and not sampling.no_stop_trim
            and ids
        ):
            ids = ids[:-1]
        text = self.tokenizer.decode(
            ids,
            skip_special_tokens=sampling.skip_special_tokens,
            spaces_between_special_tokens=sampling.spaces_between_special_tokens,
        )
        if finish is not None and finish.kind == "stop" and isinstance(finish.matched, str):
            at = text.find(finish.matched)
            if at >= 0:
                text = text[: at + len(finish.matched)] if sampling.no_stop_trim else text[:at]
        return text

    def entries(self, pairs, with_text: bool) -> list[list]:
        pairs = list(pairs)
        texts = self.piece([i for _, i in pairs]) if with_text and pairs else [None] * len(pairs)
        return [[lp, i, t] for (lp, i), t in zip(pairs, texts)]

    def build(self, item: Item, job: Job, prompt: Prompt | None, with_text: bool, final: bool) -> dict:
        """One item's answer (a stream chunk when not `final`)."""
        finish = job.finish if final else None
        if final and finish.kind == "abort" and finish.message == WAITING_ABORT:
            return self._waiting_abort(item, job, with_text)
        meta = {
            "id": item.rid,
            "finish_reason": _finish_reason(finish, item),
            "prompt_tokens": len(item.prompt_ids),
            "weight_version": self.weight_version(),
            "num_retractions": job.retractions,
        }
        if item.return_logprob:
            self._logprobs(meta, item, job, prompt, with_text)
        meta.update(
            {
                "reasoning_tokens": 0,
                "completion_tokens": len(job.output_ids),
                "cached_tokens": 0 if prompt is not None else job.cached,
            }
        )
        if final:
            meta["weight_versions"] = _spans(job, self.weight_version(), len(job.output_ids))
            meta["e2e_latency"] = time.perf_counter() - job.arrived
        out = {"output_ids": list(job.output_ids), "meta_info": meta}
        if self.tokenizer is not None:
            out = {"text": self.text(item, job.output_ids, finish), **out}
        return out

    def _waiting_abort(self, item: Item, job: Job, with_text: bool) -> dict:
        meta = {
            "id": item.rid,
            "finish_reason": {"type": "abort", "message": WAITING_ABORT},
            "weight_version": self.weight_version(),
            "e2e_latency": time.perf_counter() - job.arrived,
        }
        if item.return_logprob:
            self._logprobs(meta, item, job, None, with_text)
        meta["completion_tokens"] = 0
        out = {"output_ids": [], "meta_info": meta}
        return {"text": "", **out} if self.tokenizer is not None else out

    def _logprobs(self, meta: dict, item: Item, job: Job, prompt: Prompt | None, with_text: bool) -> None:
        with_text = with_text and self.tokenizer is not None
        meta["input_token_logprobs"] = self.entries(prompt.tokens, with_text) if prompt else []
        meta["output_token_logprobs"] = self.entries(zip(job.logprobs, job.output_ids), with_text)
        meta["output_token_logprobs_length"] = len(job.output_ids)
        if item.top_logprobs_num > 0:
            meta["input_top_logprobs"] = [
                None if t is None else self.entries(t, with_text) for t in (prompt.top if prompt else [])
            ]
            meta["output_top_logprobs"] = [self.entries(t, with_text) for t in job.top]
        if item.probe:
            meta["input_token_ids_logprobs"] = [
                None if t is None else self.entries(t, with_text) for t in (prompt.probed if prompt else [])
            ]
            meta["output_token_ids_logprobs"] = [self.entries(t, with_text) for t in job.probed]


OUTPUT_SIDE = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")  # one entry per new token


def delta(chunk: dict, ids_sent: int, text_sent: str, final: bool) -> tuple[dict, str]:
    """A cumulative stream chunk cut to what is new (SGLang's --incremental-streaming-output,
    tokenizer_manager._slice_streaming_output_meta_info): the output ids, the output-side log-prob lists
    and the text past what earlier chunks carried; the rest of meta_info as it is. Also the text shown so
    far: a chunk before the last holds back a trailing partial character (U+FFFD), as SGLang's
    detokenizer does, so the texts of the chunks concatenate to the answer's."""
    meta = dict(chunk["meta_info"])
    for key in OUTPUT_SIDE:
        if key in meta:
            meta[key] = meta[key][ids_sent:]
    out = {"output_ids": chunk["output_ids"][ids_sent:], "meta_info": meta}
    if "text" not in chunk:
        return out, text_sent
    text = chunk["text"] if final else chunk["text"].rstrip("\ufffd")
    new = text[len(text_sent) :] if text.startswith(text_sent) else ""
    return {"text": new, **out}, text_sent + new


def _finish_reason(finish: Finish | None, item: Item) -> dict | None:
    if finish is None:
        return None
    if finish.kind == "stop":
        return {"type": "stop", "matched": finish.matched}
    if finish.kind == "length":
        return {"type": "length", "length": item.request.max_new_tokens}
    return {"type": "abort", "message": finish.message, "status_code": None, "err_type": None}


def _spans(job: Job, current: str, tokens: int) -> list[dict]:
    """SGLang's weight_versions: the versions that produced the tokens, as [start, end) spans."""
    changes = [*job.version_changes, (current, tokens)]
    spans: list[dict] = []
    for version, end in changes:
        end = min(end, tokens)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return [s for s in spans if s["start"] < tokens or s["start"] == 0]
