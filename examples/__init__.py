"""Files the commands of docs/usage.md name; tests/cpu/test_readme_examples.py runs every one."""
