"""The Triton tree-attention kernel itself (imported lazily by `treespec_kernels.tree_attention`, so
that module loads where Triton is missing). The launcher there checks every argument.

Triton's interpreter (CPU tensors, tests) works only when TRITON_INTERPRET=1 is set before Triton is
imported: the library's own @triton.jit functions (tl.sum, tl.cumsum, ...) are wrapped at import.

One program serves one tile of one session's rows for one KV head: the tile folds the `G` query heads
that share the KV head into its M axis (tile row m = new row r0 + m // G, query head kvh * G + m % G),
so each K/V block is read once for the whole group. Sessions are found from the program id without a
host sync: every program loads `row_starts`, counts each session's tiles and takes a cumulative sum.
Keys are read position by position through the block table (any block size); the cached prefix runs
in an unmasked loop, the tail (a partial cached block and the new rows) in a masked one.
"""

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


def _tree_attention_fwd(  # type: ignore[no-untyped-def]
    Q,  # [T, H, HD]
    K,  # [KVH, slots, HD]
    V,  # [KVH, slots, HD]
    Out,  # [T, H, HD]
    BT,  # [S, max_blocks] int32
    ROW_STARTS,  # [S + 1] int32
    CACHED,  # [S] int32
    TMASK,  # [T] int64 (unused unless HAS_TREE)
    CAUSAL,  # [S] bool (unused unless HAS_TREE)
    stride_qt,
    stride_qh,
    stride_kh,
    stride_ks,
    stride_vh,
    stride_vs,
    stride_ot,
    stride_oh,
    stride_bt,
    num_sessions,
    block_size,
    scale_log2,  # softmax scale * log2(e): the kernel works in base 2
    G: tl.constexpr,  # query heads per KV head
    ROWS: tl.constexpr,  # session rows per tile (BLOCK_M // G)
    HD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    S_PAD: tl.constexpr,  # a power of two > num_sessions
    HAS_TREE: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot input precision ("ieee" keeps float32 inputs exact)
    UPCAST: tl.constexpr,  # dot in float32 (the interpreter's tl.dot cannot multiply bfloat16)
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)

    # which session and row tile this program serves
    offs_s = tl.arange(0, S_PAD)
    in_s = offs_s < num_sessions
    lo = tl.load(ROW_STARTS + offs_s, mask=in_s, other=0)
    hi = tl.load(ROW_STARTS + offs_s + 1, mask=in_s, other=0)
    tiles = (hi - lo + ROWS - 1) // ROWS
    cum = tl.cumsum(tiles, 0)  # inclusive
    s = tl.sum((cum <= pid).to(tl.int32), 0)  # == num_sessions: a spare program (the grid is a bound)
    sel = offs_s == s
    first_row = tl.sum(tl.where(sel, lo, 0), 0)
    n = tl.sum(tl.where(sel, hi - lo, 0), 0)  # 0 for a spare program
    r0 = (pid - tl.sum(tl.where(sel, cum - tiles, 0), 0)) * ROWS
    s_safe = tl.minimum(s, num_sessions - 1)
    cached = tl.load(CACHED + s_safe)
    cached = tl.where(n > 0, cached, 0)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HD)
    offs_n = tl.arange(0, BLOCK_N)
    i = r0 + offs_m // G  # new-row index within the session
    head = kvh * G + offs_m % G
    row_ok = (offs_m < ROWS * G) & (i < n)
    t = (first_row + i).to(tl.int64)

    q = tl.load(
        Q + t[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    if HAS_TREE:
        is_causal = tl.load(CAUSAL + s_safe) != 0
        tmask = tl.load(TMASK + t, mask=row_ok, other=0)
    else:
        is_causal = n >= 0  # always true (a tensor, like the branch above)
        tmask = tl.zeros([BLOCK_M], dtype=tl.int64)

    # a causal tile needs new keys up to its last row; a tree row may see any node of its session
    last_row = tl.minimum(n, r0 + ROWS)
    key_end = cached + tl.where(is_causal, last_row, n)
    key_end = tl.where(n > 0, key_end, 0)
    full_end = (cached // BLOCK_N) * BLOCK_N

    bt_row = BT + s_safe.to(tl.int64) * stride_bt
    k_base = K + kvh.to(tl.int64) * stride_kh
    v_base = V + kvh.to(tl.int64) * stride_vh

    # finite start: a row whose first blocks are all masked must not compute exp2(-inf - -inf)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HD], dtype=tl.float32)

    # cached prefix, whole blocks: every row sees every key
    for start in range(0, full_end, BLOCK_N):
        pos = start + offs_n
        blk = tl.load(bt_row + pos // block_size).to(tl.int64)
        slot = blk * block_size + pos % block_size
        k = tl.load(k_base + slot[None, :] * stride_ks + offs_d[:, None])  # [HD, BLOCK_N]
        v = tl.load(v_base + slot[:, None] * stride_vs + offs_d[None, :])  # [BLOCK_N, HD]
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, k, input_precision=PRECISION) * scale_log2
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # the rest: a partial cached block, then the new rows under the causal or tree rule
    for start in range(full_end, key_end, BLOCK_N):
        pos = start + offs_n
        key_ok = pos < key_end
        blk = tl.load(bt_row + pos // block_size, mask=key_ok, other=0).to(tl.int64)
        slot = blk * block_size + pos % block_size
        k = tl.load(k_base + slot[None, :] * stride_ks + offs_d[:, None], mask=key_ok[None, :], other=0.0)
        v = tl.load(v_base + slot[:, None] * stride_vs + offs_d[None, :], mask=key_ok[:, None], other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        j = pos - cached  # new-row index of the key (negative: cached)
        jj = j[None, :]
        ii = i[:, None]
        causal_vis = jj <= ii
        bit = tl.minimum(tl.maximum(jj - 1, 0), 63).to(tl.int64)
        tree_vis = (jj == 0) | (jj == ii) | (((tmask[:, None] >> bit) & 1) != 0)
        new_vis = tl.where(is_causal, causal_vis, tree_vis) & (jj < n)
        vis = ((jj < 0) | new_vis) & key_ok[None, :]
        qk = tl.dot(q, k, input_precision=PRECISION) * scale_log2
        qk = tl.where(vis, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(
        Out + t[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None],
    )


INTERPRETING = isinstance(tl.cumsum, InterpretedFunction)  # Triton was imported with TRITON_INTERPRET=1
tree_attention_fwd = triton.jit(_tree_attention_fwd)  # an InterpretedFunction when INTERPRETING
