"""The megatron trainer's reference runs, made once per test session whichever xdist workers ask
for them: TP=1 in-process and TP=2 over rank processes (`rlbench run --tp 2`), of one small config.
test_megatron_parallel.py compares other layouts with them; test_ray_placement.py holds
`--placement ray` to the TP=2 run."""

from __future__ import annotations

import fcntl
from pathlib import Path

from rlbench.config import apply_overrides, load_config
from rlbench.session import run
from tests.conftest import RANDOM_INIT_MODEL, run_cli

# An entropy term of weight 1 keeps every minibatch's loss near -log(vocabulary) (about -5.7), far from 0,
# and a dense reward (the response's length) gives the policy term a gradient at every step. A GRPO loss
# alone is -mean(ratio x advantage) with advantages zero-mean per group: it nearly cancels, and a relative
# tolerance on it measures rounding noise (a TP gap of 3e-7 on a loss of 0.09 is 3e-6 relative; a policy
# term of 0.58 less 0.1 x entropy 5.7 cancels the same way).
# That entropy is random weights': the fixture model drawn from the seed, pinned with the lr and the absence of a
# KL term the runs had as defaults before issue 52 (from the warm-started default policy, entropy about 0.2, the
# float32 TP=2 run parts from TP=1 by 1.4e-6 relative, past the 1e-6 test_megatron_parallel.py holds them to).
STEPS = 10
TOML = f"""seed = 7
steps = {STEPS}
checkpoint_every = 2
[model]
path = '{RANDOM_INIT_MODEL}'
init = "random"
[data]
prompts_per_step = 2
[rollout]
n_samples_per_prompt = 4
[reward]
custom_rm_path = "tests.cpu.plugins.rewards.response_length"
[algo]
entropy_coef = 1.0
kl_coef = 0.0
[train]
backend = "megatron"
lr = 1e-3
minibatches = 2
micro_batch_size = 3
"""


def run_process(root: Path, name: str, *args: str):
    """`rlbench run` of root/s.toml into root/name, in a process of its own: rank 0 holds a gloo
    group with its workers, and a failpoint may kill it."""
    return run_cli("run", "-c", str(root / "s.toml"), "--out", str(root / name), "--json", *args, process=True)


def made_once(tmp_path_factory, worker_id: str, name: str, make) -> Path:
    """A directory shared by the session's xdist workers, filled by `make(root)` by the first to ask (pytest-xdist's
    recipe: a lock file in the directory the workers share, and a mark once it is complete)."""
    base = tmp_path_factory.getbasetemp()
    root = (base if worker_id == "master" else base.parent) / name
    root.mkdir(exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / ".done").exists():
            make(root)
            (root / ".done").touch()
    return root


def reference_runs(tmp_path_factory, worker_id: str) -> Path:
    """The directory holding s.toml (TOML) and its runs tp1 and tp2, made on first use."""

    def make(root: Path) -> None:
        (root / "s.toml").write_text(TOML)
        run(apply_overrides(load_config(root / "s.toml"), out=str(root / "tp1")))  # in-process: one rank
        res = run_process(root, "tp2", "--tp", "2")
        assert res.returncode == 0, res.stderr

    return made_once(tmp_path_factory, worker_id, "megatron-parallel", make)
