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

How to add a backend: subclass `AttentionBackend` (a `name`, `usable`, `prepare` returning the
per-layer function), `register` it, and place it in `AUTO_ORDER` if "model" should pick it where
it is usable; tests/cloud_verifier/test_tree_forward.py compares every backend node by node.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from shared.model import triton_launch
from shared.model.inputs import SeqInput, allowed_rows, attention_mask
from shared.model.kv_cache import PagedKVCache, SeqSlots
from treespec_kernels import cpu_attention

if TYPE_CHECKING:
    from shared.model.llama import LlamaModel

# the `--attention` modes: "model" picks the best usable backend (AUTO_ORDER), the others force one
ATTENTION_MODES = ("model", "float64", "sdpa", "triton")

# (q [T, heads, head_dim] of every row of the forward, layer) -> [T, heads * head_dim]
Attend = Callable[[torch.Tensor, int], torch.Tensor]


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
    def usable(self, model: LlamaModel) -> bool:
        """Whether "model" may pick it for this model here (a mode that names a backend is
        checked by `check_mode` instead)."""

    def reads(self, kv: PagedKVCache) -> bool:
        """Whether it can read this pool (default: any)."""
        return True

    @abstractmethod
    def prepare(self, model: LlamaModel, rows: ForwardRows, kv: PagedKVCache) -> Attend:
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


def check_mode(model: LlamaModel, mode: str) -> None:
    """ValueError naming what is wrong when `mode` cannot serve this model."""
    if mode not in ATTENTION_MODES:
        raise ValueError(f"attention mode must be one of {ATTENTION_MODES}, got {mode!r}")
    if mode == "triton":
        c = model.config
        if not triton_launch.supports(model.dtype, c.head_dim):
            raise ValueError(
                f"attention 'triton' serves float16/bfloat16/float32 and head_dim in "
                f"{triton_launch.HEAD_DIMS}; this model is {model.dtype}, head_dim {c.head_dim}"
            )
        if not triton_launch.installed():
            raise ValueError("attention 'triton' needs Triton: pip install 'treespec[gpu]'")


def choose(model: LlamaModel, mode: str) -> AttentionBackend:
    """The backend of a mode: "sdpa" and "float64" -> sdpa, "triton" -> triton, "model" -> the
    first usable of AUTO_ORDER."""
    if mode in ("sdpa", "float64"):
        return BACKENDS["sdpa"]
    if mode == "triton":
        return BACKENDS["triton"]
    for name in AUTO_ORDER:
        if BACKENDS[name].usable(model):
            return BACKENDS[name]
    return BACKENDS["sdpa"]


def for_pool(backend: AttentionBackend, kv: PagedKVCache) -> AttentionBackend:
    """The chosen backend, or sdpa when it cannot read this pool."""
    return backend if backend.reads(kv) else BACKENDS["sdpa"]


# ---------------------------------------------------------------------------- grouped queries
def fold(model: LlamaModel, q: torch.Tensor) -> torch.Tensor:
    """[n, heads, head_dim] -> [kv_heads, group * n, head_dim], row g * n + i = row i of head g."""
    c = model.config
    n = q.shape[0]
    if n == 1:
        return q.reshape(c.num_kv_heads, c.group_size, c.head_dim)
    return (
        q.reshape(n, c.num_kv_heads, c.group_size, c.head_dim)
        .permute(1, 2, 0, 3)
        .reshape(c.num_kv_heads, c.group_size * n, c.head_dim)
    )


