"""GPU tests: every test here needs CUDA and carries the `gpu` marker; elsewhere they skip."""

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    # The hook sees every collected item (tests/cpu too, when both are run): mark only ours.
    for item in items:
        if HERE not in Path(str(item.path)).resolve().parents:
            continue
        item.add_marker(pytest.mark.gpu)
        if not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
