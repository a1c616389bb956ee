"""The embedded rollout engine (`hf`): a transformers model with a KV cache, in-process.

Batch invariance by construction: a request's tokens and log-probs are the same bytes whatever
else is in the batch and in whichever row it sits. Two decode paths hold it:

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
(SGLang's `top_logprobs_num`), read from the same log-softmax the sampler's log-prob comes from.
"""

from __future__ import annotations

import copy
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from rlbench.backends.sampling import RequestNoise, SamplingRows, choose
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

    @classmethod
    def fresh(cls, count: int, top_n: dict[int, int] | None = None) -> Decoding:
        top_n = {i: n for i, n in (top_n or {}).items() if n > 0}
        return cls([[] for _ in range(count)], [[] for _ in range(count)], top_n=top_n,
                   top={i: [] for i in top_n})


def _run(steps: Generator) -> list:
    """Drive a step-wise generation to its end; its results."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


class KVStore:
    """The engine's own key/value cache, handed to transformers' attention layers as
    `past_key_values`: they call `update(keys, values, layer_idx, ...)` and attend over what it
    returns. Owning it (rather than transformers' Cache classes, whose internals change between
    releases) keeps the decode shapes ours: with `column` None it grows (prefill, per-sample),
    else new entries are written into a fixed buffer at that column (batched)."""

    def __init__(self, keys: list[torch.Tensor] | None = None, values: list[torch.Tensor] | None = None):
        self.keys, self.values = keys or [], values or []
        self.column: torch.Tensor | None = None  # [1] long, on the buffers' device: where a fixed store writes

    @classmethod
    def fixed(cls, config, rows: int, width: int, dtype: torch.dtype, device: str) -> KVStore:
        """Zeroed buffers [rows, kv heads, width, head dim] per layer, written one column a token."""
        shape = (rows, config.num_key_value_heads, width, _head_dim(config))
        layers = config.num_hidden_layers
        store = cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)],
                    [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)])
        store.column = torch.zeros(1, dtype=torch.long, device=device)
        return store

    def zero_(self) -> None:
        for tensor in (*self.keys, *self.values):
            tensor.zero_()

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.column is not None:  # a device tensor, not an int: a captured CUDA graph replays it with new values
            self.keys[layer_idx].index_copy_(2, self.column, keys)
            self.values[layer_idx].index_copy_(2, self.column, values)
        elif layer_idx == len(self.keys):
            self.keys.append(keys)
            self.values.append(values)
        else:  # torch.cat makes new tensors: a shared prefill is never written into
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], keys], dim=2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], values], dim=2)
        return self.keys[layer_idx], self.values[layer_idx]

    def extended(self) -> KVStore:
        """A store that grows from this one's entries without changing them."""
        return KVStore(list(self.keys), list(self.values))

    def put(self, rows: slice, source_rows: torch.Tensor, prefill: KVStore) -> None:
        """Copy a prefill's rows `source_rows` (its keys span the first columns) into `rows`."""
        for mine, theirs in ((self.keys, prefill.keys), (self.values, prefill.values)):
            for layer, tensor in enumerate(theirs):
                mine[layer][rows, :, : tensor.shape[2]] = tensor[source_rows]


class EagerDecode:
    """A chunk's decode forwards launched as they come, over a fixed store of `rows` x `length` columns."""

    def __init__(self, engine: HFEngine, rows: int, length: int):
        self.engine = engine
        config = engine.model.config
        self.kv = KVStore.fixed(config, rows, length, engine.model.dtype, engine.device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, column: int) -> torch.Tensor:
        """Logits [rows, vocab] of one decode step; its keys and values go to column `column`."""
        self.kv.column.fill_(column)
        return self.engine._forward(tokens, positions, self.kv, mask.to(self.engine.device))


