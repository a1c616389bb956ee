"""The API keys' environment variables, one module for both sides (distinct names, distinct variables):

- CLIENT_API_KEY_ENV (RLBENCH_SGLANG_API_KEY): the key a run's SGLang client sends to the engines and router it
  talks to (`Authorization: Bearer`), and hands to the `rlbench serve` workers it starts;
- SERVE_API_KEY_ENV (RLBENCH_SERVE_API_KEY): the key `rlbench serve` requires of every request; how a launcher
  hands it over (a command line is visible to every user of the machine).

Neither value is ever printed or reported.
"""

from __future__ import annotations

import os

CLIENT_API_KEY_ENV = "RLBENCH_SGLANG_API_KEY"
SERVE_API_KEY_ENV = "RLBENCH_SERVE_API_KEY"


def client_api_key() -> str | None:
    """The key a run's client sends (CLIENT_API_KEY_ENV), or None when unset or empty."""
    return os.environ.get(CLIENT_API_KEY_ENV) or None
