"""The embedded rollout engine (`hf`): a transformers model with a KV cache, in-process.

Batch invariance by construction: a request's tokens and log-probs are the same bytes whatever
else is in the batch and in whichever row it sits (unless `batch_variant`, a fault planted on
purpose: batch_variant.py). Two decode paths hold it:

- `batched` (the default): requests are bucketed by (prompt length rounded up to 32, max new
  tokens), both the request's own. A bucket decodes in chunks of a fixed `batch_size` rows with
  a fixed KV length: prompts are left-padded to the bucket's width, a mask hides the padding,
  rows past the chunk's requests are empty padding. The chunk's distinct prompts are prefilled
  once each, in forwards of a fixed PREFILL_ROWS rows at the bucket's width, and copied into the
  rows of their requests. Every forward thus has shapes fixed by the bucket alone, whatever the
  chunk holds, and row-wise kernels (GEMM rows, per-row attention and softmax) give each row the
  same arithmetic: batching only ever changes what sits in the other rows.
- `per-sample` (the reference): each request decodes alone at batch size 1, from a prefill at
  the prompt's own length (one per distinct prompt), with a cache growing by one column a token.

Sampling (`sampling.py`) is shared: Gumbel-max with noise from the request's own generator, so
a row's randomness is its own. The two paths differ in the shapes of their forwards only, so
their log-probs agree to rounding (tests/cpu/test_batch_invariance.py holds both to the property,
and to each other).

Step by step (`steps`): the same computation as `generate`, as a generator that yields after
every sampled token, with the tokens so far in a `Decoding` its driver reads (`rlbench serve`
streams them) and where the driver ends requests early (an abort, a stop string): an ended row
draws no more noise and its tokens are no longer kept, which changes nothing in the other rows,
whose arithmetic never depended on it. A driver may also ask for each token's top log-probs
(SGLang's `top_logprobs_num`) or the log-probs of given ids (`token_ids_logprob`), read from the same
log-softmax the sampler's log-prob comes from, and add a request's logit bias (`logit_bias`) to its row's
logits before each choice (a row without one keeps its logits' bytes).

With a `prompt_cache` (prompt_cache.py; `rlbench serve` gives it one) a prompt prefilled before is taken from
it instead of computed: a prefill depends on its prompt and width alone, so the bytes are the same.
"""

from __future__ import annotations

import copy
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from rlbench.backends.batch_variant import SplitKDecode
from rlbench.backends.batched_forward import GROUPED, EagerDecode, GraphDecode, KVStore, fusable_norms, register_grouped
from rlbench.backends.prompt_cache import PromptCache
from rlbench.backends.engine_numerics import Numerics
from rlbench.backends.sampling import SamplingRows, biased, probed, sample, top
from rlbench.core.model import load_named_, named_weights
from rlbench.core.types import GenerateRequest, GenerateResult
from rlbench.errors import BadInput
from rlbench.rundir.digest import tensor_digests

DECODES = ("batched", "per-sample")
PROMPT_BUCKET = 32  # prompt widths are rounded up to a multiple of this: fewer distinct shapes
PREFILL_ROWS = 8  # rows of every batched prefill forward (distinct prompts; padding fills it)
KEPT_GRAPHS = 8  # captured decode graphs an engine keeps (each holds a KV cache of its shape)