class GraphDecode(EagerDecode):
    """The same forward captured once as a CUDA graph for its (rows, length) and replayed every step: one
    launch instead of a few per layer, the same kernels on the same shapes, so the same bits as
    `EagerDecode` (tests/gpu/test_engine_cuda.py). Inputs are copied into the graph's own tensors and the
    logits it returns are a copy (the next replay overwrites its output). Reused chunk after chunk: `claim`
    zeroes its store (a store's unwritten columns are zeros, as a fresh one's) and marks it taken until
    `release`, so two interleaved generations never share one."""

    def __init__(self, engine: HFEngine, rows: int, length: int):
        super().__init__(engine, rows, length)
        device = engine.device
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.mask = torch.ones(rows, 1, 1, length, dtype=torch.bool, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # lazy set-ups (cuBLAS handles, workspaces) happen here, not in the capture
            for _ in range(2):
                engine._forward(self.tokens, self.positions, self.kv, self.mask)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # Deterministic mode fills every new tensor with NaN first (a guard against reading memory nothing wrote):
        # a few hundred fill kernels a step. The graph's forward writes every tensor it reads, as the eager forward
        # does (tests/gpu/test_engine_cuda.py holds their bits equal), so its capture leaves the fills out.
        fill = torch.utils.deterministic.fill_uninitialized_memory
        torch.utils.deterministic.fill_uninitialized_memory = False
        try:
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.logits = engine._forward(self.tokens, self.positions, self.kv, self.mask)
        finally:
            torch.utils.deterministic.fill_uninitialized_memory = fill
        self.taken = False

    def claim(self) -> GraphDecode:
        self.kv.zero_()
        self.taken = True
        return self

    def release(self) -> None:
        self.taken = False

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, column: int) -> torch.Tensor:
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.mask.copy_(mask)
        self.kv.column.fill_(column)
        self.graph.replay()
        return self.logits.clone()


def _top(logits: torch.Tensor, rows: SamplingRows, row: int, n: int) -> list[tuple[float, int]]:
    """Row `row`'s n most likely tokens, (log-prob, id) by descending log-prob, from the log-softmax
    `choose` reports its log-probs from (the same expression over the same rows: the same bits)."""
    greedy = rows.temperature == 0
    logp = torch.log_softmax(logits.float() / torch.where(greedy, 1.0, rows.temperature)[:, None], dim=-1)
    values, ids = torch.topk(logp[row], min(n, logp.shape[-1]))
    return list(zip(values.tolist(), ids.tolist()))


GROUPED = "rlbench_grouped"  # the batched path's attention on a GPU (registered with transformers on first use)


def grouped_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor, scaling: float, **_) -> tuple[torch.Tensor, None]:
    """Attention for the batched path's forwards on a GPU, registered with transformers as `rlbench_grouped`.
    SDPA with a mask does not take grouped keys (GQA): transformers copies every key/value head to each of its
    query heads first, the whole cache twice a layer at each decode step. Here each key/value head's query heads
    are the rows of one matrix product over that head's cache, read once: scores [rows x kv heads, group x q,
    length], the mask, a float32 softmax cast back (transformers' eager attention's arithmetic), times the values.
    Each row is its own slices of batched matrix products of fixed shapes: batch invariance holds as before."""
    rows, heads, q, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    group = heads // kv_heads  # query head h reads key/value head h // group, as transformers' repeat_kv pairs them
    scores = torch.bmm(query.reshape(rows * kv_heads, group * q, dim),
                       key.reshape(rows * kv_heads, length, dim).transpose(1, 2)) * scaling
    visible = attention_mask[:, None].expand(rows, kv_heads, group, q, length).reshape(rows * kv_heads, group * q, length)
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1, dtype=torch.float32)
    out = torch.bmm(weights.to(value.dtype), value.reshape(rows * kv_heads, length, dim))
    return out.view(rows, heads, q, dim).transpose(1, 2).contiguous(), None


