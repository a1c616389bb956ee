"""Files the README's "Using it" commands name; tests/cpu/test_readme_examples.py runs every one."""
