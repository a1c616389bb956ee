"""Backends behind the Protocols of rlbench/core/protocols.py, imported only when chosen.

hf_engine.py      embedded rollout engine: fixed-shape batched decoding (or per-sample), with a KV cache
engine_numerics.py  the engine's dtype and fp8 weights (slime's block-wise e4m3) where they differ from the trainer's
engine_memory.py  `rollout.offload`: the engine's GPU memory let go of between rollouts (slime's --offload-rollout)
batched_forward.py  the engine's decode forwards: its own KV store, eager or replayed as CUDA graphs
prompt_cache.py   prompt prefills kept between generations (`rlbench serve`'s prefix cache)
batch_variant.py  faults planted on purpose: the batched decode split by the batch's size, or at a reused prefix
sampling.py       its token choice: Gumbel-max over counter-based noise, top-k / top-p (SGLang's semantics)
sampling_triton.py  that choice as one Triton kernel on a GPU (rows that are not top-k/top-p filtered)
torch_trainer.py  embedded trainer: the transformers model, AdamW, minibatches, micro-batches, checkpoints
critic_trainer.py  PPO's critic (issue 56): the torch trainer's machinery on the clipped value loss
master_weights.py  fp32 master weights and their gradients, on the device or in host memory (CPU offload)
optimizer_state.py  AdamW's groups and state by parameter name (both trainers' checkpoints)
registry.py       which trainer and engine a run needs (installed extras, Ray bundles), and how to make them
megatron/         `--trainer megatron`: a megatron-core GPTModel, tensor and data parallel
sglang/           `--rollout sglang`: SGLang servers over their native HTTP API, through sglang-router
"""
