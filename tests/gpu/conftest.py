"""GPU tests run only where CUDA is: CI has no GPU, so they skip there, saying why."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA device; run bench/gpu_check.sh on a GPU machine")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.cuda)
            if not torch.cuda.is_available():
                item.add_marker(skip)
