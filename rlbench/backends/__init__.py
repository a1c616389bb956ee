"""Backends behind the Protocols of rlbench/core/protocols.py, imported only when chosen.

    hf_engine.py      embedded rollout engine: fixed-shape batched decoding (or per-sample), with a KV cache
    sampling.py       its token choice: Gumbel-max from per-request noise, top-k / top-p (SGLang's semantics)
    torch_trainer.py  embedded trainer: the transformers model, AdamW, minibatches, micro-batches, checkpoints
    registry.py       which trainer and engine a run needs (installed extras, Ray bundles), and how to make them
    megatron/         `--trainer megatron`: a megatron-core GPTModel, tensor and data parallel
    sglang/           `--rollout sglang`: SGLang servers over their native HTTP API, through sglang-router
"""
