"""The embedded engine's batched path below the engine (rlbench/backends/hf_engine.py): its key/value cache, its
decode forwards (launched as they come, or captured once as a CUDA graph and replayed), and the two forms its
forwards take on a GPU: grouped attention (each key/value head read once) and fused RMSNorms. The per-sample path
(the reference) uses none of it but the cache's growing form."""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch


class Engine(Protocol):
    """What a decode needs of its engine (hf_engine.HFEngine): its model, its device, its forward."""

    model: torch.nn.Module
    device: str

    def forward_logits(
        self, ids: torch.Tensor, positions: torch.Tensor, kv: KVStore, mask: torch.Tensor | None
    ) -> torch.Tensor: ...


@contextlib.contextmanager
def _one_index(device: torch.device):
    """index_copy_ with a single index: no two sources meet at one place, so the plain kernel is deterministic.
    torch flags index_copy_ on CUDA as nondeterministic whatever the index, and under deterministic algorithms
    runs a sort and device-side asserts instead (about 0.5 ms a decode step at Qwen3-0.6B's 28 layers on an
    H100): the flag is lifted for these writes only, and restored as it was."""
    on, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    if not on or device.type != "cuda":  # the CPU's index_copy_ is deterministic, flagged or not
        yield
        return
    torch.use_deterministic_algorithms(False)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(True, warn_only=warn)


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
        shape = (rows, config.num_key_value_heads, width, head_dim(config))
        layers = config.num_hidden_layers
        store = cls(
            [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)],
            [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)],
        )
        store.column = torch.zeros(1, dtype=torch.long, device=device)
        return store

    def zero_(self) -> None:
        for tensor in (*self.keys, *self.values):
            tensor.zero_()

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.column is not None:  # a device tensor, not an int: a captured CUDA graph replays it with new values
            with _one_index(keys.device):
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

    def __init__(self, engine: Engine, rows: int, length: int):
        self.engine = engine
        config = engine.model.config
        self.kv = KVStore.fixed(config, rows, length, engine.model.dtype, engine.device)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, column: int) -> torch.Tensor:
        """Logits [rows, vocab] of one decode step; its keys and values go to column `column`."""
        self.kv.column.fill_(column)
        return self.engine.forward_logits(tokens, positions, self.kv, mask.to(self.engine.device))


@contextlib.contextmanager
def without_nan_fill():
    """Deterministic mode fills every new tensor with NaN first (a guard against reading memory nothing wrote): a
    few hundred fill kernels a forward. Within this, for forwards that write every tensor they read (the values are
    the same), it does not."""
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill


_WARM_UP: dict[torch.device, torch.cuda.Stream] = {}


def _warm_up_stream(device: torch.device) -> torch.cuda.Stream:
    """One stream per device for the warm-up before a capture: cuBLAS keeps a workspace per (handle, stream) for
    the process's life, so a new stream per capture left one behind each time (32 MiB; a `rollout.offload` run
    captures again every rollout, a server every new shape)."""
    if device not in _WARM_UP:
        _WARM_UP[device] = torch.cuda.Stream(device)
    return _WARM_UP[device]


class GraphDecode(EagerDecode):
    """The same forward captured once as a CUDA graph for its (rows, length) and replayed every step: one
    launch instead of a few per layer, the same kernels on the same shapes, so the same bits as
    `EagerDecode` (tests/gpu/test_engine_cuda.py). Inputs are copied into the graph's own tensors and the
    logits it returns are a copy (the next replay overwrites its output). Reused chunk after chunk: `claim`
    zeroes its store (a store's unwritten columns are zeros, as a fresh one's) and marks it taken until
    `release`, so two interleaved generations never share one."""

    def __init__(self, engine: Engine, rows: int, length: int):
        super().__init__(engine, rows, length)
        device = engine.device
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.mask = torch.ones(rows, 1, 1, length, dtype=torch.bool, device=device)
        side = _warm_up_stream(torch.device(device))
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # lazy set-ups (cuBLAS handles, workspaces) happen here, not in the capture
            for _ in range(2):
                engine.forward_logits(self.tokens, self.positions, self.kv, self.mask)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # The graph's forward writes every tensor it reads, as the eager forward does (tests/gpu/test_engine_cuda.py
        # holds their bits equal), so its capture leaves deterministic mode's fills out.
        with without_nan_fill(), torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.logits = engine.forward_logits(self.tokens, self.positions, self.kv, self.mask)
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


GROUPED = "rlbench_grouped"  # the batched path's attention on a GPU (registered with transformers on first use)


def grouped_attention(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor,
    scaling: float,
    **_,
) -> tuple[torch.Tensor, None]:
    """Attention for the batched path's forwards on a GPU, registered with transformers as `rlbench_grouped`.
    SDPA with a mask does not take grouped keys (GQA): transformers copies every key/value head to each of its
    query heads first, the whole cache twice a layer at each decode step. Here each key/value head's query heads
    are the rows of one matrix product over that head's cache, read once: scores [rows x kv heads, group x q,
    length], the mask, a float32 softmax cast back (transformers' eager attention's arithmetic), times the values.
    Each row is its own slices of batched matrix products of fixed shapes: batch invariance holds as before."""
    rows, heads, q, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    group = heads // kv_heads  # query head h reads key/value head h // group, as transformers' repeat_kv pairs them
    scores = (
        torch.bmm(
            query.reshape(rows * kv_heads, group * q, dim), key.reshape(rows * kv_heads, length, dim).transpose(1, 2)
        )
        * scaling
    )
    visible = (
        attention_mask[:, None].expand(rows, kv_heads, group, q, length).reshape(rows * kv_heads, group * q, length)
    )
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1, dtype=torch.float32)
    out = torch.bmm(weights.to(value.dtype), value.reshape(rows * kv_heads, length, dim))
    return out.view(rows, heads, q, dim).transpose(1, 2).contiguous(), None


def fusable_norms(model: torch.nn.Module) -> list[torch.nn.Module]:
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
            if kind not in FUSED_KINDS.values():
                module.__class__ = FUSED_KINDS.setdefault(kind, type(kind.__name__, (kind,), {"forward": _norm}))
            module.fused = getattr(module, "fused", False)
            norms.append(module)
    return norms


def _norm(self, hidden: torch.Tensor) -> torch.Tensor:
    if not self.fused:
        return super(type(self), self).forward(hidden)
    return torch.rms_norm(hidden, (hidden.shape[-1],), self.weight, self.variance_epsilon)


FUSED_KINDS: dict[type, type] = {}  # transformers' RMSNorm class -> its subclass with a fused path


def register_grouped() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(GROUPED, grouped_attention)


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
