"""The K types' packed path (csrc/quant_packed.h): weights repacked once at load, sixteen outputs a
vector and the activation rows broadcast. It must give the bits of every other path and of the
torch reference at every row count, chunk shape and thread count; refuse a packed tensor that is
not the matrix's; and do its work once per chunk of eight rows, read from the kernel's counters."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from shared.model.quantized import QuantMatrix, QuantPart
from tests.treespec_kernels.test_quant_matmul import _hostile, random_blocks
from treespec_kernels import quant_matmul as qm

pytestmark = pytest.mark.skipif(qm.load() is None, reason=f"quant_matmul kernel not built: {qm.error()}")


def _needs_packing() -> None:
    if "avx512-vnni" not in qm.simd():
        pytest.skip(f"no AVX-512 VNNI on this CPU (paths: {qm.simd()}): no packed path")


@pytest.fixture
def packed_rows() -> Iterator[None]:
    """The packed path's row counts and AMX's threshold, restored after the test."""
    before, amx = qm.packed_rows(), qm.amx_min_rows()
    yield None
    qm.set_packed_rows(*before)
    qm.set_amx_min_rows(amx)


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_the_packed_weights_give_the_same_bits_as_every_other_path(name: str, packed_rows: None) -> None:
    """Every row count 1..17 and 24 (one to three chunks of up to eight rows), outputs past the last
    multiple of 16 (run on the blocks), an all-zero super-block and activations at +-127: bit for
    bit the torch reference, the unpacked paths, and the same row alone; on one and two threads."""
    _needs_packing()
    q = qm.qtype(name)
    w, x = _hostile(q, 37, 24, seed=53)
    p = qm.pack(w, q, x.shape[1])
    assert p is not None and p.shape == (2, 3 * (2368 if name == "Q4_K" else 3392))
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for rows in [*range(1, 18), 24]:
                got = qm.quant_matmul(x[:rows], w, q, p)
                assert torch.equal(got, qm.reference_quant_matmul(x[:rows], w, q)), (rows, n_threads)
                assert torch.equal(got, qm.quant_matmul(x[:rows], w, q)), (rows, n_threads)
            alone = qm.quant_matmul(x[5:6], w, q, p)
            assert torch.equal(alone, qm.quant_matmul(x, w, q, p)[5:6])
    finally:
        torch.set_num_threads(threads)
    qm.set_packed_rows(0, 0)  # off: the packed tensor is ignored, the blocks give the same bits
    assert torch.equal(qm.quant_matmul(x[:9], w, q, p), qm.reference_quant_matmul(x[:9], w, q))


def test_packed_and_unpacked_parts_stack_as_each_alone() -> None:
    """A fused projection may mix packed K-type parts with parts the kernel cannot pack (Q8_0, fewer
    than 16 outputs): column for column each part's own product; `QuantMatrix.packed` keeps the
    bits of the matrix it packs."""
    _needs_packing()
    n = 512
    parts = [
        QuantPart(qm.qtype(name), random_blocks(qm.qtype(name), out, n, seed=out))
        for name, out in (("Q4_K", 48), ("Q6_K", 32), ("Q8_0", 5), ("Q4_K", 3))
    ]
    m = QuantMatrix(parts, n)
    pm = m.packed()
    assert [p.packed is not None for p in pm.parts] == [True, True, False, False]
    assert pm.packed_nbytes == 3 * 2 * 2368 + 2 * 2 * 3392
    for rows in (1, 4, 11):
        x = torch.randn(rows, n, generator=torch.Generator().manual_seed(rows)) * 2
        assert torch.equal(pm.linear(x), m.linear(x)), rows
    assert pm.packed().parts[0].packed is pm.parts[0].packed  # packed once


def test_a_packed_tensor_that_is_not_the_matrixs_is_refused(packed_rows: None) -> None:
    _needs_packing()
    q = qm.qtype("Q4_K")
    w = random_blocks(q, 32, 512, seed=3)
    other = qm.pack(random_blocks(q, 48, 512, seed=4), q, 512)
    x = torch.randn(2, 512)
    with pytest.raises(RuntimeError, match=r"must be pack_k's \[2, 4736\] uint8 for this matrix"):
        qm.quant_matmul(x, w, q, other)
    with pytest.raises(ValueError, match="one packed tensor"):
        qm.quant_matmul_parts(x, [w], [q], [None, None])
    with pytest.raises(ValueError, match="give 0 \\(never\\) or 1 <= lo <= hi"):
        qm.set_packed_rows(3, 2)
    assert qm.pack(random_blocks(qm.qtype("Q8_0"), 32, 512, seed=5), qm.qtype("Q8_0"), 512) is None
    assert qm.pack(random_blocks(q, 15, 512, seed=6), q, 512) is None  # under one group of 16


def test_the_packed_path_does_its_work_once_per_chunk_of_eight_rows(packed_rows: None) -> None:
    """From the kernel's own counters, not wall-clock time: the packed weights are split into
    nibbles once per chunk of up to eight rows, the dot products grow with the rows, and no row
    count does more work of any kind than the next."""
    _needs_packing()
    q = qm.qtype("Q4_K")
    out_f, n_in = 32, 512
    w = random_blocks(q, out_f, n_in, seed=7)
    p = qm.pack(w, q, n_in)
    qm.set_packed_rows(1, 1 << 20)
    qm.set_amx_min_rows(0)  # where AMX runs, its tiles would take the larger row counts
    work = []
    for rows in range(1, 34):
        x = torch.randn(rows, n_in, generator=torch.Generator().manual_seed(rows))
        with qm.counting_work() as seen:
            qm.quant_matmul(x, w, q, p)
            done = seen()
        assert done.unpacks == -(-rows // 8) * out_f * (n_in // 256), (rows, done)
        assert done.dots == rows * out_f * (n_in // 256), (rows, done)
        work.append((done.unpacks, done.dots, done.reductions))
    for now, more in itertools.pairwise(work):
        assert all(a <= b for a, b in zip(now, more, strict=True)), (now, more)


def _with_packed_rows(text: str) -> subprocess.CompletedProcess[str]:
    code = "from treespec_kernels import quant_matmul as qm; print(qm.packing(), qm.packed_rows())"
    env = {**os.environ, qm.PACKED_ENV: text}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_the_packed_rows_come_from_the_environment() -> None:
    assert _with_packed_rows("0").stdout.split()[0] == "False"
    assert _with_packed_rows("2-8").stdout.strip() == "True (2, 8)"
    bad = _with_packed_rows("some")
    assert bad.returncode != 0 and "TREESPEC_PACKED_ROWS='some': give LO-HI" in bad.stderr
