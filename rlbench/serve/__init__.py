"""`rlbench serve`: the embedded engine behind SGLang 0.5.23's native HTTP API, so that sglang-router
and rlbench's SGLang client (and anyone's) can talk to it as to an SGLang server. CPU CI runs it as the
SGLang workers; on a laptop it stands in for a GPU fleet. What it cannot do is refused in SGLang's own
error shape and listed in docs/sglang-ray.md.

    request_gates.py  /generate's first two checks (pydantic's lax envelope, the strict API contract) and
                      the three error shapes every check answers in
    request.py        its third check (values, limits, what rlbench serve cannot do) and the checked call
    worker.py         the scheduler: one engine thread, batches decoded a token at a time in turns, abort/pause
    answer.py         the /generate answer: meta_info, finish reasons, log-prob layouts, stream chunks
    weights.py        weight loads (all or nothing) and SGLang's /weights_checker
    pull.py           slime's /pull_weights: a host-local checkpoint brought to a published (delta) version
    auth.py           --api-key: SGLang's 401 for a request without the key, before any route
    app.py            the routes, request bodies (bounded, JSON), the error handlers
    bodies.py         what the routes share: a body's fields held to their kinds, readable paths, JSON answers
    server.py         ServeConfig, the model and engine it loads, binding (127.0.0.1 by default) and uvicorn
"""