@dataclass
class Decoding:
    """The live state of one step-wise generation (`HFEngine.steps`), shared with its driver: each
    request's tokens and log-probs so far (appended as they are sampled), `finished` (request index ->
    its finish reason, once it has one), `ended` (request index -> the finish reason the driver ends
    it with, taken before its next token), and `top_n` (request index -> how many top log-probs to keep
    per token, in `top`: [(logprob, token id), ...] each)."""

    outputs: list[list[int]]
    logprobs: list[list[float]]
    finished: dict[int, str] = field(default_factory=dict)
    ended: dict[int, str] = field(default_factory=dict)
    top_n: dict[int, int] = field(default_factory=dict)
    top: dict[int, list[list[tuple[float, int]]]] = field(default_factory=dict)
    # request index -> {token id: bias} added to its logits before each token is chosen (SGLang's logit_bias:
    # its log-probs are of the biased logits, as SGLang's); -> token ids whose log-probs `probed` keeps per
    # token (SGLang's token_ids_logprob); -> prompt tokens whose prefill it did not compute (cached_tokens).
    bias: dict[int, dict[int, float]] = field(default_factory=dict)
    probe: dict[int, tuple[int, ...]] = field(default_factory=dict)
    probed: dict[int, list[list[tuple[float, int]]]] = field(default_factory=dict)
    cached: dict[int, int] = field(default_factory=dict)

    @classmethod
    def fresh(
        cls,
        count: int,
        top_n: dict[int, int] | None = None,
        bias: dict[int, dict[int, float]] | None = None,
        probe: dict[int, tuple[int, ...]] | None = None,
    ) -> Decoding:
        top_n = {i: n for i, n in (top_n or {}).items() if n > 0}
        bias = {i: b for i, b in (bias or {}).items() if b}
        probe = {i: tuple(p) for i, p in (probe or {}).items() if p}
        return cls(
            [[] for _ in range(count)],
            [[] for _ in range(count)],
            top_n=top_n,
            top={i: [] for i in top_n},
            bias=bias,
            probe=probe,
            probed={i: [] for i in probe},
        )

    def biases(self, indices: Sequence[int], rows: int, vocab: int, device: str) -> torch.Tensor | None:
        """[rows, vocab] float32: the logit biases of the requests `indices` (row r is request indices[r]),
        zeros elsewhere; None when none of them has one."""
        if not any(i in self.bias for i in indices):
            return None
        table = torch.zeros(rows, vocab)
        for row, i in enumerate(indices):
            for token, value in self.bias.get(i, {}).items():
                table[row, token] = value
        return table.to(device)

    def note(self, index: int, logits: torch.Tensor, rows: SamplingRows, row: int) -> None:
        """Keep request `index`'s top log-probs and probed ids' log-probs of this token, where it asked."""
        if index in self.top_n:
            self.top[index].append(top(logits, rows, row, self.top_n[index]))
        if index in self.probe:
            self.probed[index].append(probed(logits, rows, row, self.probe[index]))


