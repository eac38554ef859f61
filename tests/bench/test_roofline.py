"""bench.kernels.roofline's arithmetic and the kernel's two probes: the read touches every byte once (its
sum is the buffer's sum of 64-bit words), the integer step counts the multiply-adds it did, and a
timed part's figures are its bytes and multiply-adds over its time."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.kernels.roofline import _measures
from treespec_kernels import quant_matmul as qm


def test_a_parts_figures_follow_from_its_bytes_work_and_time() -> None:
    roofs = {"bandwidth_gb_s": 20.0, "peak_gops": 200.0}
    got = _measures(0.01, 100_000_000, 500_000_000, roofs)  # 10 ms, 100 MB, 0.5 G multiply-adds
    assert got["ms"] == 10.0 and got["gb_s"] == 10.0 and got["gops"] == 100.0
    assert got["bandwidth_share"] == 0.5 and got["compute_share"] == 0.5 and got["ops_per_byte"] == 10.0


def test_the_probes_read_every_byte_and_count_the_work() -> None:
    mod = qm.load()
    if mod is None:
        pytest.skip(f"the kernel is not available: {qm.error()}")
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 64 * 1000, dtype=np.uint8)
    want = int(data.view(np.int64).sum())  # wraps like the kernel's 64-bit lanes
    assert int(mod.stream_read(torch.from_numpy(data))) == want
    per_round = 8 * (64 if "avx512" in qm.simd() else 32 if "avx2" in qm.simd() else 0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert int(mod.int_peak(1000)) == 1000 * per_round
    finally:
        torch.set_num_threads(before)
