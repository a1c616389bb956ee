"""`--rollout sglang`: rollouts from SGLang servers over SGLang's native HTTP API, through
sglang-router (or straight to the servers), imported only when chosen.

    wire.py      the /generate request and response, both sides: what the client sends, what a server accepts
    client.py    the async HTTP client: bounded in-flight requests, timeouts, retries on another engine
    fleet.py     the servers and the router: external addresses, or processes rlbench starts and stops
    engine.py    the RolloutEngine over them: generate, weight sync from disk, the weights' checksums
"""
