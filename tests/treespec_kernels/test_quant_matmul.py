"""The quantized-block projections (treespec_kernels/quant_matmul.py): every block type decodes as
gguf-py does, the kernel equals its torch reference bit for bit over many shapes, a row's result
does not depend on the rows beside it or the thread count, and the result is close to the float32
product of the dequantized matrix."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from treespec_kernels import quant_matmul as qm

pytestmark = pytest.mark.skipif(qm.load() is None, reason=f"quant_matmul kernel not built: {qm.error()}")

TYPES = sorted(qm.QTYPES)


def random_blocks(
    q: qm.QuantType, out: int, in_features: int, seed: int, scales: tuple[float, float] = (1e-4, 2e-2)
) -> torch.Tensor:
    """[out, bytes per row] uint8 of random blocks whose half-float scales are finite, drawn
    uniformly from `scales`."""
    rng = np.random.default_rng(seed)
    nblk = in_features // q.values
    raw = rng.integers(0, 256, size=(out, nblk, q.bytes), dtype=np.uint8)
    halves = {"Q8_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}[q.name]
    for at in halves:
        scale = rng.uniform(*scales, size=(out, nblk)).astype(np.float16)
        if q.name == "Q4_1" and at == 2:  # the block's minimum: either sign
            scale = np.where(rng.random((out, nblk)) < 0.5, -scale, scale).astype(np.float16)
        raw[..., at : at + 2] = scale.view(np.uint8).reshape(out, nblk, 2)
    return torch.from_numpy(raw.reshape(out, nblk * q.bytes))


def gguf_dequantize(w: torch.Tensor, q: qm.QuantType, in_features: int) -> torch.Tensor:
    arr = dequantize(w.numpy(), GGMLQuantizationType[q.name])
    return torch.from_numpy(np.ascontiguousarray(arr)).reshape(w.shape[0], in_features).float()


@pytest.mark.parametrize("name", TYPES)
def test_decoding_equals_gguf_py_dequantize(name: str) -> None:
    q = qm.qtype(name)
    n = 2 * q.values if q.values == 256 else 96
    w = random_blocks(q, 7, n, seed=1)
    want = gguf_dequantize(w, q, n)
    got = qm.dequantize_rows(w, q, n, torch.arange(7))
    assert torch.equal(got, want)
    picked = qm.dequantize_rows(w, q, n, torch.tensor([5, 0, 5]))
    assert torch.equal(picked, want[[5, 0, 5]])
    # the reference's integers times the block scales give the same matrix (to rounding)
    assert qm.reference_decode(w, q, n).shape == (7, n)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize(("rows", "out", "blocks"), [(1, 1, 1), (3, 5, 2), (16, 33, 3), (2, 64, 6)])
def test_the_kernel_equals_its_torch_reference_bit_for_bit(
    name: str, rows: int, out: int, blocks: int
) -> None:
    q = qm.qtype(name)
    n = blocks * q.values
    w = random_blocks(q, out, n, seed=rows * 100 + out)
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(out)) * 3
    x[0, : qm.QB] = 0  # an all-zero activation block (scale 0)
    got = qm.quant_matmul(x, w, q)
    want = qm.reference_quant_matmul(x, w, q)
    assert got.shape == (rows, out)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", TYPES)
def test_a_row_is_the_same_alone_among_many_and_on_any_thread_count(name: str) -> None:
    q = qm.qtype(name)
    n = 2 * 256
    w = random_blocks(q, 97, n, seed=7)
    x = torch.randn(24, n, generator=torch.Generator().manual_seed(3))
    many = qm.quant_matmul(x, w, q)
    threads = torch.get_num_threads()
    try:
        for t in sorted({1, threads}):
            torch.set_num_threads(t)
            for r in (0, 5, 23):
                assert torch.equal(qm.quant_matmul(x[r : r + 1], w, q), many[r : r + 1])
            assert torch.equal(qm.quant_matmul(x[3:11], w, q), many[3:11])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("name", TYPES)
def test_the_result_is_close_to_the_float32_product_of_the_dequantized_matrix(name: str) -> None:
    q = qm.qtype(name)
    n = 4 * 256
    w = random_blocks(q, 40, n, seed=11)
    x = torch.randn(6, n, generator=torch.Generator().manual_seed(5))
    exact = x.double() @ gguf_dequantize(w, q, n).double().T
    got = qm.quant_matmul(x, w, q).double()
    rel = (got - exact).norm() / exact.norm()
    assert rel < 0.02, f"{name}: relative error {rel:.4f} of the int8 activations is too large"


def test_activation_rule_matches_the_reference_and_is_per_row() -> None:
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(0)) * 10
    x[2] = 0
    xq, dx, sx = qm.quantize_rows(x)
    rq, rd, rs = qm.reference_quantize_rows(x)
    assert torch.equal(xq, rq) and torch.equal(dx, rd) and torch.equal(sx, rs)
    assert int(xq.abs().max()) <= 127 and bool((dx[2] == 0).all()) and bool((xq[2] == 0).all())
    alone = qm.quantize_rows(x[3:4])
    assert torch.equal(alone[0], xq[3:4]) and torch.equal(alone[1], dx[3:4])
    wide = torch.randn(3, 512, generator=torch.Generator().manual_seed(1)) * 5
    got, want = qm.quantize_rows(wide, 256), qm.reference_quantize_rows(wide, 256)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert got[1].shape == (3, 2) and got[2].shape == (3, 16)  # a scale per 256, a sum per 32


def test_bad_input_is_refused_with_the_reason() -> None:
    q = qm.qtype("Q4_K")
    w = random_blocks(q, 4, 256, seed=0)
    with pytest.raises(RuntimeError, match="multiple of 256"):
        qm.quant_matmul(torch.zeros(1, 128), w[:, :72].contiguous(), q)
    with pytest.raises(RuntimeError, match="holds 144 bytes"):
        qm.quant_matmul(torch.zeros(1, 256), w[:, :100].contiguous(), q)
    with pytest.raises(RuntimeError, match="out of range"):
        qm.dequantize_rows(w, q, 256, torch.tensor([4]))
    with pytest.raises(ValueError, match="one of"):
        qm.qtype("Q3_K")
    with pytest.raises(ValueError, match="multiple of 32"):
        qm.row_bytes(qm.qtype("Q8_0"), 48)


@pytest.mark.parametrize("arch", [pytest.param("x86-64-v2", marks=pytest.mark.slow), "x86-64-v3"])
def test_the_result_does_not_depend_on_the_instruction_set(arch: str) -> None:
    """The same source built for x86-64-v2 (SSE4.2: no AVX2, the scalar path everywhere) and for
    x86-64-v3 (AVX2: the 256-bit paths, no AVX-512) gives the same bits as this machine's build
    (-march=native: the AVX-512 VNNI paths of the K types where the CPU has them), for every tile
    shape of the AVX-512 path (1 to 8 rows, and 8 + 5)."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 only")
    other = qm.build_for(arch)
    for name in TYPES:
        q = qm.qtype(name)
        n = 3 * 256
        w = random_blocks(q, 29, n, seed=13)
        for rows in (13, 1, 2, 3, 5, 6, 7, 9):
            x = torch.randn(rows, n, generator=torch.Generator().manual_seed(17)) * 4
            assert torch.equal(other.quant_matmul(x, w, q.ggml_id), qm.quant_matmul(x, w, q)), (name, rows)
    # the activations' rule on the values where a vector path could differ from the scalar loop:
    # zero blocks, NaN and infinities (max|x| skips a NaN; a NaN value becomes 127), ties of the
    # rounding, signed zeros
    x = torch.randn(8, 512, generator=torch.Generator().manual_seed(3)) * 5
    x[0, :256] = 0.0
    x[1, 5], x[2, 7], x[3, 9] = float("nan"), float("inf"), -float("inf")
    x[4, :32] = torch.arange(32) - 15.5
    x[5, :256] = torch.linspace(-127, 127, 256)
    x[6] = -0.0
    for block in (32, 256):
        for mine, theirs in zip(qm.quantize_rows(x, block), other.quantize_rows(x, block), strict=True):
            assert torch.equal(mine.nan_to_num(), theirs.nan_to_num()), block


