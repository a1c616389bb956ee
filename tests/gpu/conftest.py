"""GPU tests: every test here needs CUDA and carries the `gpu` marker; elsewhere they skip."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.gpu)
        if not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
