"""The command channel from rank 0 to the other ranks: what a command is and how it travels.

Rank 0's model and KV cache broadcast a compact command before doing the same locally: a 64-byte
header (int64 [op, cache, n_ints, n_bytes, a0..a3]), then one byte payload holding the int64 words
and the mask bytes (no pickle; `pack_command`, built in one host buffer, pinned on CUDA, and copied
to the rank's device once: two broadcasts and one host->device copy a command). A forward's inputs
travel as int64 words and uint8 mask bytes (`encode_inputs` / `decode_inputs`). Every size is
bounded (MAX_INTS, MAX_BYTES) and a malformed header or payload is refused.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

from cloud_verifier.parallel.devices import CPU
from shared.model.llama import SeqInput

HEADER = 8  # int64 words of a command header: op, cache, n_ints, n_bytes, a0, a1, a2, a3
MAX_INTS = 1 << 22  # int64 words of one command's payload (a forward of 512 rows needs ~1,600)
MAX_BYTES = 1 << 24  # mask bytes of one forward (a 4,096-row tree: 16 MiB)


class Op(enum.IntEnum):
    STOP = 0
    NEW_CACHE = 1  # a0 num_blocks, a1 block_size
    DROP_CACHE = 2
    ADD = 3  # a0 seq
    FREE = 4  # a0 seq
    DISCARD = 5  # a0 seq
    TRUNCATE = 6  # a0 seq, a1 length
    COMMIT_ROWS = 7  # a0 seq; ints: keep
    FORWARD = 8  # ints, bytes: encode_inputs
    SET_ATTENTION = 9  # a0 index in ATTENTION_MODES
    SET_GEMM = 10  # a0 index in GEMM_KINDS
    CHECK_CACHE = 11  # ints: rank 0's `cache_digest`; every rank answers whether its own equals it


class TensorParallelError(RuntimeError):
    """The tensor-parallel group is broken (a rank died or a collective failed or timed out)."""


def pack_command(
    op: int,
    cache: int,
    args: Sequence[int],
    ints: torch.Tensor,
    data: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor:
    """One command as uint8 on `device`: the 64-byte header, then the int64 words, then the mask
    bytes; built in one host buffer (pinned for a CUDA device) and copied to `device` once."""
    nbytes = 0 if data is None else int(data.numel())
    if ints.numel() > MAX_INTS or nbytes > MAX_BYTES:
        name = Op(op).name if op in Op._value2member_map_ else str(op)
        raise ValueError(f"tensor-parallel command {name} too large ({ints.numel()} ints, {nbytes} bytes)")
    a = [*args, 0, 0, 0, 0][:4]
    header = torch.tensor([int(op), cache, int(ints.numel()), nbytes, *a], dtype=torch.int64)
    n_words = HEADER + int(ints.numel())
    buf = torch.empty(8 * n_words + nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    words = buf[: 8 * n_words].view(torch.int64)
    words[:HEADER] = header
    words[HEADER:] = ints.to(CPU, torch.int64)
    if data is not None and nbytes:
        buf[8 * n_words :] = data.reshape(-1).to(CPU, torch.uint8)
    return buf.to(device, non_blocking=True)


def unpack_payload(
    header: torch.Tensor, payload: torch.Tensor
) -> tuple[Op, int, list[int], torch.Tensor, torch.Tensor]:
    """A received command on the host: (op, cache, [a0..a3], int64 words, uint8 mask bytes)."""
    op_raw, cache, n_ints, n_bytes, *args = (int(v) for v in header.view(torch.int64))
    try:
        op = Op(op_raw)
    except ValueError:
        raise TensorParallelError(f"unknown tensor-parallel op {op_raw}") from None
    if payload.numel() != 8 * n_ints + n_bytes:
        raise TensorParallelError(f"tensor-parallel command {op.name}: payload of {payload.numel()} bytes")
    return op, cache, args, payload[: 8 * n_ints].view(torch.int64), payload[8 * n_ints :]


def payload_size(header: torch.Tensor) -> int:
    """The payload bytes a (host) header announces; a malformed header is refused."""
    words = header.view(torch.int64).tolist()
    n_ints, n_bytes = words[2], words[3]
    if not 0 <= n_ints <= MAX_INTS or not 0 <= n_bytes <= MAX_BYTES:
        raise TensorParallelError(f"malformed command header {words}")
    return int(8 * n_ints + n_bytes)


def encode_inputs(inputs: Sequence[SeqInput]) -> tuple[torch.Tensor, torch.Tensor]:
    """A forward's inputs as int64 words [m, (seq, n, k, has_mask) * m, tokens, positions,
    logit_rows of each] and uint8 mask bytes (each tree mask, row-major)."""
    meta = [len(inputs)]
    parts: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    for x in inputs:
        meta += [x.seq_id, x.num_rows, int(x.logit_rows.numel()), int(x.tree_mask is not None)]
        parts += [x.tokens.reshape(-1), x.positions.reshape(-1), x.logit_rows.reshape(-1)]
        if x.tree_mask is not None:
            masks.append(x.tree_mask.reshape(-1).to(torch.uint8))
    ints = torch.cat([torch.tensor(meta, dtype=torch.int64), *(p.to("cpu", torch.int64) for p in parts)])
    data = torch.cat(masks).cpu() if masks else torch.empty(0, dtype=torch.uint8)
    return ints, data


def decode_inputs(ints: torch.Tensor, data: torch.Tensor) -> list[SeqInput]:
    """The inverse of `encode_inputs`; a payload whose sizes do not add up is refused."""
    words = ints.tolist()
    if not words or not 0 < words[0] <= 4096 or len(words) < 1 + 4 * words[0]:
        raise ValueError(f"malformed forward command ({len(words)} words)")
    m, at, mat = words[0], 1 + 4 * words[0], 0
    out = []
    for i in range(m):
        sid, n, k, has_mask = words[1 + 4 * i : 5 + 4 * i]
        if n < 1 or k < 0 or at + 2 * n + k > len(words) or (has_mask and mat + n * n > data.numel()):
            raise ValueError("malformed forward command (sizes)")
        tokens = ints[at : at + n]
        positions = ints[at + n : at + 2 * n]
        rows = ints[at + 2 * n : at + 2 * n + k]
        at += 2 * n + k
        mask = None
        if has_mask:
            mask = data[mat : mat + n * n].view(n, n).bool()
            mat += n * n
        out.append(SeqInput(sid, tokens, positions, mask, rows))
    if at != len(words) or mat != data.numel():
        raise ValueError("malformed forward command (trailing data)")
    return out
