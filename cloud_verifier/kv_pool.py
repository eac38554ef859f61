"""The size of the service's paged KV pool, and its share of a streamed target's resident budget.

With `--offload`, `--resident-gb N` bounds what the target holds in memory: the KV pool is made
first out of N (it is read every forward, like a resident layer) and the layers get what it
leaves. The pool's bytes are known before the weights load, from the model's configuration, so
the budget the layers are planned against already has the pool taken out.
"""

from __future__ import annotations

import torch

from cloud_verifier.server_config import ServerConfig
from shared.model.model_config import ModelConfig
from shared.model.target import Target
from shared.model.weights import resolve_device, resolve_dtype

# the automatic KV pool takes at most this share of the weights' bytes (the 1.5B in fp32: ~0.85 GB,
# ~9,900 tokens with the CPU kernel's tiled keys), which keeps the process within 1.3x its weights
KV_WEIGHT_SHARE = 0.12
MEMORY_CAP = 2 << 30  # the automatic pool's bytes at most (unless one full context needs more)
TILE = 16  # the CPU kernel keeps a transposed copy of K when the block size is a multiple of this


def token_bytes(c: ModelConfig, dtype: torch.dtype, tiled: bool) -> int:
    """Bytes one token takes in the pool: K and V of every layer, plus the CPU kernel's transposed
    copy of K when `tiled`."""
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * torch.finfo(dtype).bits // 8
    return per_token * 3 // 2 if tiled else per_token


def pool_blocks(config: ServerConfig, per_token: int, weight_bytes: int, memory_cap: int = MEMORY_CAP) -> int:
    """`--kv-blocks` when set; else blocks for max_sessions full contexts, capped at `memory_cap`
    bytes and at KV_WEIGHT_SHARE of `weight_bytes` (so a large target's pool does not outgrow it),
    but never fewer than one full context holds (small weights: the 1.5B's GGUF blocks are 1.1 GB)."""
    if config.kv_blocks:
        return config.kv_blocks
    one = config.max_context + config.max_nodes + 1  # a session at its longest, with a tree
    cap = min(memory_cap, max(256 << 20, int(KV_WEIGHT_SHARE * weight_bytes), one * per_token))
    tokens = min(config.max_sessions * one, cap // per_token)
    floor = min(one, memory_cap // per_token)  # whole blocks for one session, within memory_cap
    return max(tokens // config.block_size, -(-floor // config.block_size), 8)


def _budget_bytes(config: ServerConfig) -> int:
    return int(config.resident_gb * 1e9)


def kv_blocks_for(config: ServerConfig, target: Target, memory_cap: int = MEMORY_CAP) -> int:
    """The pool the service makes for `target` (see pool_blocks). A streamed target's share cap is
    of its resident budget, as kv_reserve_bytes planned it before the weights loaded."""
    tiled = target.model.attention_kernel == "cpu-invariant" and config.block_size % TILE == 0
    per_token = token_bytes(target.config, target.dtype, tiled)
    streamed = config.offload != "none"
    weight_bytes = _budget_bytes(config) if streamed else target.model.weight_bytes()
    return pool_blocks(config, per_token, weight_bytes, memory_cap)


def kv_reserve_bytes(config: ServerConfig, c: ModelConfig) -> int:
    """At least the bytes kv_blocks_for's pool will take for a streamed target of configuration `c`
    (the CPU kernel's copy of K assumed on a CPU): what comes out of --resident-gb first."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    per_token = token_bytes(c, dtype, device.type == "cpu" and config.block_size % TILE == 0)
    return pool_blocks(config, per_token, _budget_bytes(config)) * config.block_size * per_token


def layers_budget_gb(config: ServerConfig, c: ModelConfig) -> tuple[float, int]:
    """The GB a streamed target's weights may hold once the KV pool is out of --resident-gb, and the
    pool's reserved bytes."""
    reserve = kv_reserve_bytes(config, c)
    return max(0.0, config.resident_gb - reserve / 1e9), reserve
