"""Projections straight from a GGUF's quantized blocks on CPUs (csrc/quant_matmul.cpp), built on
first use, and the plain-torch reference that reproduces them bit for bit.

`quant_matmul(x, w, qtype)` is x @ W.T where W stays in the GGUF's bytes ([out, bytes per row],
uint8; Q8_0, Q5_0, Q4_1, Q4_K or Q6_K): each activation row is quantized on its own to int8 (one
scale per 32 values for Q8_0, Q5_0 and Q4_1, per 256 for the K types), everything inside an activation block
is an exact integer sum, and the float part is one fixed chain of multiplies and adds per output,
so a row's result does not depend on how many rows are computed with it, on the thread count or
on the SIMD width (the .cpp file has the rule).
`reference_quant_matmul` is the same computation in torch, equal bit for bit; `dequantize_rows`
gives rows back as float32 exactly as gguf-py's `dequantize` does (the lookup of a quantized
embedding table).

The activations' int8 rounding makes this a numerically different target from the float32 one
(the GGUF dequantized to float32 and multiplied in float32): close, not equal.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from treespec_kernels.cpp_build import CppExtension

QB = 32  # values per activation block


@dataclass(frozen=True)
class QuantType:
    """A GGUF block type: its ggml id, values and bytes per block."""

    name: str
    ggml_id: int
    values: int
    bytes: int


QTYPES: dict[str, QuantType] = {
    q.name: q
    for q in (
        QuantType("Q8_0", 8, 32, 34),
        QuantType("Q5_0", 6, 32, 22),
        QuantType("Q4_1", 3, 32, 20),
        QuantType("Q4_K", 12, 256, 144),
        QuantType("Q6_K", 14, 256, 210),
    )
}


def _flags(arch: str) -> list[str]:
    # -ffp-contract=off: the float chain is separate multiplies and adds on every machine, as in
    # the torch reference (an FMA would round once where the reference rounds twice)
    # -mtune=generic: tuned for a Sapphire Rapids machine, its one-row products of the 1.5B's head
    # ran 20% slower (bench.quant_matmul); the instruction set stays -march's
    return ["-O3", f"-march={arch}", "-mtune=generic", "-ffp-contract=off", "-fno-math-errno", "-fopenmp"]


_EXT = CppExtension(
    "treespec_quant_matmul", "quant_matmul.cpp", _flags("native"), "quantized projections are unavailable"
)


def build_for(arch: str) -> Any:
    """The same kernel built for another -march (x86-64-v2: scalar; x86-64-v3: AVX2, no AVX-512),
    for the tests that its bits do not depend on the instruction set and for the benchmark's A/B;
    a RuntimeError when it cannot be built."""
    name = "treespec_quant_matmul_" + arch.replace("-", "_")
    return CppExtension(name, "quant_matmul.cpp", _flags(arch), "not built").require()


AMX_ENV = "TREESPEC_AMX_MIN_ROWS"  # rows from which the K types use AMX; 0 turns it off


def load() -> Any:
    """The compiled module, or None when it is disabled or cannot be built (reason: `error()`)."""
    mod = _EXT.module
    if mod is not None:
        return mod
    mod = _EXT.load()
    text = os.environ.get(AMX_ENV, "").strip()
    if mod is not None and text:
        try:
            rows = int(text)
        except ValueError:
            raise ValueError(f"{AMX_ENV}={text!r}: give a row count (0 turns AMX off)") from None
        set_amx_min_rows(rows, mod)
    return mod


def set_amx_min_rows(rows: int, mod: Any = None) -> None:
    """The K types' products of `rows` activation rows or more run on AMX tiles where the CPU has
    them (Sapphire Rapids and later; the same bits as every other path); 0 never uses them. The
    default, 9, is where AMX overtook AVX-512 VNNI on the 1.5B's matrices (bench.quant_matmul on a
    Sapphire Rapids machine).
    Also set by the environment variable TREESPEC_AMX_MIN_ROWS."""
    if rows < 0:
        raise ValueError(f"{AMX_ENV} must be >= 0 (0 turns AMX off), got {rows}")
    (mod or _require()).set_amx_min_rows(rows)


def amx_min_rows() -> int:
    return int(_require().amx_min_rows())


def simd() -> str:
    """The SIMD paths the built kernel runs ("avx512-vnni (K types), avx2", "avx2" or "scalar"), or
    "unavailable"."""
    mod = load()
    return "unavailable" if mod is None else str(mod.simd())


def _require() -> Any:
    mod = _EXT.module  # built already: no call (this runs for every projection of every forward)
    if mod is None:
        mod = load()
    return mod if mod is not None else _EXT.require()


def error() -> str | None:
    return _EXT.error()


def qtype(name: str) -> QuantType:
    """The block type called `name` (a ValueError naming the supported ones otherwise)."""
    try:
        return QTYPES[name]
    except KeyError:
        raise ValueError(f"quantization type {name!r} is not supported; one of {sorted(QTYPES)}") from None


def row_bytes(q: QuantType, in_features: int) -> int:
    if in_features <= 0 or in_features % q.values:
        raise ValueError(
            f"in_features ({in_features}) must be a positive multiple of {q.values} for {q.name}"
        )
    return in_features // q.values * q.bytes


_NONE = torch.empty(0, dtype=torch.uint8)


def quant_matmul(
    x: torch.Tensor, w: torch.Tensor, q: QuantType, packed: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [rows, in] float32; w: [out, bytes per row] uint8 blocks of type q -> [rows, out] float32.
    `packed`: `pack(w, q, in)`'s repacking of w, which the row counts of `packed_rows()` run on (the
    same bits)."""
    out: torch.Tensor = _require().quant_matmul(x, w, q.ggml_id, _NONE if packed is None else packed)
    return out