def test_the_amx_tiles_give_the_same_bits_as_every_other_path() -> None:
    """Where the CPU has AMX (Sapphire Rapids and later), the K types' products of many rows run on
    tiles of 16 weight rows x 16 activation rows. Forced on from one row, they equal the torch
    reference bit for bit: rows that fill no tile, one tile, a tile and a part; outputs that are
    no multiple of 16 (the rest on the vector path); a row alone equals the same row among 40."""
    if "amx" not in qm.simd():
        pytest.skip(f"no AMX on this CPU (paths: {qm.simd()})")
    before = qm.amx_min_rows()
    try:
        for name in ("Q4_K", "Q6_K"):
            q = qm.qtype(name)
            n = 3 * 256
            w = random_blocks(q, 53, n, seed=19)
            x = torch.randn(40, n, generator=torch.Generator().manual_seed(23)) * 3
            x[2, :256] = 0  # an all-zero super-block
            qm.set_amx_min_rows(1)
            for rows in (1, 5, 16, 17, 40):
                got = qm.quant_matmul(x[:rows], w, q)
                assert torch.equal(got, qm.reference_quant_matmul(x[:rows], w, q)), (name, rows)
            many = qm.quant_matmul(x, w, q)
            qm.set_amx_min_rows(0)  # off: the AVX-512 / AVX2 paths
            assert torch.equal(qm.quant_matmul(x, w, q), many), name
            assert torch.equal(qm.quant_matmul(x[7:8], w, q), many[7:8]), name
    finally:
        qm.set_amx_min_rows(before)
    with pytest.raises(ValueError, match="TREESPEC_AMX_MIN_ROWS must be >= 0"):
        qm.set_amx_min_rows(-1)


