"""Building the C++ CPU kernels on first use (csrc/), shared by every kernel module.

Each extension is compiled with the system C++ compiler through torch.utils.cpp_extension (about a
minute, once per machine; cached under torch's extensions directory, keyed by this CPU's
instruction set so a cache copied to another machine is not reused). When it cannot be built the
caller falls back and says so once; `TREESPEC_CPU_KERNELS=off` skips every kernel outright.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import re
import shutil
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ENV = "TREESPEC_CPU_KERNELS"  # "off" (or "0") disables the kernels
CSRC = Path(__file__).with_name("csrc")


def cpu_tag() -> str:
    """A short hash of this CPU's model and instruction set (the builds use -march=native)."""
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


def headers_tag(source: Path) -> str:
    """ "_" and a short hash of the csrc/ headers `source` includes ("" when none): torch rebuilds an
    extension when its source file changes, and a header's change must count as one."""
    names = re.findall(r'^#include "([^"]+)"', source.read_text(encoding="utf-8"), flags=re.M)
    if not names:
        return ""
    digest = hashlib.sha256()
    for name in names:
        digest.update((source.parent / name).read_bytes())
    return "_" + digest.hexdigest()[:8]


def disabled() -> bool:
    return os.environ.get(ENV, "").strip().lower() in ("off", "0")


class CppExtension:
    """One csrc/ source built lazily, at most once per process (thread-safe).

    name: the module name (the CPU tag is appended); source: the file in csrc/; flags: the
    compiler's (the linker gets -fopenmp when they have it); fallback: what the caller does
    without it, for the one warning. `module` is the built module once `load` has built it (the
    kernels' per-call paths read it without a call)."""

    def __init__(self, name: str, source: str, flags: Sequence[str], fallback: str) -> None:
        self.name = name
        self.source = CSRC / source
        self.flags = list(flags)
        self.fallback = fallback
        self._lock = threading.Lock()
        self.module: Any = None
        self._error: str | None = None

    def load(self) -> Any:
        """The compiled module, or None when it is disabled or cannot be built (reason: `error`)."""
        if self.module is not None or self._error is not None or disabled():
            return self.module
        with self._lock:
            if self.module is None and self._error is None:
                try:
                    self.module = self._build()
                except Exception as exc:  # no compiler, no headers, a failed build
                    self._error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                    log.warning("%s unavailable (%s); %s", self.name, self._error, self.fallback)
        return self.module

    def _build(self) -> Any:
        from torch.utils import cpp_extension

        if shutil.which("ninja") is None:  # the venv's ninja when the venv is not activated
            bindir = os.path.dirname(sys.executable)
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
        return cpp_extension.load(
            name=f"{self.name}_{cpu_tag()}{headers_tag(self.source)}",
            sources=[str(self.source)],
            extra_cflags=self.flags,
            extra_ldflags=["-fopenmp"] if "-fopenmp" in self.flags else [],
            verbose=False,
        )

    def error(self) -> str | None:
        return self._error

    def require(self) -> Any:
        mod = self.load()
        if mod is None:
            raise RuntimeError(
                f"the CPU kernels ({self.name}) are not available: {self._error or 'disabled'}"
            )
        return mod
