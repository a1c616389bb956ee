"""Checks over run directories (tito, logprobs, golden); each arrives with its issue."""