def _hostile(q: qm.QuantType, outputs: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights of `outputs` rows over three super-blocks and `rows` activation rows, row 2 with an
    all-zero super-block and row 3 with every value of a super-block at +-127 once quantized."""
    n = 3 * 256
    w = random_blocks(q, outputs, n, seed=seed)
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(seed + 2)) * 3
    x[2, :256] = 0
    x[3, 256:512] = torch.where(torch.arange(256) % 2 == 0, 1e4, -1e4)
    return w, x


def test_the_rows_in_the_lanes_give_the_same_bits_as_every_other_path() -> None:
    """Where the CPU has AVX-512 VNNI, the K types' products of many rows put the activation rows in
    the lanes of a vector (16 in a zmm, the last up to 8 in a ymm) and broadcast the weights. Forced
    on from one row, they equal the torch reference bit for bit: every chunk shape (1 to 8 rows in
    a ymm, 9 to 16 in a zmm, several chunks), an all-zero super-block, extreme activations; and a
    row alone equals the same row among 40."""
    if "avx512-vnni" not in qm.simd():
        pytest.skip(f"no AVX-512 VNNI on this CPU (paths: {qm.simd()})")
    mod = qm._require()
    before = int(mod.lanes_min_rows())
    try:
        for name in ("Q4_K", "Q6_K"):
            q = qm.qtype(name)
            w, x = _hostile(q, 21, 40, seed=29)
            mod.set_lanes_min_rows(1)
            for rows in (1, 2, 7, 8, 9, 16, 17, 25, 40):
                got = qm.quant_matmul(x[:rows], w, q)
                assert torch.equal(got, qm.reference_quant_matmul(x[:rows], w, q)), (name, rows)
            many = qm.quant_matmul(x, w, q)
            mod.set_lanes_min_rows(0)  # off: the tiles of outputs
            assert torch.equal(qm.quant_matmul(x, w, q), many), name
            assert torch.equal(qm.quant_matmul(x[7:8], w, q), many[7:8]), name
    finally:
        mod.set_lanes_min_rows(before)


def test_the_grid_of_weight_rows_by_activation_rows_gives_the_same_bits() -> None:
    """Where the CPU has AVX-512 VNNI, the K types can run a few rows on a grid of O weight rows x
    16 / O activation rows in one vector's lanes (by default at 7 and 8 rows). Forced on, it equals the torch
    reference bit for bit for every chunk shape (four rows a chunk up to four, eight beyond, two
    chunks), outputs past the last multiple of 16, an all-zero super-block and extreme activations;
    and off again, the default paths give the same bits."""
    if "avx512-vnni" not in qm.simd():
        pytest.skip(f"no AVX-512 VNNI on this CPU (paths: {qm.simd()})")
    mod = qm._require()
    before = tuple(int(v) for v in mod.grid_rows())
    try:
        for name in ("Q4_K", "Q6_K"):
            q = qm.qtype(name)
            w, x = _hostile(q, 37, 17, seed=41)
            mod.set_grid_rows(1, 16)
            got = {rows: qm.quant_matmul(x[:rows], w, q) for rows in (1, 2, 3, 4, 5, 8, 9, 16)}
            for rows, y in got.items():
                assert torch.equal(y, qm.reference_quant_matmul(x[:rows], w, q)), (name, rows)
            mod.set_grid_rows(0, 0)  # off: the tiles and the lanes
            for rows, y in got.items():
                assert torch.equal(qm.quant_matmul(x[:rows], w, q), y), (name, rows)
    finally:
        mod.set_grid_rows(*before)


def test_a_bad_amx_row_count_in_the_environment_is_named() -> None:
    import os
    import subprocess
    import sys

    code = "from treespec_kernels import quant_matmul as qm; qm.load()"
    env = {**os.environ, "TREESPEC_AMX_MIN_ROWS": "many"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "TREESPEC_AMX_MIN_ROWS='many': give a row count" in done.stderr


@pytest.mark.parametrize("rows", [1, 3, 9])
def test_stacked_parts_equal_each_part_alone(rows: int) -> None:
    """A fused projection (parts of different types stacked along the outputs, x quantized once per
    activation block size) gives, column for column, each part's own product."""
    n = 512
    parts = [
        (qm.qtype(name), random_blocks(qm.qtype(name), out, n, seed=out))
        for name, out in (("Q4_K", 24), ("Q6_K", 8), ("Q8_0", 5), ("Q4_K", 3))
    ]
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(rows)) * 2
    got = qm.quant_matmul_parts(x, [w for _, w in parts], [q for q, _ in parts])
    want = torch.cat([qm.quant_matmul(x, w, q) for q, w in parts], dim=1)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="one type per part"):
        qm.quant_matmul_parts(x, [parts[0][1]], [])


