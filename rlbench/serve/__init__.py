"""`rlbench serve`: the embedded engine behind SGLang's native HTTP API, so that sglang-router and
rlbench's SGLang client (and anyone's) can talk to it as to an SGLang server. CPU CI runs it as
the SGLang workers; on a laptop it stands in for a GPU fleet.

    worker.py   one thread runs the engine; concurrent /generate calls are decoded as one batch
    app.py      the Starlette routes: /generate, /health*, /server_info, /model_info, weights, /flush_cache
    server.py   ServeConfig, the model and engine it loads, binding (127.0.0.1 by default) and uvicorn
"""
