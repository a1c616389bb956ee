"""Where a run's pieces run: in-process by default, or as Ray actors.

ray.py          `--placement ray`: the trainer's ranks and the rollout engines as Ray actors in one
                placement group (imported only then)
ray_actors.py   the actors themselves (trainer, megatron ranks, engine, SGLang server) and what crosses
                between them and the driver
ray_connect.py  starting a local Ray on 127.0.0.1, or reaching a cluster within --ray-timeout
"""