def _work_by_rows(
    mod: Any, q: qm.QuantType, w: torch.Tensor, n_in: int, most: int
) -> list[tuple[int, int, int]]:
    """The kernel's own work counters (unpacks, dots, reductions) of one call per row count 1..most."""
    out = []
    for rows in range(1, most + 1):
        x = torch.randn(rows, n_in, generator=torch.Generator().manual_seed(rows))
        mod.set_counting(True)
        try:
            mod.quant_matmul(x, w, q.ggml_id)
            unpacks, dots, reductions, calls = (int(v) for v in mod.work())
        finally:
            mod.set_counting(False)
        assert calls == 1
        out.append((unpacks, dots, reductions))
    return out


@pytest.mark.parametrize("arch", ["native", "x86-64-v3"])
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_the_cost_curve_has_no_cliffs_in_the_kernels_own_counters(arch: str, name: str) -> None:
    """Every row count takes the batched path with a tail, read from the kernel's work hooks (not from
    wall-clock time): more rows never do less work of any kind, a count between multiples of four
    does no more than the next multiple, and the weights are unpacked once per group of rows
    (eight on the AVX-512 tiles, four on AVX2), never once per row."""
    import platform

    if arch != "native" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 only")
    mod = qm._require() if arch == "native" else qm.build_for(arch)
    q = qm.qtype(name)
    out_f, n_in = 24, 512
    w = random_blocks(q, out_f, n_in, seed=5)
    if arch == "native" and qm.amx_min_rows() and "amx" in qm.simd():
        pytest.skip("the AMX tiles take the larger row counts here (their own test covers them)")
    work = _work_by_rows(mod, q, w, n_in, 40)
    group = 8 if "avx512" in str(mod.simd()) else 4
    lanes = (
        int(mod.lanes_min_rows())
        if hasattr(mod, "lanes_min_rows") and "avx512-vnni" in str(mod.simd())
        else 0
    )
    for rows in range(1, 40):
        now, more = work[rows - 1], work[rows]
        assert all(a <= b for a, b in zip(now, more, strict=True)), (rows, now, more)
        up = -(-rows // 4) * 4
        assert all(a <= b for a, b in zip(now, work[up - 1], strict=True)), (rows, now, work[up - 1])
        # one pass over the weights per group of rows on the tiles, one per call with the rows in
        # the lanes
        passes = 1 if lanes and rows >= lanes else -(-rows // group)
        assert now[0] == passes * out_f * (n_in // 256), (rows, now)
        assert now[1] == rows * out_f * (n_in // 256), (rows, now)
    with qm.counting_work() as seen:  # the Python face of the same counters (this machine's build)
        qm.quant_matmul(torch.ones(3, n_in), w, q)
        qm.quant_matmul(torch.ones(1, n_in), w, q)
        done = seen()
    assert (done.unpacks, done.dots, done.calls) == (2 * out_f * 2, 4 * out_f * 2, 2)
