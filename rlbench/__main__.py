"""`python -m rlbench`: the same as the `rlbench` console script."""

from rlbench.cli import main

main()
