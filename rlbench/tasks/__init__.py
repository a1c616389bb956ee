"""Tasks beyond the default single-turn one: their generate functions, tools and verifiers."""
