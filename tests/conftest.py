"""Suite-wide options: tests marked slow run only with SLOW=1; GPU tests skip without CUDA."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

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


@pytest.fixture(autouse=True)
def _no_log_handler_outlives_its_test() -> Iterator[None]:
    """Code under test may set up logging for a whole process (`logs.setup` in `serve`, uvicorn's
    default config): a StreamHandler it adds is bound to this test's captured stderr, which is
    closed afterwards, and every later record through it prints a "Logging error" traceback into
    whichever test runs then. Remove such handlers and restore the levels when the test ends."""
    names = ("", "uvicorn", "uvicorn.error", "uvicorn.access")
    before = {n: (list(logging.getLogger(n).handlers), logging.getLogger(n).level) for n in names}
    yield
    for n, (handlers, level) in before.items():
        lg = logging.getLogger(n)
        for h in list(lg.handlers):
            if type(h) is logging.StreamHandler and h not in handlers:
                lg.removeHandler(h)
        lg.setLevel(level)
