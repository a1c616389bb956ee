"""The team's code under test: a reward function and a chat template (tokenizer/)."""