def _fusable_norms(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Give the model's RMSNorms (transformers' `*RMSNorm` modules) a fused path, off until `fused` is set on each:
    `torch.rms_norm` in one call (float32 inside, one rounding to the model's dtype) instead of transformers' eight
    kernels (widen, square, mean, add, rsqrt, multiply, round, weight), four norms a layer. In a captured decode
    step of a small model most of the GPU's time is kernels' fixed cost. The batched path turns it on around its
    forwards on a GPU (each row is normalised alone, at the bucket's fixed shapes: batch invariance holds as
    before); the per-sample path (the reference) and rescoring keep the model's own norms. The module's class is
    swapped for a subclass, so a copy of the model (a weight load in `rlbench serve`) keeps the path. Returns them."""
    norms = []
    for module in model.modules():
        kind = type(module)
        if kind.__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon") and hasattr(module, "weight"):
            if kind not in _FUSED_KINDS.values():
                module.__class__ = _FUSED_KINDS.setdefault(kind, type(kind.__name__, (kind,), {"forward": _norm}))
            module.fused = getattr(module, "fused", False)
            norms.append(module)
    return norms


def _norm(self, hidden: torch.Tensor) -> torch.Tensor:
    if not self.fused:
        return super(type(self), self).forward(hidden)
    return torch.rms_norm(hidden, (hidden.shape[-1],), self.weight, self.variance_epsilon)


_FUSED_KINDS: dict[type, type] = {}  # transformers' RMSNorm class -> its subclass with a fused path


def _register_grouped() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(GROUPED, grouped_attention)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class HFEngine:
    """Holds its own copy of the policy, as a real engine does; weights arrive through `update_weights`."""

    def __init__(self, model: torch.nn.Module, device: str = "cpu", engine_id: str = "hf:0",
                 true_on_policy: bool = False, decode: str = "batched", batch_size: int = 64,
                 cuda_graphs: bool = True):
        if decode not in DECODES:
            raise BadInput(f"expected one of {', '.join(DECODES)}, got {decode!r}", field="rollout.decode")
        layer_types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
        if layer_types != {"full_attention"}:
            raise BadInput(f"the embedded engine decodes full-attention models only, this one has {sorted(layer_types)}",
                           field="model.path")
        self.model = copy.deepcopy(model).to(device).eval()
        self.model.requires_grad_(False)
        self.device = device
        self.true_on_policy = true_on_policy
        self.decode, self.batch_size = decode, batch_size
        self.engine_id = engine_id
        self.weight_version = 0
        self.vocab = self.model.get_output_embeddings().weight.shape[0]
        self.cuda_graphs = cuda_graphs and torch.device(device).type == "cuda"
        # On a GPU the batched path's forwards attend with `grouped_attention`; the per-sample path (the reference)
        # and true on-policy rescoring keep the model's own attention (the trainer's).
        self.grouped = torch.device(device).type == "cuda"
        if self.grouped:
            _register_grouped()
        self.own_attention = self.model.config._attn_implementation
        self._norms: tuple[torch.nn.Module, list] | None = None  # (model, its fusable norms): `_fused`
        self.graphs: dict[tuple[int, int], list[GraphDecode]] = {}  # (rows, length) -> captured decodes, kept

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

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, kv: KVStore,
                 mask: torch.Tensor | None) -> torch.Tensor:
        """Logits [rows, vocab] at the last position. Positions and the mask are always given, so
        transformers builds nothing that depends on the batch (its default mask checks the whole
        batch for padding). A None mask is causal for a prefill and all-visible for one token (the
        per-sample path); a mask given is the batched path's, which attends with `grouped_attention` and fused
        RMSNorms (`_fusable_norms`) on a GPU."""
        fuse = self.grouped and mask is not None
        if fuse:
            self.model.config._attn_implementation = GROUPED
            self._fused(True)
        try:
            out = self.model(input_ids=ids.to(self.device), position_ids=positions.to(self.device),
                             past_key_values=kv, attention_mask={"full_attention": mask}, use_cache=True,
                             logits_to_keep=1)
        finally:
            self.model.config._attn_implementation = self.own_attention
            if fuse:
                self._fused(False)
        return out.logits[:, -1].float()

    def _fused(self, on: bool) -> None:
        """Turn the model's fused RMSNorms on or off (`_fusable_norms`; found again if the model was replaced)."""
        if self._norms is None or self._norms[0] is not self.model:
            self._norms = (self.model, _fusable_norms(self.model))
        for norm in self._norms[1]:
            norm.fused = on

    def _alone_steps(self, requests: Sequence[GenerateRequest], decoding: Decoding) -> Generator[None, None, list]:
        """The reference path: each request alone, one prefill per distinct prompt of the call."""
        prefills: dict[tuple[int, ...], tuple[KVStore, torch.Tensor]] = {}
        results = []
        for index, req in enumerate(requests):
            results.append((yield from self._decode_alone(req, prefills, decoding, index)))
        return results

    def _decode_alone(self, req: GenerateRequest, prefills: dict, decoding: Decoding,
                      index: int) -> Generator[None, None, GenerateResult]:
        """The reference path: batch size 1, a cache growing by one column per token; one prefill
        per distinct prompt of the call, at the prompt's own length."""
        if req.prompt_ids not in prefills:
            kv = KVStore()
            logits = self._forward(torch.tensor([req.prompt_ids]), torch.arange(len(req.prompt_ids))[None], kv, None)
            prefills[req.prompt_ids] = (kv, logits[0])
        prefill, logits = prefills[req.prompt_ids]
        kv, rows, noise = prefill.extended(), SamplingRows([req], 1, self.device), RequestNoise(req, self.vocab)
        output, logprobs, finish = decoding.outputs[index], decoding.logprobs[index], "length"
        for step in range(req.max_new_tokens):
            token, logprob = choose(logits[None], noise.draw()[None], rows)
            output.append(int(token[0]))
            logprobs.append(float(logprob[0]))
            if index in decoding.top_n:
                decoding.top[index].append(_top(logits[None], rows, 0, decoding.top_n[index]))
            if output[-1] in req.stop_token_ids:
                finish = "stop"
                break
            if len(output) == req.max_new_tokens:
                break
            yield
            if index in decoding.ended:
                finish = decoding.ended[index]
                break
            logits = self._forward(token[:, None], torch.tensor([[len(req.prompt_ids) + step]]), kv, None)[0]
        decoding.finished[index] = finish
        return GenerateResult(tuple(output), tuple(logprobs), finish, self.engine_id, self.weight_version)

    def _decoder(self, rows: int, length: int) -> EagerDecode:
        """The decode for a chunk: a free captured graph of that shape (captured on first use) on a GPU with
        `cuda_graphs`, else eager. Captured graphs are kept, each with its cache buffers: a run has few shapes
        (its buckets), a server may see many (every max_new_tokens its clients ask for), so past KEPT_GRAPHS the
        free graphs of the shapes used longest ago are let go (captured again if they come back)."""
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
                chunk = members[start: start + self.batch_size]
                rows = yield from self._rows_steps([requests[i] for i in chunk], width, new, decoding, chunk)
                for i, result in zip(chunk, rows):
                    results[i] = result
        return results

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
            for row, prompt in enumerate(prompts[start: start + PREFILL_ROWS]):
                pad = width - len(prompt)
                ids[row, pad:] = torch.tensor(prompt)
                positions[row, pad:] = torch.arange(len(prompt))
                mask[row, 0, pad:, pad:] = causal[pad:, pad:]
                seen[row, pad:] = True
            kv = KVStore()
            logits.append(self._forward(ids, positions, kv, mask.to(self.device)))
            stores.append(kv)
            visible.append(seen)
        merged = KVStore([torch.cat(k) for k in zip(*(s.keys for s in stores))],
                         [torch.cat(v) for v in zip(*(s.values for s in stores))])
        return merged, torch.cat(logits), torch.cat(visible)

    def _decode_rows(self, reqs: list[GenerateRequest], width: int, new: int) -> list[GenerateResult]:
        return _run(self._rows_steps(reqs, width, new, Decoding.fresh(len(reqs)), list(range(len(reqs)))))

    def _rows_steps(self, reqs: list[GenerateRequest], width: int, new: int, decoding: Decoding,
                    indices: list[int]) -> Generator[None, None, list]:
        """One chunk of a bucket: `batch_size` rows, KV length width + new, prompts left-padded
        to `width` so every row writes its t-th token at column width + t. `indices`: the chunk's
        requests' places in `decoding`."""
        rows, count = self.batch_size, len(reqs)
        distinct = list(dict.fromkeys(r.prompt_ids for r in reqs))  # one prefill per prompt, first-seen order
        prefill, first_logits, prompt_visible = self._prefill_rows(distinct, width)
        which = torch.tensor([distinct.index(r.prompt_ids) for r in reqs])
        logits = torch.zeros(rows, self.vocab, device=self.device)
        logits[:count] = first_logits[which.to(self.device)]
        decoder = visible = starts = None  # the decode and its store, made once a second token is needed
        sampling, noises = SamplingRows(reqs, rows, self.device), [RequestNoise(r, self.vocab) for r in reqs]
        outputs = [decoding.outputs[i] for i in indices]
        logprobs = [decoding.logprobs[i] for i in indices]
        finish = ["length"] * count
        done = [False] * count
        quiet = torch.full((self.vocab,), 0.5)  # finished and padding rows draw nothing
        try:  # a generation abandoned at a yield (its driver closed it) frees its graph too
            for step in range(new):
                uniform = torch.stack([quiet if d else nz.draw() for nz, d in zip(noises, done)]
                                      + [quiet] * (rows - count))
                tokens, chosen = choose(logits, uniform, sampling)
                # one copy to the host a step: ids and float32 log-probs are both exact in float64
                picked = torch.stack([tokens.double(), chosen.double()]).cpu().tolist()
                for row, (token, logprob) in enumerate(zip(picked[0][:count], picked[1])):
                    token = int(token)
                    if done[row]:
                        continue
                    outputs[row].append(token)
                    logprobs[row].append(logprob)
                    if indices[row] in decoding.top_n:
                        decoding.top[indices[row]].append(_top(logits, sampling, row, decoding.top_n[indices[row]]))
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
                    decoder = self._decoder(rows, width + new)
                    decoder.kv.put(slice(0, count), which.to(self.device), prefill)
                    visible = torch.zeros(rows, width + new, dtype=torch.bool)
                    visible[:count, :width] = prompt_visible[which]
                    starts = torch.zeros(rows, dtype=torch.long)  # each row's first new position: its prompt length
                    starts[:count] = torch.tensor([len(r.prompt_ids) for r in reqs])
                visible[:, width + step] = True  # padding rows see their own token: no all-masked row
                logits = decoder.forward(tokens[:, None], (starts + step)[:, None].to(self.device),
                                         visible[:, None, None, :], width + step)
        finally:
            if isinstance(decoder, GraphDecode):
                decoder.release()
        for row in range(count):
            decoding.finished.setdefault(indices[row], finish[row])
        return [GenerateResult(tuple(o), tuple(lp), f, self.engine_id, self.weight_version)
                for o, lp, f in zip(outputs, logprobs, finish)]

    def _rescore(self, req: GenerateRequest, result: GenerateResult) -> GenerateResult:
        """True on-policy: log-probs from the trainer's own forward (`sequence_logprobs`) of the
        finished sequence. The tokens were still sampled from the cached decode's logits, which
        differ from these in the last bits; what trains (and is compared) is now one computation."""
        from rlbench.core.algo import sequence_logprobs

        ids = torch.tensor(req.prompt_ids + result.output_ids)
        scores = sequence_logprobs(self.model, ids, req.temperature, self.device)[len(req.prompt_ids):]
        return replace(result, logprobs=tuple(float(x) for x in scores))

    def update_weights(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        load_named_(self.model, dict(weights), source=f"engine {self.engine_id} weight update")
        self.weight_version = version

    def weight_checksums(self) -> dict[str, dict[str, str]]:
        return {self.engine_id: tensor_digests(named_weights(self.model))}

    def export_weights(self, holder: str, names: Sequence[str]) -> dict[str, torch.Tensor]:
        weights = named_weights(self.model)
        return {name: weights[name] for name in names if name in weights}

    def close(self) -> None:
        pass