def _run(steps: Generator) -> list:
    """Drive a step-wise generation to its end; its results."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


class HFEngine:
    """Holds its own copy of the policy, as a real engine does; weights arrive through `update_weights`."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: str = "cpu",
        engine_id: str = "hf:0",
        true_on_policy: bool = False,
        decode: str = "batched",
        batch_size: int = 64,
        cuda_graphs: bool = True,
    ):
        if decode not in DECODES:
            raise BadInput(f"expected one of {', '.join(DECODES)}, got {decode!r}", field="rollout.decode")
        layer_types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
        if layer_types != {"full_attention"}:
            raise BadInput(
                f"the embedded engine decodes full-attention models only, this one has {sorted(layer_types)}",
                field="model.path",
            )
        self.model = copy.deepcopy(model).to(device).eval()
        self.model.requires_grad_(False)
        self.device, self.true_on_policy = device, true_on_policy
        self.numerics = Numerics()  # where the engine's numbers differ from the trainer's on purpose (set by registry)
        self.batch_variant = False  # a fault planted on purpose (batch_variant.py; rlbench serve --batch-variant)
        self.prefix_variant = False  # another (batch_variant.py; rollout.prefix_invariant = false)
        self.decode, self.batch_size = decode, batch_size
        self.engine_id = engine_id
        self.weight_version = 0
        self.vocab = self.model.get_output_embeddings().weight.shape[0]
        self.cuda_graphs = cuda_graphs and torch.device(device).type == "cuda"
        # On a GPU the batched path's forwards attend with `grouped_attention`; the per-sample path (the reference)
        # and true on-policy rescoring keep the model's own attention (the trainer's).
        self.grouped = torch.device(device).type == "cuda"
        if self.grouped:
            register_grouped()
        self.own_attention = self.model.config._attn_implementation
        self._norms: tuple[torch.nn.Module, list] | None = None  # (model, its fusable norms): `_fused`
        self.graphs: dict[tuple[int, int], list[GraphDecode]] = {}  # (rows, length) -> captured decodes, kept
        self.prompt_cache: PromptCache | None = None  # prefills kept between generations (`rlbench serve`)

    @torch.no_grad()
    def generate(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        if self.decode == "batched":
            results = self._generate_batched(requests)
        else:
            decoding = Decoding.fresh(len(requests))
            results = _run(self._alone_steps(requests, decoding))
        if self.true_on_policy:
            results = [self._rescore(req, res) for req, res in zip(requests, results)]
        return results

    def steps(self, requests: Sequence[GenerateRequest], decoding: Decoding) -> Generator[None, None, list]:
        """`generate` step by step: yields after every sampled token (its state in `decoding`), returns
        the results. Run it with torch's grad off (`torch.no_grad()` around each `next`)."""
        if self.decode == "batched":
            results = yield from self._batched_steps(requests, decoding)
        else:
            results = yield from self._alone_steps(requests, decoding)
        if self.true_on_policy:
            results = [self._rescore(req, res) for req, res in zip(requests, results)]
        return results

    def forward_logits(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        kv: KVStore,
        mask: torch.Tensor | None,
        attention=None,
        **extra,
    ) -> torch.Tensor:
        """Logits [rows, vocab] at the last position. Positions and the mask are always given, so
        transformers builds nothing that depends on the batch (its default mask checks the whole
        batch for padding). A None mask is causal for a prefill and all-visible for one token (the
        per-sample path); a mask given is the batched path's, which attends with `grouped_attention` and fused
        RMSNorms (`fusable_norms`) on a GPU. `attention`: another registered attention (a planted fault's), given
        `extra`."""
        fuse = self.grouped and mask is not None
        if fuse:
            self.model.config._attn_implementation = GROUPED
            self._fused(True)
        if attention is not None:
            self.model.config._attn_implementation = attention
        try:
            out = self.model(
                input_ids=ids.to(self.device),
                position_ids=positions.to(self.device),
                past_key_values=kv,
                attention_mask={"full_attention": mask},
                use_cache=True,
                logits_to_keep=1,
                **extra,
            )
        finally:
            self.model.config._attn_implementation = self.own_attention
            if fuse:
                self._fused(False)
        return out.logits[:, -1].float()

    def _fused(self, on: bool) -> None:
        """Turn the model's fused RMSNorms on or off (`fusable_norms`; found again if the model was replaced)."""
        if self._norms is None or self._norms[0] is not self.model:
            self._norms = (self.model, fusable_norms(self.model))
        for norm in self._norms[1]:
            norm.fused = on

    def _alone_steps(self, requests: Sequence[GenerateRequest], decoding: Decoding) -> Generator[None, None, list]:
        """The reference path: each request alone, one prefill per distinct prompt of the call."""
        prefills: dict[tuple[int, ...], tuple[KVStore, torch.Tensor]] = {}
        results = []
        for index, req in enumerate(requests):
            results.append((yield from self._decode_alone(req, prefills, decoding, index)))
        return results

    def _decode_alone(
        self, req: GenerateRequest, prefills: dict, decoding: Decoding, index: int
    ) -> Generator[None, None, GenerateResult]:
        """The reference path: batch size 1, a cache growing by one column per token; one prefill
        per distinct prompt of the call, at the prompt's own length."""
        key = ("per-sample", req.prompt_ids)
        reused = req.prompt_ids in prefills or (self.prompt_cache is not None and key in self.prompt_cache)
        if req.prompt_ids not in prefills:
            found = self.prompt_cache.get(key) if self.prompt_cache is not None else None
            if found is None:
                kv = KVStore()
                ids, positions = torch.tensor([req.prompt_ids]), torch.arange(len(req.prompt_ids))[None]
                logits = self.forward_logits(ids, positions, kv, None)
                found = (kv, logits[0])
                if self.prompt_cache is not None:
                    self.prompt_cache.put(key, found, [*kv.keys, *kv.values, logits])
            prefills[req.prompt_ids] = found
        decoding.cached[index] = len(req.prompt_ids) - 1 if reused else 0  # SGLang's count (it redoes the last)
        prefill, logits = prefills[req.prompt_ids]
        kv, rows = prefill.extended(), SamplingRows([req], 1, self.device, self.numerics)
        bias = decoding.biases([index], 1, self.vocab, self.device)
        output, logprobs, finish = decoding.outputs[index], decoding.logprobs[index], "length"
        for step in range(req.max_new_tokens):
            logits = biased(logits[None], bias)[0]
            token, logprob = sample(logits[None], rows, step)
            output.append(int(token[0]))
            logprobs.append(float(logprob[0]))
            decoding.note(index, logits[None], rows, 0)
            if output[-1] in req.stop_token_ids:
                finish = "stop"
                break
            if len(output) == req.max_new_tokens:
                break
            yield
            if index in decoding.ended:
                finish = decoding.ended[index]
                break
            logits = self.forward_logits(token[:, None], torch.tensor([[len(req.prompt_ids) + step]]), kv, None)[0]
        decoding.finished[index] = finish
        return GenerateResult(tuple(output), tuple(logprobs), finish, self.engine_id, self.weight_version)

    def _decoder(self, rows: int, length: int, live: int, prefix: int) -> EagerDecode:
        """The decode for a chunk: a free captured graph of that shape (captured on first use) on a GPU with
        `cuda_graphs`, else eager. Captured graphs are kept, each with its cache buffers: a run has few shapes
        (its buckets), a server may see many (every max_new_tokens its clients ask for), so past KEPT_GRAPHS the
        free graphs of the shapes used longest ago are let go (captured again if they come back). `live`: the
        chunk's requests, the split of a `batch_variant` engine's decode; `prefix`, the prompt's columns, where a
        `prefix_variant` one's attention splits (planted faults: always eager)."""
        if self.batch_variant or self.prefix_variant:
            split = prefix if self.prefix_variant else None
            return SplitKDecode(self, rows, length, live if self.batch_variant else 1, split)
        if not self.cuda_graphs:
            return EagerDecode(self, rows, length)
        kept = self.graphs.pop((rows, length), [])
        self.graphs[(rows, length)] = kept  # the most recently used shape last
        free = next((graph for graph in kept if not graph.taken), None)
        if free is None:
            self._let_go(KEPT_GRAPHS - 1)
            self.graphs[(rows, length)] = kept  # (let go of if it held only free graphs)
            free = GraphDecode(self, rows, length)
            kept.append(free)
        return free.claim()

    def _let_go(self, keep: int) -> None:
        """Drop free graphs, oldest shape first, until at most `keep` are kept (graphs in use stay)."""
        for shape in list(self.graphs):
            if sum(len(kept) for kept in self.graphs.values()) <= keep:
                return
            self.graphs[shape] = [graph for graph in self.graphs[shape] if graph.taken]
            if not self.graphs[shape]:
                del self.graphs[shape]

    def _generate_batched(self, requests: Sequence[GenerateRequest]) -> list[GenerateResult]:
        return _run(self._batched_steps(requests, Decoding.fresh(len(requests))))

    def _batched_steps(self, requests: Sequence[GenerateRequest], decoding: Decoding) -> Generator[None, None, list]:
        buckets: dict[tuple[int, int], list[int]] = {}
        for i, req in enumerate(requests):
            width = -(-len(req.prompt_ids) // PROMPT_BUCKET) * PROMPT_BUCKET
            buckets.setdefault((width, req.max_new_tokens), []).append(i)
        results: list[GenerateResult | None] = [None] * len(requests)
        for (width, new), members in buckets.items():
            for start in range(0, len(members), self.batch_size):
                chunk = members[start : start + self.batch_size]
                rows = yield from self._rows_steps([requests[i] for i in chunk], width, new, decoding, chunk)
                for i, result in zip(chunk, rows):
                    results[i] = result
        return results

    def _prefills(self, prompts: list[tuple[int, ...]], width: int) -> tuple[KVStore, torch.Tensor, torch.Tensor, set]:
        """`_prefill_rows` of distinct prompts, those `prompt_cache` keeps taken from it (the same bytes: a row's
        prefill depends on its prompt and width alone) and the others computed and kept; also the prompts
        that were kept."""
        if self.prompt_cache is None:
            return (*self._prefill_rows(prompts, width), set())
        keys = {p: ("batched", width, p) for p in prompts}
        found = {p: self.prompt_cache.get(keys[p]) for p in prompts}
        kept = {p for p, entry in found.items() if entry is not None}
        missing = [p for p in prompts if p not in kept]
        if missing:
            kv, logits, visible = self._prefill_rows(missing, width)
            for row, p in enumerate(missing):  # clones: a row of the forward's tensors would hold all of them
                entry = (
                    [k[row].clone() for k in kv.keys],
                    [v[row].clone() for v in kv.values],
                    logits[row].clone(),
                    visible[row].clone(),
                )
                found[p] = entry
                self.prompt_cache.put(keys[p], entry, [*entry[0], *entry[1], entry[2], entry[3]])
        layers = len(found[prompts[0]][0])
        merged = KVStore(
            [torch.stack([found[p][0][layer] for p in prompts]) for layer in range(layers)],
            [torch.stack([found[p][1][layer] for p in prompts]) for layer in range(layers)],
        )
        return (merged, torch.stack([found[p][2] for p in prompts]), torch.stack([found[p][3] for p in prompts]), kept)

    def forget_prompts(self) -> None:
        """Empty `prompt_cache` (the weights changed: its prefills are the old model's)."""
        if self.prompt_cache is not None:
            self.prompt_cache.clear()

    def _prefill_rows(self, prompts: list[tuple[int, ...]], width: int) -> tuple[KVStore, torch.Tensor, torch.Tensor]:
        """Distinct prompts, left-padded to `width`, in forwards of PREFILL_ROWS rows: keys/values
        [rows, heads, width, head_dim] per layer, last logits [rows, vocab], visible columns."""
        stores, logits, visible = [], [], []
        for start in range(0, len(prompts), PREFILL_ROWS):
            ids = torch.zeros(PREFILL_ROWS, width, dtype=torch.long)
            positions = torch.zeros(PREFILL_ROWS, width, dtype=torch.long)
            # Causal within a prompt; a padding query sees only itself, so no softmax row is empty.
            mask = torch.eye(width, dtype=torch.bool).repeat(PREFILL_ROWS, 1, 1, 1)
            seen = torch.zeros(PREFILL_ROWS, width, dtype=torch.bool)
            causal = torch.ones(width, width, dtype=torch.bool).tril()
            for row, prompt in enumerate(prompts[start : start + PREFILL_ROWS]):
                pad = width - len(prompt)
                ids[row, pad:] = torch.tensor(prompt)
                positions[row, pad:] = torch.arange(len(prompt))
                mask[row, 0, pad:, pad:] = causal[pad:, pad:]
                seen[row, pad:] = True
            kv = KVStore()
            logits.append(self.forward_logits(ids, positions, kv, mask.to(self.device)))
            stores.append(kv)
            visible.append(seen)
        merged = KVStore(
            [torch.cat(k) for k in zip(*(s.keys for s in stores))],
            [torch.cat(v) for v in zip(*(s.values for s in stores))],
        )
        return merged, torch.cat(logits), torch.cat(visible)

    def _decode_rows(self, reqs: list[GenerateRequest], width: int, new: int) -> list[GenerateResult]:
        return _run(self._rows_steps(reqs, width, new, Decoding.fresh(len(reqs)), list(range(len(reqs)))))

    def _rows_steps(
        self, reqs: list[GenerateRequest], width: int, new: int, decoding: Decoding, indices: list[int]
    ) -> Generator[None, None, list]:
        """One chunk of a bucket: `batch_size` rows, KV length width + new, prompts left-padded
        to `width` so every row writes its t-th token at column width + t. `indices`: the chunk's
        requests' places in `decoding`."""
        rows, count = self.batch_size, len(reqs)
        distinct = list(dict.fromkeys(r.prompt_ids for r in reqs))  # one prefill per prompt, first-seen order
        prefill, first_logits, prompt_visible, kept = self._prefills(distinct, width)
        which = torch.tensor([distinct.index(r.prompt_ids) for r in reqs])
        seen = set(kept)  # a prompt kept, or prefilled for an earlier row, was not computed for this one
        for row, req in enumerate(reqs):
            decoding.cached[indices[row]] = len(req.prompt_ids) - 1 if req.prompt_ids in seen else 0  # as SGLang counts
            seen.add(req.prompt_ids)
        logits = torch.zeros(rows, self.vocab, device=self.device)
        logits[:count] = first_logits[which.to(self.device)]
        decoder = visible = starts = None  # the decode and its store, made once a second token is needed
        sampling = SamplingRows(reqs, rows, self.device, self.numerics)
        bias = decoding.biases(indices, rows, self.vocab, self.device)
        outputs = [decoding.outputs[i] for i in indices]
        logprobs = [decoding.logprobs[i] for i in indices]
        finish = ["length"] * count
        done = [False] * count
        try:  # a generation abandoned at a yield (its driver closed it) frees its graph too
            for step in range(new):
                logits = biased(logits, bias)
                tokens, chosen = sample(logits, sampling, step)
                # one copy to the host a step: ids and float32 log-probs are both exact in float64
                picked = torch.stack([tokens.double(), chosen.double()]).cpu().tolist()
                for row, (token, logprob) in enumerate(zip(picked[0][:count], picked[1])):
                    token = int(token)
                    if done[row]:
                        continue
                    outputs[row].append(token)
                    logprobs[row].append(logprob)
                    decoding.note(indices[row], logits, sampling, row)
                    if token in reqs[row].stop_token_ids:
                        finish[row], done[row] = "stop", True
                    done[row] = done[row] or len(outputs[row]) == new
                    if done[row]:
                        decoding.finished[indices[row]] = finish[row]
                if all(done):
                    break
                yield
                for row in range(count):
                    if not done[row] and indices[row] in decoding.ended:
                        finish[row], done[row] = decoding.ended[indices[row]], True
                        decoding.finished[indices[row]] = finish[row]
                if all(done):
                    break
                if decoder is None:
                    decoder = self._decoder(rows, width + new, count, width)
                    decoder.kv.put(slice(0, count), which.to(self.device), prefill)
                    visible = torch.zeros(rows, width + new, dtype=torch.bool)
                    visible[:count, :width] = prompt_visible[which]
                    starts = torch.zeros(rows, dtype=torch.long)  # each row's first new position: its prompt length
                    starts[:count] = torch.tensor([len(r.prompt_ids) for r in reqs])
                visible[:, width + step] = True  # padding rows see their own token: no all-masked row
                logits = decoder.forward(
                    tokens[:, None], (starts + step)[:, None].to(self.device), visible[:, None, None, :], width + step
                )
        finally:
            if isinstance(decoder, GraphDecode):
                decoder.release()
        for row in range(count):
            decoding.finished.setdefault(indices[row], finish[row])
        return [
            GenerateResult(tuple(o), tuple(lp), f, self.engine_id, self.weight_version)
            for o, lp, f in zip(outputs, logprobs, finish)
        ]

    def _rescore(self, req: GenerateRequest, result: GenerateResult) -> GenerateResult:
        """True on-policy: log-probs from the trainer's own forward (`sequence_logprobs`) of the
        finished sequence. The tokens were still sampled from the cached decode's logits, which
        differ from these in the last bits; what trains (and is compared) is now one computation."""
        from rlbench.core.algo import sequence_logprobs

        ids = torch.tensor(req.prompt_ids + result.output_ids)
        scores = sequence_logprobs(self.model, ids, req.temperature, self.device)[len(req.prompt_ids) :]
        return replace(result, logprobs=tuple(float(x) for x in scores))

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        self.forget_prompts()
        load_named_(self.model, self.numerics.held(weights), source=f"engine {self.engine_id} weight update")
        self.weight_version = version

    def weight_checksums(self) -> dict[str, dict[str, str]]:
        return {self.engine_id: tensor_digests(named_weights(self.model))}

    def export_weights(self, holder: str, names: Sequence[str]) -> dict[str, torch.Tensor]:
        weights = named_weights(self.model)
        return {name: weights[name] for name in names if name in weights}

    def close(self) -> None:
        pass
