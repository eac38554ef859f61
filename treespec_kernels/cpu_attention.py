"""CPU kernels of the float32 target (csrc/cpu_attention.cpp), built on first use: the
batch-invariant tree attention, a one-pass RMSNorm and the pool's tiled-key writer, with the
plain-torch reference of the attention (`reference_tree_attention`) that the tests compare it to.

Why it exists: with a GEMM-based attention (SDPA) a tree node's logits differ from decoding its
path token by token by up to a few 1e-4 on SmolLM2 (the sums over keys are blocked by the shapes
of the call), so "the same tokens as the target alone" would rest on luck at near-ties. This
kernel fixes every reduction's order by key position, and oneDNN's projections are already
row-invariant, so a node's logits are bit-identical to incremental decoding, in float32 and at
SDPA's speed. See the .cpp file for the scheme.

The extension is compiled with the system C++ compiler through torch.utils.cpp_extension (about a
minute, once per machine; cached under torch's extensions directory, keyed by this CPU's
instruction set so a cache copied to another machine is not reused). When it cannot be built the
model falls back to SDPA and torch's RMSNorm and says so once; `TREESPEC_CPU_KERNELS=off` skips
them outright.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_attention.cpp"
ENV = "TREESPEC_CPU_KERNELS"  # "off" (or "0") disables the kernels
HEAD_DIMS = tuple(range(16, 129, 16))

_lock = threading.Lock()
_module: Any = None
_error: str | None = None


def _cpu_tag() -> str:
    """A short hash of this CPU's model and instruction set (the build uses -march=native)."""
    text = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    text += line
                if line.startswith("flags"):
                    break
    except OSError:
        pass
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def disabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("off", "0")


def load() -> Any:
    """The compiled module, or None when it is disabled or cannot be built (reason: `error()`)."""
    global _module, _error
    if _module is not None or _error is not None or disabled():
        return _module
    with _lock:
        if _module is None and _error is None:
            try:
                from torch.utils import cpp_extension

                if shutil.which("ninja") is None:  # the venv's ninja when the venv is not activated
                    bindir = os.path.dirname(sys.executable)
                    os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")

                # -fopenmp: at::parallel_for is an inline OpenMP loop, serial without it; the
                # library it links, libgomp.so.1, resolves to the one torch has loaded already
                flags = ["-O3", "-march=native", "-ffp-contract=fast", "-fno-math-errno", "-fopenmp"]
                _module = cpp_extension.load(
                    name=f"treespec_cpu_attention_{_cpu_tag()}",
                    sources=[str(SOURCE)],
                    extra_cflags=flags,
                    extra_ldflags=["-fopenmp"],
                    verbose=False,
                )
            except Exception as exc:  # no compiler, no headers, a failed build
                _error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                log.warning("batch-invariant CPU attention unavailable (%s); using SDPA", _error)
    return _module


def error() -> str | None:
    return _error


def _require() -> Any:
    mod = load()
    if mod is None:
        raise RuntimeError(f"the CPU kernels are not available: {_error or 'disabled'}")
    return mod


def supports(head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel serves this model (float32 on CPU, head_dim a multiple of 16 up to 128)."""
    return device.type == "cpu" and dtype == torch.float32 and head_dim in HEAD_DIMS


def tree_attention(
    q: torch.Tensor,
    kt: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    allowed: torch.Tensor,
    cached: int,
    scale: float,
) -> torch.Tensor:
    """q: [kv_heads, group * n, hd] (row g * n + i = new row i of query head g); kt: [kv_heads,
    pool slots // 16, hd, 16] (the keys transposed within 16-slot tiles) and v: [kv_heads, pool
    slots, hd], one layer of the pool; slots: [cached + n] int64, the pool slot of every position;
    allowed: [n, n] bool (new row i sees new row j). Returns [kv_heads, group * n, hd]. Raises
    RuntimeError when the kernels are not available."""
    out: torch.Tensor = _require().tree_attention(q, kt, v, slots, allowed, cached, scale)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [rows, hidden] float32 -> RMSNorm(x) * weight in one pass per row (row-invariant).
    Raises RuntimeError when the kernel is not available."""
    out: torch.Tensor = _require().rms_norm(x.contiguous(), weight, eps)
    return out


def reference_tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    allowed: torch.Tensor,
    cached: int,
    scale: float,
) -> torch.Tensor:
    """What `tree_attention` computes, in plain torch (SDPA with the mask; equal to float32 rounding,
    not bit-identical). q: [kv_heads, group * n, hd]; k, v: [kv_heads, pool slots, hd] (keys not
    tiled); slots: [cached + n] int64; allowed: [n, n] bool. Returns [kv_heads, group * n, hd]."""
    n = allowed.shape[0]
    group = q.shape[1] // n
    seen = torch.ones(n, cached, dtype=torch.bool, device=allowed.device)
    mask = torch.cat((seen, allowed), dim=1).repeat(group, 1)
    out = F.scaled_dot_product_attention(
        q[None], k[None][:, :, slots], v[None][:, :, slots], attn_mask=mask, scale=scale
    )
    return out[0]
