"""The rollout section of a run's configuration (config_sections.py holds the others): the engine, its sampling
parameters, its numerics where they differ from the trainer's on purpose, the SGLang servers and the weight sync."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from rlbench.config_sections import OWNED, setting
from rlbench.validate import check, normalize_url, number, text


@dataclass(frozen=True)
class RolloutConfig:
    """The rollout engine and its sampling parameters. `hf`: the embedded engine, in-process.
    `sglang`: SGLang servers over HTTP (rlbench/backends/sglang/): an existing router
    (`sglang_router_url`), servers someone else runs (`external_engine_addrs`, with a router rlbench
    starts in front), or `num_engines` servers rlbench starts (`sglang_server`: sglang's own, or
    `rlbench serve`) with `[rollout.sglang]` / `--sglang-*` passed through to them."""

    backend: Literal["hf", "sglang"] = setting(
        "hf",
        "Rollout engine. hf: embedded transformers, in-process. sglang: SGLang servers over their native HTTP API, "
        "through sglang-router (pip install '.[router]').",
    )
    n_samples_per_prompt: int = 4
    max_new_tokens: int = 4  # the warm-started fixture answers "65 odd": 3 tokens and its stop token
    temperature: float = 1.0
    top_k: int = -1  # SGLang's sampling_params.top_k: -1 (or 0) = every token
    top_p: float = 1.0  # SGLang's sampling_params.top_p: 1.0 = every token
    stop_token_ids: tuple[int, ...] = ()  # stops besides the tokenizer's eos (slime --rollout-stop-token-ids)
    # The embedded engine's decode: "batched" (fixed-shape buckets) or "per-sample" (the reference,
    # one request at a time); both are batch-invariant (rlbench/backends/hf_engine.py).
    decode: Literal["batched", "per-sample"] = "batched"
    decode_batch_size: int = 64  # rows of every batched decode forward (fixed: padding fills it)
    cuda_graphs: bool = setting(
        True,
        "The embedded engine on a GPU: each batched decode forward is captured once per shape as a CUDA graph and "
        "replayed (one launch a token instead of a few a layer; the same kernels, so the same bits). false: launched "
        "kernel by kernel. No effect on the CPU.",
    )
    offload: bool = setting(
        False,
        "hf: the engine lets go of its GPU memory after each rollout (slime's --offload-rollout): its weights to host "
        "memory, its KV caches, graphs and prompt cache freed; back on its next use. The same bits.",
    )
    sampling_seed: int | None = None  # slime's --rollout-seed: samples draw from it instead of the master seed
    # Report each token's log-prob from a teacher-forced forward of the whole sequence at batch
    # size 1, the forward the trainer's logprob stage then also uses: equal bits on both sides.
    true_on_policy: bool = False
    dtype: Literal["float32", "bfloat16", "float64"] | None = setting(
        None,
        "hf: the engine's dtype, its weights cast to it and computed in it (SGLang's --dtype); unset: the model's "
        "(model.dtype), the trainer's.",
    )
    quantization: Literal["none", "fp8"] = setting(
        "none",
        "hf: fp8: the engine holds the decoder layers' projection weights quantized as slime's fp8 rollouts quantize "
        "them (block-wise e4m3, 128 x 128 blocks with scales), dequantized where the hardware has no fp8 matmul.",
    )
    logprobs: Literal["full", "filtered"] = setting(
        "full",
        "hf: the log-prob the engine reports. full: log_softmax(logits / T) at the sampled token, the trainer's. "
        "filtered: renormalised over the tokens top-k and top-p keep (an engine that reports its sampling "
        "distribution's; slime's trainer renormalises the same way under --rollout-top-p).",
    )
    batch_invariant: bool = setting(
        True,
        "hf: false makes the batched decode's log-probs depend on how many requests share a forward, as a "
        "batch-variant GPU kernel does (for testing checks: `check logprobs --attribute`, `check engine`).",
    )
    prefix_invariant: bool = setting(
        True,
        "hf: false makes the batched decode attend over the prompt it reuses apart from the tokens after it, the two "
        "merged by their log-sum-exp, as an engine's attention over a prefix-cache hit does without deterministic "
        "inference: other bits than one forward over the sequence (for testing `check logprobs --attribute`).",
    )
    custom_generate_function_path: str | None = setting(
        None,
        "Custom generate function by dotted path: slime's async generate(args, sample, sampling_params) (run against "
        "the engine behind SGLang's /generate, docs/usage.md \"Your slime plugins\"), or rlbench's "
        "fn(env, prompt, prompt_ids, seed) -> Trajectory.",
    )
    sglang_server_concurrency: int = setting(
        512, "slime's --sglang-server-concurrency: slime plugins generating at once (per engine of one GPU)."
    )
    sglang_router_url: str | None = setting(
        None, "sglang: an sglang-router someone else runs (its servers: GET /workers); rlbench starts nothing."
    )
    external_engine_addrs: tuple[str, ...] = setting(
        (),
        "sglang: servers rlbench does not own, host:port[,host:port...]; rlbench starts sglang-router in front of "
        "them.",
    )
    num_engines: int = setting(1, "sglang: how many servers rlbench starts (and stops), behind a router it starts.")
    sglang_server: Literal["sglang", "rlbench"] = setting(
        "sglang",
        "sglang: what rlbench starts. sglang: python -m sglang.launch_server (every other --sglang-KEY VALUE is "
        "passed to it as --KEY VALUE). rlbench: rlbench serve, the embedded engine behind the same API.",
    )
    use_router: bool = True  # false: no router; the client spreads requests over the servers and retries elsewhere
    sglang: dict = field(default_factory=dict)  # --sglang-KEY VALUE: to the servers rlbench starts, as --KEY VALUE
    max_inflight: int = 256  # requests in flight at once
    request_timeout: float = 600.0  # seconds per HTTP request
    request_attempts: int = 5  # attempts of a request before the run stops (exit 2)
    verify_engine_weights: bool = True  # the weight-update check through /weights_checker (false for SGLang's own)
    weights_dir: str | None = None  # where weight versions are written for the servers to load (default: a temp dir)
    async_mode: Literal["off", "one-step", "fully"] = setting(
        "off",
        "Generate ahead of training, deterministic by schedule. one-step: as slime's train_async "
        "(the next step generated while this one trains); fully: slime's fully-async worker bounded by max_staleness.",
    )
    max_staleness: int | None = setting(
        None, "fully: the most weight versions a trained sample may lag (0: on-policy)."
    )
    update_weights_interval: int = setting(1, "slime's --update-weights-interval: sync every N steps (async modes).")
    update_weight_mode: Literal["full", "delta"] = setting(
        "full", "sglang: each sync a full checkpoint, or slime's delta of what changed, pulled by /pull_weights."
    )
    update_weight_delta_encoding: Literal["xor", "overwrite"] = "xor"  # slime's --update-weight-delta-encoding
    update_weight_delta_checksum: Literal["xxh3-128", "blake3", "adler32"] = "xxh3-128"
    local_checkpoint_dir: str | None = None  # delta: the servers' host-local checkpoint (default: weights_dir/local)

    def __post_init__(self) -> None:
        check(self.backend in ("hf", "sglang"), "rollout.backend", "one of: hf, sglang", self.backend)
        number(self.n_samples_per_prompt, "rollout.n_samples_per_prompt", 1, 10_000, integer=True)
        number(self.max_new_tokens, "rollout.max_new_tokens", 1, 100_000, integer=True)
        number(self.temperature, "rollout.temperature", 0, 100)  # 0 = greedy
        if self.sampling_seed is not None:
            number(self.sampling_seed, "rollout.sampling_seed", 0, 2**63 - 1, integer=True)
        check(isinstance(self.true_on_policy, bool), "rollout.true_on_policy", "true or false", self.true_on_policy)
        text(self.custom_generate_function_path, "rollout.custom_generate_function_path", optional=True)
        number(self.sglang_server_concurrency, "rollout.sglang_server_concurrency", 1, 1_000_000, integer=True)
        check(
            isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and self.top_k >= -1,
            "rollout.top_k",
            "-1, 0 (both off) or a count >= 1",
            self.top_k,
        )
        number(self.top_p, "rollout.top_p", 0, 1, open_low=True)  # 1 = off
        check(
            isinstance(self.stop_token_ids, tuple)
            and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in self.stop_token_ids),
            "rollout.stop_token_ids",
            "a list of token ids",
            self.stop_token_ids,
        )
        check(self.decode in ("batched", "per-sample"), "rollout.decode", "batched or per-sample", self.decode)
        number(self.decode_batch_size, "rollout.decode_batch_size", 1, 100_000, integer=True)
        check(isinstance(self.cuda_graphs, bool), "rollout.cuda_graphs", "true or false", self.cuda_graphs)
        self._check_numerics()
        self._check_sglang()

    def _check_numerics(self) -> None:
        dtypes = ("float32", "bfloat16", "float64")
        check(
            self.dtype is None or self.dtype in dtypes,
            "rollout.dtype",
            "unset or one of " + ", ".join(dtypes),
            self.dtype,
        )
        check(self.quantization in ("none", "fp8"), "rollout.quantization", "none or fp8", self.quantization)
        check(self.logprobs in ("full", "filtered"), "rollout.logprobs", "full or filtered", self.logprobs)
        check(isinstance(self.batch_invariant, bool), "rollout.batch_invariant", "true or false", self.batch_invariant)
        check(
            isinstance(self.prefix_invariant, bool), "rollout.prefix_invariant", "true or false", self.prefix_invariant
        )
        numerics = self.dtype is not None or self.quantization != "none" or self.logprobs != "full"
        numerics = numerics or not (self.batch_invariant and self.prefix_invariant)
        check(
            self.backend == "hf" or not numerics,
            "rollout.backend",
            "hf where rollout.dtype, quantization, logprobs, batch_invariant or prefix_invariant are set (the "
            "embedded engine's)",
            self.backend,
        )
        check(
            not (self.true_on_policy and numerics),
            "rollout.true_on_policy",
            "false where the engine's numerics differ from the trainer's on purpose (rollout.dtype, quantization, "
            "logprobs, batch_invariant, prefix_invariant)",
            self.true_on_policy,
        )
        check(
            self.prefix_invariant or self.decode == "batched",
            "rollout.decode",
            "batched where rollout.prefix_invariant is false (the batched decode reuses the prompt's prefill)",
            self.decode,
        )

    def _check_sglang(self) -> None:
        text(self.sglang_router_url, "rollout.sglang_router_url", optional=True)
        check(
            isinstance(self.external_engine_addrs, tuple)
            and all(isinstance(a, str) and a and "\x00" not in a for a in self.external_engine_addrs),
            "rollout.external_engine_addrs",
            "a list of host:port addresses",
            self.external_engine_addrs,
        )
        number(self.num_engines, "rollout.num_engines", 1, 4096, integer=True)
        check(
            self.sglang_server in ("sglang", "rlbench"),
            "rollout.sglang_server",
            "sglang or rlbench",
            self.sglang_server,
        )
        check(isinstance(self.use_router, bool), "rollout.use_router", "true or false", self.use_router)
        number(self.max_inflight, "rollout.max_inflight", 1, 100_000, integer=True)
        number(self.request_timeout, "rollout.request_timeout", 0, 86_400, open_low=True)
        number(self.request_attempts, "rollout.request_attempts", 1, 100, integer=True)
        check(
            isinstance(self.verify_engine_weights, bool),
            "rollout.verify_engine_weights",
            "true or false",
            self.verify_engine_weights,
        )
        text(self.weights_dir, "rollout.weights_dir", optional=True)
        check(
            isinstance(self.sglang, dict)
            and all(
                isinstance(k, str)
                and re.fullmatch(r"[a-z0-9][a-z0-9-]*", k)
                and (
                    isinstance(v, (str, int, float, bool))
                    or (isinstance(v, list) and all(isinstance(x, (str, int, float)) for x in v))
                )
                for k, v in self.sglang.items()
            ),
            "rollout.sglang",
            "server arguments as KEY = VALUE (KEY as on the server's command line, without --)",
            self.sglang,
        )
        sglang = self.backend == "sglang"
        given = [
            name
            for name, on in (
                ("sglang_router_url", self.sglang_router_url is not None),
                ("external_engine_addrs", bool(self.external_engine_addrs)),
            )
            if on
        ]
        check(
            sglang or not given, f"rollout.{given[0] if given else ''}", "unset unless rollout.backend is sglang", "set"
        )
        check(
            len(given) < 2,
            "rollout.external_engine_addrs",
            "unset when rollout.sglang_router_url is set",
            self.external_engine_addrs,
        )
        check(
            not self.sglang or (sglang and not given),
            "rollout.sglang",
            "no server arguments unless rlbench starts the servers (rollout.backend sglang, no router url, "
            "no external addresses)",
            self.sglang,
        )
        for addr in self.external_engine_addrs:
            normalize_url(addr)
        if self.sglang_router_url is not None:
            normalize_url(self.sglang_router_url, "rollout.sglang_router_url")
        owned = [k for k in self.sglang if k in OWNED[self.sglang_server]]
        check(
            not owned,
            "rollout.sglang",
            f"no arguments rlbench sets itself ({', '.join(OWNED[self.sglang_server])})",
            owned,
        )
        check(
            not (sglang and self.true_on_policy),
            "rollout.true_on_policy",
            "false with rollout.backend sglang (the server cannot run the trainer's forward)",
            self.true_on_policy,
        )
