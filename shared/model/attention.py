"""The packed forward's attention backends, registered by name and chosen once per model.

A backend computes, for every layer, the attention of all the forward's new rows over their own
sequence's cached and new keys (docs/architecture.md §3.1 for the rows and the tree mask):

- `cpu-invariant`: the batch-invariant CPU kernel (treespec_kernels/cpu_attention.py; float32 on
  a CPU, a pool with tiled keys). Every sum runs in an order fixed by key position, so with
  oneDNN's row-invariant projections a tree node's logits are bit-identical to decoding its path
  token by token.
- `triton`: one Triton launch per layer for every sequence, keys read through the block tables
  (treespec_kernels/tree_attention.py; the launch arguments in triton_launch.py). Tree sessions
  the kernel cannot take (over 65 rows) go through SDPA.
- `sdpa`: torch's scaled_dot_product_attention with the tree mask, per sequence; any device and
  dtype, and the only one for the "float64" mode (KV cache and attention in float64).

`LlamaModel.set_attention(mode)` takes one of `ATTENTION_MODES` (the `--attention` values);
`choose` turns the mode into a backend once, and a forward asks `for_pool` whether the chosen one
can read the pool it is given (a pool made before a switch to the CPU kernel lacks its tiled keys
and is read through SDPA).

A backend sees the model only through an `AttentionSpec` (head counts, head size, the dtypes and
the device; `LlamaModel.attention_spec`), so this module does not depend on the model's code.

How to add a backend: subclass `AttentionBackend` (a `name`, `usable`, `prepare` returning the
per-layer function), `register` it, and place it in `AUTO_ORDER` if "model" should pick it where
it is usable; tests/cloud_verifier/test_tree_forward.py compares every backend node by node.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from shared.model import triton_launch
from shared.model.inputs import SeqInput, allowed_rows, attention_mask
from shared.model.kv_cache import PagedKVCache, SeqSlots
from treespec_kernels import cpu_attention

# the `--attention` modes: "model" picks the best usable backend (AUTO_ORDER), the others force one
ATTENTION_MODES = ("model", "float64", "sdpa", "triton")

# (q [T, heads, head_dim] of every row of the forward, layer) -> [T, heads * head_dim]
Attend = Callable[[torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class AttentionSpec:
    """What a backend needs to know of the model it serves (on a tensor-parallel rank: its own
    share of the heads)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the model's activations (q, and what a backend returns)
    attn_dtype: torch.dtype  # the KV cache's and SDPA's (float64 in the "float64" mode)
    device: torch.device

    @cached_property
    def group_size(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @cached_property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class ForwardRows:
    """What a backend is given once per forward: each sequence's input, committed length, slots
    (from `kv.reserve`) and rows [a, b) in the packed batch."""

    inputs: list[SeqInput]
    cached: list[int]
    plans: list[SeqSlots]
    bounds: list[tuple[int, int]]


class AttentionBackend(ABC):
    name: ClassVar[str]

    @abstractmethod
    def usable(self, spec: AttentionSpec) -> bool:
        """Whether "model" may pick it for this model here (a mode that names a backend is
        checked by `check_mode` instead)."""

    def reads(self, kv: PagedKVCache) -> bool:
        """Whether it can read this pool (default: any)."""
        return True

    @abstractmethod
    def prepare(self, spec: AttentionSpec, rows: ForwardRows, kv: PagedKVCache) -> Attend:
        """Per forward: build what every layer shares (masks, slots, launch arguments)."""


BACKENDS: dict[str, AttentionBackend] = {}
AUTO_ORDER: list[str] = []  # what "model" tries, in order


def register(backend: AttentionBackend, auto: bool = True) -> AttentionBackend:
    if backend.name in BACKENDS:
        raise ValueError(f"attention backend {backend.name!r} is already registered")
    BACKENDS[backend.name] = backend
    if auto:
        AUTO_ORDER.append(backend.name)
    return backend


def check_mode(spec: AttentionSpec, mode: str) -> None:
    """ValueError naming what is wrong when `mode` cannot serve this model."""
    if mode not in ATTENTION_MODES:
        raise ValueError(f"attention mode must be one of {ATTENTION_MODES}, got {mode!r}")
    if mode == "triton":
        if not triton_launch.supports(spec.dtype, spec.head_dim):
            raise ValueError(
                f"attention 'triton' serves float16/bfloat16/float32 and head_dim in "
                f"{triton_launch.HEAD_DIMS}; this model is {spec.dtype}, head_dim {spec.head_dim}"
            )
        if not triton_launch.installed():
            raise ValueError("attention 'triton' needs Triton: pip install 'treespec[gpu]'")


def choose(spec: AttentionSpec, mode: str) -> AttentionBackend:
    """The backend of a mode: "sdpa" and "float64" -> sdpa, "triton" -> triton, "model" -> the
    first usable of AUTO_ORDER."""
    if mode in ("sdpa", "float64"):
        return BACKENDS["sdpa"]
    if mode == "triton":
        return BACKENDS["triton"]
    for name in AUTO_ORDER:
        if BACKENDS[name].usable(spec):
            return BACKENDS[name]
    return BACKENDS["sdpa"]


def for_pool(backend: AttentionBackend, kv: PagedKVCache) -> AttentionBackend:
    """The chosen backend, or sdpa when it cannot read this pool."""
    return backend if backend.reads(kv) else BACKENDS["sdpa"]


# ---------------------------------------------------------------------------- grouped queries
def fold(spec: AttentionSpec, q: torch.Tensor) -> torch.Tensor:
    """[n, heads, head_dim] -> [kv_heads, group * n, head_dim], row g * n + i = row i of head g."""
    n = q.shape[0]
    if n == 1:
        return q.reshape(spec.num_kv_heads, spec.group_size, spec.head_dim)
    return (
        q.reshape(n, spec.num_kv_heads, spec.group_size, spec.head_dim)
        .permute(1, 2, 0, 3)
        .reshape(spec.num_kv_heads, spec.group_size * n, spec.head_dim)
    )


def unfold(spec: AttentionSpec, out: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `fold`, flattened: [kv_heads, group * n, head_dim] -> [n, q_size]."""
    if n == 1:
        return out.reshape(1, spec.q_size)
    out = out.reshape(spec.num_kv_heads, spec.group_size, n, spec.head_dim)
    return out.permute(2, 0, 1, 3).reshape(n, spec.q_size)


# ---------------------------------------------------------------------------- the backends
# On CUDA, SDPA without cuDNN: cuDNN's attention builds a plan for every new key length, ~1 ms of
# host time per call, and a decode step's key length is new every step (on an H200, the 1.5B's
# decode step through SDPA was 34 ms with it and the forward 7 ms at a fixed length). The flash and
# memory-efficient kernels take any length without a plan; math is the last resort.
CUDA_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def sdpa_rows(
    spec: AttentionSpec,
    q: torch.Tensor,
    kv: PagedKVCache,
    layer: int,
    plan: SeqSlots,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """One sequence's q [n, heads, head_dim] -> [n, heads * head_dim] over its cached + new keys.

    Grouped-query attention without repeating K/V: the `group` query heads that share a KV head
    are stacked along the row axis, so SDPA sees [kv_heads, group * n, head_dim] queries against
    [kv_heads, L, head_dim] keys (the mask is repeated per group)."""
    k, v = kv.layer_kv(layer, plan.read)  # [kv_heads, L, head_dim] each
    dt = spec.attn_dtype
    q, k, v = q.to(dt), k.to(dt), v.to(dt)  # no-ops unless the precisions differ
    args = (fold(spec, q).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0))
    if q.is_cuda:
        with sdpa_kernel(list(CUDA_SDPA_BACKENDS)):
            out = F.scaled_dot_product_attention(*args, attn_mask=mask)
    else:
        out = F.scaled_dot_product_attention(*args, attn_mask=mask)
    return unfold(spec, out.to(spec.dtype), q.shape[0])


def _masks(
    spec: AttentionSpec, rows: ForwardRows, which: range | tuple[int, ...]
) -> list[torch.Tensor | None]:
    return [
        attention_mask(x, n, spec.group_size, spec.attn_dtype, spec.device) if i in which else None
        for i, (x, n) in enumerate(zip(rows.inputs, rows.cached, strict=True))
    ]


class Sdpa(AttentionBackend):
    name = "sdpa"

    def usable(self, spec: AttentionSpec) -> bool:
        return True

    def prepare(self, spec: AttentionSpec, rows: ForwardRows, kv: PagedKVCache) -> Attend:
        masks = _masks(spec, rows, range(len(rows.inputs)))

        def attend(q: torch.Tensor, layer: int) -> torch.Tensor:
            if len(rows.inputs) == 1:
                return sdpa_rows(spec, q, kv, layer, rows.plans[0], masks[0])
            return torch.cat(
                [
                    sdpa_rows(spec, q[a:b], kv, layer, plan, mask)
                    for (a, b), plan, mask in zip(rows.bounds, rows.plans, masks, strict=True)
                ]
            )

        return attend


class CpuInvariant(AttentionBackend):
    name = "cpu-invariant"

    def usable(self, spec: AttentionSpec) -> bool:
        return (
            spec.attn_dtype == spec.dtype
            and cpu_attention.supports(spec.head_dim, spec.dtype, spec.device)
            and cpu_attention.load() is not None
        )

    def reads(self, kv: PagedKVCache) -> bool:
        return kv.kt is not None  # the kernel's tiled keys

    def prepare(self, spec: AttentionSpec, rows: ForwardRows, kv: PagedKVCache) -> Attend:
        # per sequence: the slot of every position, the new-row mask, the cached length
        args = [
            (kv.read_slots(plan.read), allowed_rows(x), n)
            for x, plan, n in zip(rows.inputs, rows.plans, rows.cached, strict=True)
        ]
        scale = spec.head_dim**-0.5

        def attend(q: torch.Tensor, layer: int) -> torch.Tensor:
            kt, v = kv.layer_tiled(layer)
            parts = []
            for (a, b), (slots, allowed, cached) in zip(rows.bounds, args, strict=True):
                qg = fold(spec, q[a:b]).contiguous()
                out = cpu_attention.tree_attention(qg, kt, v, slots, allowed, cached, scale)
                parts.append(unfold(spec, out, b - a))
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        return attend


class Triton(AttentionBackend):
    name = "triton"

    def usable(self, spec: AttentionSpec) -> bool:
        """On a GPU with Triton installed ("triton" also forces it on a CPU, in Triton's
        interpreter: tests)."""
        return spec.attn_dtype == spec.dtype and triton_launch.available(
            spec.device, spec.dtype, spec.head_dim
        )

    def prepare(self, spec: AttentionSpec, rows: ForwardRows, kv: PagedKVCache) -> Attend:
        launch = triton_launch.prepare(rows.inputs, rows.cached, kv, spec.device)
        masks = _masks(spec, rows, launch.fallback)  # over-long tree sessions: SDPA

        def attend(q: torch.Tensor, layer: int) -> torch.Tensor:
            # index values checked once per forward, on a CPU only (on a GPU it would sync)
            check = layer == 0 and spec.device.type == "cpu"
            o = triton_launch.attend(q, kv, layer, launch, spec.head_dim**-0.5, check).view(
                q.shape[0], spec.q_size
            )
            for i in launch.fallback:
                a, b = rows.bounds[i]
                o[a:b] = sdpa_rows(spec, q[a:b], kv, layer, rows.plans[i], masks[i])
            return o

        return attend


# "model" tries them in this order: Triton on a GPU, the CPU kernel for float32 on a CPU, else SDPA
register(Triton())
register(CpuInvariant())
register(Sdpa())
