"""rlbench: a reproducibility and debugging workbench for the LLM RL post-training loop.

Importing it pins the portable CPU numerics before anything imports torch (numerics.py).

    config.py     the run configuration: RunConfig, read from TOML and overrides, validated
    config_sections.py  its components, one frozen dataclass each (model, data, reward, algorithm, trainer), and
                  `setting`, the field with its help
    config_rollout.py  its rollout component: the engine, sampling, its numerics, the SGLang servers, the sync
    config_placement.py  its placement component (local or Ray actors) and how a Ray address is read
    config_tracking.py  where metrics are also logged: W&B and TensorBoard, with slime's arguments
    validate.py   the value checks every config shares: a failing value is BadInput naming its key
    slime_args.py slime's own command-line arguments mapped onto the run config (`rlbench run <slime args>`)
    command.py    a command line to its RunConfig (options, the TOML file, slime's arguments, --sglang-*,
                  train-only): the one function `rlbench run` calls before it runs
    errors.py     BadInput and the other typed errors, each with its exit code
    keys.py       the API keys' environment variables: the client's and `rlbench serve`'s, distinct
    numerics.py   portable CPU numerics: pinned before torch initialises, read back for the manifest
    __main__.py   `python -m rlbench`: the same as the `rlbench` console script
    extras.py     the optional packages (serve, browser, ...): whether each is installed, and the one line
                  naming the extra when one is needed
    session.py    a run assembled and driven: `build` (inputs checked, backends made here or as Ray actors,
                  the manifest) and `run` (the steps in order); above core/, backends/ and placement/
    slime_rollout.py  slime plugins under `rlbench run`: slime's generate and reward functions against the
                  run's engine behind /generate, their samples held to its request log; beside session.py
    testing.py    rlbench for a team's own tests: run a config, and each verdict as an assertion whose message is
                  the command line's text
    pytest_plugin.py  the pytest plugin the package registers (pytest11): fixtures rlbench_run and golden, and
                  --rlbench-update-golden; loading it pins the numerics before a test imports torch
    cli/          the `rlbench` command line: the only package that prints; errors -> exit codes
    core/         the loop's stages (one function each) and what they read (Context), the backend
                  protocols, seeding, data, rewards, the RL algorithm
    backends/     the rollout engines and trainers behind core/protocols.py, imported only when chosen
    placement/    where a run's pieces run: in-process, or as Ray actors (`--placement ray`)
    rundir/       the run directory's storage: atomic writes, the step commit, recordings, digests, the lock
    replay/       replay, resume, diff and the slime import, built on core/ and rundir/
    checks/       check tito / logprobs / golden, and the golden files
    report/       `rlbench report`: a run (or two) as one self-contained HTML page, with every verdict
    tasks/        tasks beyond the default one: the multi-turn calculator
    serve/        `rlbench serve`: the embedded engine behind SGLang's native HTTP API
    fixtures/     the tiny model's config, the tokenizers and the datasets a plain install runs with;
                  build.py makes them offline
"""

from rlbench import numerics as _numerics

# Before anything imports torch: the CPU settings that make a run's bits portable (numerics.py).
_numerics.pin()

__version__ = "0.1.0"
