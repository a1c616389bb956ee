"""rlbench: a reproducibility and debugging workbench for the LLM RL post-training loop."""

__version__ = "0.1.0"
