"""`python -m rlbench.cli`: the same as the `rlbench` console script."""

from rlbench.cli import main

main()