def quant_matmul_parts(
    x: torch.Tensor,
    ws: Sequence[torch.Tensor],
    qs: Sequence[QuantType],
    packs: Sequence[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """x [rows, in] float32 against matrices stacked along the outputs (ws[i]: [out_i, bytes per row]
    uint8 blocks of type qs[i]; packs[i]: its repacking or None) -> [rows, sum of out_i] float32, x
    quantized once per activation block size; column for column equal to `quant_matmul` of each part
    alone."""
    if len(ws) != len(qs) or not ws:
        raise ValueError(f"give one type per part: {len(ws)} parts, {len(qs)} types")
    if packs is not None and len(packs) != len(ws):
        raise ValueError(f"give one packed tensor (or None) per part: {len(ws)} parts, {len(packs)} packed")
    given = [] if packs is None else [_NONE if p is None else p for p in packs]
    out: torch.Tensor = _require().quant_matmul_parts(x, list(ws), [q.ggml_id for q in qs], given)
    return out


def pack(w: torch.Tensor, q: QuantType, in_features: int) -> torch.Tensor | None:
    """w's K-type blocks repacked once for the packed path (sixteen outputs a vector, the nibbles
    laid out for a whole dpbusd operand per load; about the blocks' own size), or None where this
    build or this type has none (no AVX-512 VNNI; not Q4_K or Q6_K; fewer than 16 outputs)."""
    packed: torch.Tensor = _require().pack_k(w, q.ggml_id, in_features)
    return packed if packed.numel() else None


PACKED_ENV = "TREESPEC_PACKED_ROWS"  # "LO-HI": the row counts run on packed weights; "0" never


def set_packed_rows(lo: int, hi: int) -> None:
    """Products of lo..hi activation rows run on the packed weights where a matrix has them (lo 0:
    never). The same bits as every other path."""
    if lo < 0 or (lo and hi < lo):
        raise ValueError(f"packed rows {lo}..{hi}: give 0 (never) or 1 <= lo <= hi")
    _require().set_packed_rows(lo, hi)


def packing() -> bool:
    """Whether models repack their K-type matrices at load (`QuantMatrix.packed`): unless
    TREESPEC_PACKED_ROWS is "0"; where set as "LO-HI" it also sets `set_packed_rows`."""
    text = os.environ.get(PACKED_ENV, "").strip()
    if text in ("", "default"):
        return True
    if text == "0":
        return False
    lo, sep, hi = text.partition("-")
    try:
        bounds = (int(lo), int(hi if sep else lo))
    except ValueError:
        raise ValueError(f"{PACKED_ENV}={text!r}: give LO-HI (the row counts), or 0 to turn it off") from None
    set_packed_rows(*bounds)
    return True


def packed_rows() -> tuple[int, int]:
    lo, hi = _require().packed_rows()
    return int(lo), int(hi)


@dataclass(frozen=True)
class Work:
    """What the K types' paths did while counting (`counting_work`): weight super-blocks unpacked,
    256-value integer dot products, reductions of integer lanes into float chains, calls."""

    unpacks: int
    dots: int
    reductions: int
    calls: int


class counting_work:
    """The kernel's own work counters over a block: `with counting_work() as seen: ...; seen()`
    gives the `Work` done so far. Counting costs an atomic add per path call; off otherwise."""

    def __enter__(self) -> Any:
        _require().set_counting(True)
        return lambda: Work(*(int(v) for v in _require().work()))

    def __exit__(self, *exc: object) -> None:
        _require().set_counting(False)


def activation_block(q: QuantType) -> int:
    """Values per activation scale for weights of type q: 256 for the K types, else 32."""
    return 256 if q.values == 256 else QB


def quantize_rows(x: torch.Tensor, block: int = QB) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's activation rule: x [rows, in] float32 -> (int8 values, one scale per `block`
    values [rows, in / block] float32, the sum of every 32 int8 values [rows, in / 32] int32)."""
    xq, dx, sx = _require().quantize_rows(x, block)
    return xq, dx, sx


def dequantize_rows(w: torch.Tensor, q: QuantType, in_features: int, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` [n] of the block matrix w as float32 [n, in_features], as gguf-py computes them."""
    out: torch.Tensor = _require().dequantize_rows(w, q.ggml_id, in_features, rows)
    return out


# ---------------------------------------------------------------------------------------------------
# The plain-torch reference (bit-identical to the kernel)


def _half(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian half floats -> [...] float32."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def reference_quantize_rows(
    x: torch.Tensor, block: int = QB
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`quantize_rows` in torch."""
    rows, n = x.shape
    blocks = x.float().reshape(rows, n // block, block)
    d = blocks.abs().amax(dim=-1) / 127.0
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    xq = torch.round(blocks * inv[..., None]).clamp(-127, 127).to(torch.int8).reshape(rows, n)
    return xq, d, xq.reshape(rows, n // QB, QB).to(torch.int32).sum(dim=-1)


def _q4k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 12] uint8 -> eight 6-bit scales and mins [..., 8] int32."""
    s = s.to(torch.int32)
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat((lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)), dim=-1)
    mn = torch.cat((mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)), dim=-1)
    return sc, mn


