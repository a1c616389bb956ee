"""Backends behind the Protocols of rlbench/core/protocols.py, imported only when chosen.

    hf_engine.py      embedded rollout engine: the transformers model, decoding in-process
    torch_trainer.py  embedded trainer: the transformers model and AdamW
"""
