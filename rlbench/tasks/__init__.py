"""Tasks beyond the default single-turn one: their generate functions, tools and verifiers.

calculator.py  a multi-turn task with a calculator tool; token-in-token-out and naive trajectory builders
"""