def unfold(model: LlamaModel, out: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `fold`, flattened: [kv_heads, group * n, head_dim] -> [n, q_size]."""
    c = model.config
    if n == 1:
        return out.reshape(1, c.q_size)
    out = out.reshape(c.num_kv_heads, c.group_size, n, c.head_dim)
    return out.permute(2, 0, 1, 3).reshape(n, c.q_size)


# ---------------------------------------------------------------------------- the backends
# On CUDA, SDPA without cuDNN: cuDNN's attention builds a plan for every new key length, ~1 ms of
# host time per call, and a decode step's key length is new every step (on an H200, the 1.5B's
# decode step through SDPA was 34 ms with it and the forward 7 ms at a fixed length). The flash and
# memory-efficient kernels take any length without a plan; math is the last resort.
CUDA_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def sdpa_rows(
    model: LlamaModel,
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
    dt = model.attn_dtype
    q, k, v = q.to(dt), k.to(dt), v.to(dt)  # no-ops unless the precisions differ
    args = (fold(model, q).unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0))
    if q.is_cuda:
        with sdpa_kernel(list(CUDA_SDPA_BACKENDS)):
            out = F.scaled_dot_product_attention(*args, attn_mask=mask)
    else:
        out = F.scaled_dot_product_attention(*args, attn_mask=mask)
    return unfold(model, out.to(model.dtype), q.shape[0])


def _masks(model: LlamaModel, rows: ForwardRows, which: range | tuple[int, ...]) -> list[torch.Tensor | None]:
    c = model.config
    return [
        attention_mask(x, n, c.group_size, model.attn_dtype, model.device) if i in which else None
        for i, (x, n) in enumerate(zip(rows.inputs, rows.cached, strict=True))
    ]


class Sdpa(AttentionBackend):
    name = "sdpa"

    def usable(self, model: LlamaModel) -> bool:
        return True

    def prepare(self, model: LlamaModel, rows: ForwardRows, kv: PagedKVCache) -> Attend:
        masks = _masks(model, rows, range(len(rows.inputs)))

        def attend(q: torch.Tensor, layer: int) -> torch.Tensor:
            if len(rows.inputs) == 1:
                return sdpa_rows(model, q, kv, layer, rows.plans[0], masks[0])
            return torch.cat(
                [
                    sdpa_rows(model, q[a:b], kv, layer, plan, mask)
                    for (a, b), plan, mask in zip(rows.bounds, rows.plans, masks, strict=True)
                ]
            )

        return attend


class CpuInvariant(AttentionBackend):
    name = "cpu-invariant"

    def usable(self, model: LlamaModel) -> bool:
        c = model.config
        return (
            model.attn_dtype == model.dtype
            and cpu_attention.supports(c.head_dim, model.dtype, model.device)
            and cpu_attention.load() is not None
        )

    def reads(self, kv: PagedKVCache) -> bool:
        return kv.kt is not None  # the kernel's tiled keys

    def prepare(self, model: LlamaModel, rows: ForwardRows, kv: PagedKVCache) -> Attend:
        # per sequence: the slot of every position, the new-row mask, the cached length
        args = [
            (kv.read_slots(plan.read), allowed_rows(x), n)
            for x, plan, n in zip(rows.inputs, rows.plans, rows.cached, strict=True)
        ]
        scale = model.config.head_dim**-0.5

        def attend(q: torch.Tensor, layer: int) -> torch.Tensor:
            kt, v = kv.layer_tiled(layer)
            parts = []
            for (a, b), (slots, allowed, cached) in zip(rows.bounds, args, strict=True):
                qg = fold(model, q[a:b]).contiguous()
                out = cpu_attention.tree_attention(qg, kt, v, slots, allowed, cached, scale)
                parts.append(unfold(model, out, b - a))
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        return attend


class Triton(AttentionBackend):
    name = "triton"

    def usable(self, model: LlamaModel) -> bool:
        """On a GPU with Triton installed ("triton" also forces it on a CPU, in Triton's
        interpreter: tests)."""
        c = model.config
        return model.attn_dtype == model.dtype and triton_launch.available(
            model.device, model.dtype, c.head_dim
        )

    def prepare(self, model: LlamaModel, rows: ForwardRows, kv: PagedKVCache) -> Attend:
        launch = triton_launch.prepare(rows.inputs, rows.cached, kv, model.device)
        masks = _masks(model, rows, launch.fallback)  # over-long tree sessions: SDPA
        c = model.config

        def attend(q: torch.Tensor, layer: int) -> torch.Tensor:
            # index values checked once per forward, on a CPU only (on a GPU it would sync)
            check = layer == 0 and model.device.type == "cpu"
            o = triton_launch.attend(q, kv, layer, launch, c.head_dim**-0.5, check).view(q.shape[0], c.q_size)
            for i in launch.fallback:
                a, b = rows.bounds[i]
                o[a:b] = sdpa_rows(model, q[a:b], kv, layer, rows.plans[i], masks[i])
            return o

        return attend


# "model" tries them in this order: Triton on a GPU, the CPU kernel for float32 on a CPU, else SDPA
register(Triton())
register(CpuInvariant())
register(Sdpa())
