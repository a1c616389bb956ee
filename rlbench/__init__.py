"""rlbench: a reproducibility and debugging workbench for the LLM RL post-training loop."""

from rlbench import numerics as _numerics

# Before anything imports torch: the CPU settings that make a run's bits portable (numerics.py).
_numerics.pin()

__version__ = "0.1.0"