def reference_decode(w: torch.Tensor, q: QuantType, in_features: int) -> torch.Tensor:
    """The weight integers the kernel multiplies: [out, in] int32 (Q5_0: q - 16; Q4_1, Q4_K: 0..15;
    Q6_K: q - 32)."""
    out = w.shape[0]
    blk = w.reshape(out, in_features // q.values, q.bytes).to(torch.int32)
    if q.name == "Q8_0":
        vals = blk[..., 2:].to(torch.uint8).view(torch.int8).to(torch.int32)
    elif q.name == "Q5_0":
        qh = blk[..., 2] | (blk[..., 3] << 8) | (blk[..., 4] << 16) | (blk[..., 5] << 24)
        qs = blk[..., 6:]
        lo = torch.cat((qs & 0x0F, qs >> 4), dim=-1)
        hi = (qh[..., None] >> torch.arange(32)) & 1
        vals = (lo | (hi << 4)) - 16
    elif q.name == "Q4_1":
        qs = blk[..., 4:]
        vals = torch.cat((qs & 0x0F, qs >> 4), dim=-1)
    elif q.name == "Q4_K":
        qs = blk[..., 16:].reshape(out, -1, 4, 32)
        vals = torch.stack((qs & 0x0F, qs >> 4), dim=3)  # [out, blocks, 4, 2, 32]
    else:  # Q6_K
        ql = blk[..., :128].reshape(out, -1, 2, 2, 32)  # [.., half, which 32, i]
        qh = blk[..., 128:192].reshape(out, -1, 2, 32)
        low = torch.cat((ql & 0x0F, ql >> 4), dim=3)  # [.., half, 4 chunks, 32]
        high = (qh[:, :, :, None, :] >> torch.tensor([0, 2, 4, 6])[:, None]) & 3
        vals = (low | (high << 4)) - 32
    return vals.reshape(out, in_features)


def reference_quant_matmul(x: torch.Tensor, w: torch.Tensor, q: QuantType) -> torch.Tensor:
    """`quant_matmul` in torch, bit for bit: the same integer totals and the same float chain."""
    rows, n = x.shape
    out = w.shape[0]
    xq, dx, sx = reference_quantize_rows(x, activation_block(q))
    wq = reference_decode(w, q, n).to(torch.int64)
    xl = xq.to(torch.int64)
    blk = w.reshape(out, n // q.values, q.bytes)
    acc = torch.zeros(rows, out, dtype=torch.float32)
    if q.values == QB:
        dw = _half(blk[..., 0:2])  # [out, blocks]
        mw = _half(blk[..., 2:4]) if q.name == "Q4_1" else None
        for b in range(n // QB):
            cols = slice(QB * b, QB * (b + 1))
            isum = (xl[:, None, cols] * wq[None, :, cols]).sum(-1).to(torch.float32)
            a = (dw[None, :, b] * dx[:, b, None]) * isum
            if mw is None:
                acc = acc + a
            else:  # Q4_1: the block's minimum times the row's sum
                acc = acc + (a + (mw[None, :, b] * dx[:, b, None]) * sx[:, b, None].to(torch.float32))
        return acc
    for sb in range(n // 256):
        cols = slice(256 * sb, 256 * (sb + 1))
        prod = xl[:, None, cols] * wq[None, :, cols]  # [rows, out, 256]
        if q.name == "Q4_K":
            sc, mn = _q4k_scales(blk[:, sb, 4:16])  # [out, 8]
            isum = prod.reshape(rows, out, 8, 32).sum(-1)
            total = (isum * sc[None].to(torch.int64)).sum(-1)
            mins = (mn[None].to(torch.int64) * sx[:, None, 8 * sb : 8 * (sb + 1)].to(torch.int64)).sum(-1)
            d, dmin = _half(blk[:, sb, 0:2]), _half(blk[:, sb, 2:4])
            inner = d[None] * total.to(torch.float32) - dmin[None] * mins.to(torch.float32)
            acc = acc + dx[:, sb, None] * inner
        else:
            scales = blk[:, sb, 192:208].view(torch.int8).to(torch.int64)  # [out, 16]
            isum = prod.reshape(rows, out, 16, 16).sum(-1)
            total = (isum * scales[None]).sum(-1)
            d = _half(blk[:, sb, 208:210])
            acc = acc + (d[None] * dx[:, sb, None]) * total.to(torch.float32)
    return acc
