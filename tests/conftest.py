"""Suite-wide options: tests marked slow run only with SLOW=1; GPU tests skip without CUDA."""

from __future__ import annotations

import os

# Sleeping OpenMP waiters: spinning barriers stall ~30x when the suite shares cores with other
# processes (the verifier threads, llama.cpp). Must be set before torch loads its OpenMP runtime.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest

# The Triton kernels' CPU tests run in Triton's interpreter, which must be chosen before anything
# imports triton; without CUDA it is the only way Triton runs. Never forced where CUDA is present.
try:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    slow_on = os.environ.get("SLOW", "") not in ("", "0")
    skip_slow = pytest.mark.skip(reason="slow test: run with SLOW=1")
    gpu = False
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        pass
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "slow" in item.keywords and not slow_on:
            item.add_marker(skip_slow)
        if ("gpu" in item.keywords or "cuda" in item.keywords) and not gpu:
            item.add_marker(skip_gpu)
