"""The size of the service's paged KV pool, and its share of a streamed target's resident budget.

A resident target's automatic pool is sized from the memory the machine has once the weights are
loaded, as GPU servers size theirs from free device memory (vLLM's gpu_memory_utilization):
`kv_memory_fraction` of what is available (free device memory on a GPU; MemAvailable on a CPU,
from psutil when installed, else /proc/meminfo), at most what max_sessions sessions at their longest
can use, and at least one full context where memory holds it. `--kv-blocks` sets it outright.

With `--offload`, `--resident-gb N` bounds what the target holds in memory: the KV pool is made
first out of N (it is read every forward, like a resident layer) and the layers get what it
leaves. The pool's bytes are known before the weights load, from the model's configuration, so
the budget the layers are planned against already has the pool taken out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cloud_verifier.server_config import ServerConfig
from shared.model.model_config import ModelConfig
from shared.model.target import Target
from shared.model.weights import resolve_device, resolve_dtype

# a streamed target's automatic KV pool takes at most this share of its resident budget
KV_WEIGHT_SHARE = 0.12
MEMORY_CAP = 2 << 30  # a streamed target's automatic pool's bytes at most (unless one context needs more)
TILE = 16  # the CPU kernel keeps a transposed copy of K when the block size is a multiple of this


def token_bytes(c: ModelConfig, dtype: torch.dtype, tiled: bool) -> int:
    """Bytes one token takes in the pool: K and V of every layer, plus the CPU kernel's transposed
    copy of K when `tiled`."""
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * torch.finfo(dtype).bits // 8
    return per_token * 3 // 2 if tiled else per_token


def pool_blocks(config: ServerConfig, per_token: int, weight_bytes: int, memory_cap: int = MEMORY_CAP) -> int:
    """A streamed target's pool: `--kv-blocks` when set; else blocks for max_sessions full contexts,
    capped at `memory_cap` bytes and at KV_WEIGHT_SHARE of `weight_bytes` (its resident budget), but
    never fewer than one full context holds."""
    if config.kv_blocks:
        return config.kv_blocks
    one = config.max_context + config.max_nodes + 1  # a session at its longest, with a tree
    cap = min(memory_cap, max(256 << 20, int(KV_WEIGHT_SHARE * weight_bytes), one * per_token))
    tokens = min(config.max_sessions * one, cap // per_token)
    floor = min(one, memory_cap // per_token)  # whole blocks for one session, within memory_cap
    return max(tokens // config.block_size, -(-floor // config.block_size), 8)


def _budget_bytes(config: ServerConfig) -> int:
    return int(config.resident_gb * 1e9)


def meminfo_available(path: str = "/proc/meminfo") -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where the file or the line is missing)."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel writes kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_bytes(device: torch.device) -> int | None:
    """The memory a pool on `device` may come out of now: free device memory on a GPU, the
    machine's available memory on a CPU (psutil when installed, else /proc/meminfo); None where
    nothing says."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        import psutil
    except ImportError:
        return meminfo_available()
    return int(psutil.virtual_memory().available)


@dataclass(frozen=True)
class PoolSize:
    """The automatic pool: its blocks and how they were chosen (`line` logs it)."""

    blocks: int
    block_size: int
    token_bytes: int
    how: str  # "memory", "--kv-blocks", "resident budget"
    fraction: float = 0.0
    available: int | None = None  # bytes available when it was sized ("memory")

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_size

    def line(self) -> str:
        size = f"KV pool: {self.blocks} blocks of {self.block_size} tokens ({self.tokens} tokens, "
        size += f"{self.tokens * self.token_bytes / 1e9:.3f} GB)"
        if self.how != "memory":
            return f"{size}, from {self.how}"
        if self.available is None:
            return f"{size}, {FALLBACK_BYTES / 1e9:.1f} GB (the available memory could not be read)"
        return f"{size}: kv_memory_fraction {self.fraction:g} of {self.available / 1e9:.2f} GB available"


FALLBACK_BYTES = 2 << 30  # the pool's bytes where the available memory cannot be read


def memory_blocks(config: ServerConfig, per_token: int, available: int | None) -> int:
    """Blocks for `kv_memory_fraction` of `available` bytes, at most max_sessions sessions at their
    longest (a pool past that is never used), at least one session at its longest where `available`
    holds it (whole blocks, and never under 8)."""
    one = config.max_context + config.max_nodes + 1  # a session at its longest, with a tree
    budget = FALLBACK_BYTES if available is None else int(config.kv_memory_fraction * available)
    floor = one if available is None else min(one, available // per_token)
    tokens = min(config.max_sessions * one, max(budget // per_token, floor))
    return max(tokens // config.block_size, -(-floor // config.block_size), 8)


def pool_size(config: ServerConfig, target: Target, available: int | None = None) -> PoolSize:
    """The pool the service makes for `target`: `--kv-blocks` when set; a streamed target's out of
    its resident budget (pool_blocks), as kv_reserve_bytes planned it before the weights loaded;
    else from memory (memory_blocks), `available` bytes or what `available_bytes` measures now."""
    tiled = target.model.attention_kernel == "cpu-invariant" and config.block_size % TILE == 0
    per_token = token_bytes(target.config, target.dtype, tiled)
    if config.kv_blocks:
        return PoolSize(config.kv_blocks, config.block_size, per_token, "--kv-blocks")
    if config.offload != "none":
        blocks = pool_blocks(config, per_token, _budget_bytes(config))
        return PoolSize(blocks, config.block_size, per_token, "resident budget")
    if available is None:
        available = available_bytes(target.device)
    blocks = memory_blocks(config, per_token, available)
    return PoolSize(blocks, config.block_size, per_token, "memory", config.kv_memory_fraction, available)


def kv_blocks_for(config: ServerConfig, target: Target, available: int | None = None) -> int:
    """The blocks of `pool_size`."""
    return pool_size(config, target, available).blocks


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
