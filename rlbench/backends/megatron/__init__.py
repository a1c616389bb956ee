"""The megatron trainer (`--trainer megatron`): megatron-core GPTModel, tensor and data parallel.

    model.py    the GPTModel and its TransformerConfig from the Hugging Face config; [train.megatron] passes through
    settings.py the [train.megatron] table checked before any rank starts: keys, types, precision for the device
    convert.py  weights between Hugging Face names and Megatron shards, both ways (fused QKV, gate/up)
    compat.py   the CPU compatibility layer: megatron-core's CUDA-only calls redirected, only on the CPU
    trainer.py  the Trainer (rank 0) and each rank's shard: DDP, finalised grads, checkpoints with a layout
    critic.py   PPO's critic on each rank beside the actor (a one-output head), and rank 0's handle on it
    launch.py   the worker ranks rlbench starts itself (processes, or Ray actors), and rank 0's commands
    worker.py   a worker rank (ranks 1..): it joins rank 0, then runs rank 0's commands
    faults.py   deliberate faults (and a rank killed at a named command), for the tests that prove the checks can fail

Imported only when chosen (`[train] backend = "megatron"`); needs `pip install '.[megatron]'`.

megatron-core is pinned to 0.16.x, not the newest (0.19): from 0.17 on it ships compiled cp312
wheels only, and this project's CPU machines run Python 3.11 (the CPU torch wheel is cp311).
0.16.1 is the newest release that installs here; the GPU host (Python 3.12) takes its cp312 wheel.
"""
