"""edge_client.onnx.quant: 8-bit blocks within half a step of the weights, chunking that changes
nothing, zero blocks, padding, and the block sizes MatMulNBits gets."""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.onnx import quant as onnx_quant
from edge_client.onnx.quant import ZERO, block_size, dequantize, quantize_rows


def _quantize(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    qs, ss = zip(*quantize_rows(w, block), strict=True)
    return np.concatenate(qs), np.concatenate(ss)


@pytest.mark.parametrize("k", [576, 896, 100, 48])
def test_blocks_are_within_half_a_step(k: int) -> None:
    rng = np.random.default_rng(k)
    w = rng.standard_normal((37, k)).astype(np.float32) * rng.uniform(0.01, 3.0, (37, 1)).astype(np.float32)
    w[3, 5] = 40.0  # an outlier only coarsens its own block
    block = block_size(k)
    q, scales = _quantize(w, block)
    blocks = -(-k // block)
    assert q.dtype == np.uint8 and q.shape == (37, blocks, block)
    assert scales.dtype == np.float32 and scales.shape == (37, blocks)
    assert q.min() >= 1 and q.max() <= 255  # symmetric: -127..127 around ZERO
    back = dequantize(q, scales, k)
    step = np.repeat(scales, block, axis=1)[:, :k]
    assert np.all(np.abs(back - w) <= step / 2 + 1e-6 * np.abs(w))
    assert np.allclose(np.abs(back).reshape(-1).max(), 40.0, rtol=1e-6)  # a block's max is exact
    if k % block:  # the padding quantizes to the zero point
        assert np.all(q.reshape(37, -1)[:, k:] == ZERO)
    others = np.delete(np.abs(back - w), 3, axis=0)
    assert others.max() < 0.05 * np.abs(w).max()


def test_chunks_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    w = np.random.default_rng(1).standard_normal((50, 64)).astype(np.float32)
    whole_q, whole_s = _quantize(w, 32)
    monkeypatch.setattr(onnx_quant, "CHUNK_VALUES", 64 * 7)  # 7 rows a step, the last one short
    assert len(list(quantize_rows(w, 32))) == 8
    q, s = _quantize(w, 32)
    np.testing.assert_array_equal(q, whole_q)
    np.testing.assert_array_equal(s, whole_s)


def test_zero_blocks_and_bad_input() -> None:
    w = np.zeros((2, 32), dtype=np.float32)
    w[1, 16:] = -1.5
    q, s = _quantize(w, 16)
    assert s[0].tolist() == [0.0, 0.0] and np.all(q[0] == ZERO)
    assert q[1, 1].tolist() == [1] * 16 and s[1, 0] == 0.0
    np.testing.assert_allclose(dequantize(q, s, 32), w, rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="matrix"):
        next(quantize_rows(np.zeros(8, dtype=np.float32), 16))


def test_block_sizes() -> None:
    assert [block_size(k) for k in (896, 4864, 576, 1536, 48, 100)] == [128, 128, 64, 128, 16, 128]
