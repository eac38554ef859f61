"""The llama.cpp model handle shared by the edge tokenizer and the llama.cpp drafter.

llama-cpp-python's low-level API hands out raw pointers; this wrapper owns one `llama_model`, frees
it exactly once (on `close()` or garbage collection) and reads GGUF metadata through it. llama.cpp's
own log chatter is routed to the `edge_client.llama` logger (warnings at INFO, errors at ERROR), because a
library embedded in an app must not write to the app's stderr.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path
from typing import Any

import llama_cpp as llama

from shared.gguf_check import check_gguf

log = logging.getLogger("edge_client.llama")

_GGML_LOG_LEVEL_WARN = 3
_GGML_LOG_LEVEL_ERROR = 4
_init_lock = threading.Lock()
_log_callback: Any = None  # kept referenced: llama.cpp calls it for the life of the process


def _on_log(level: int, text: bytes | None, _user: ctypes.c_void_p) -> None:
    if text is None:
        return
    if level == _GGML_LOG_LEVEL_ERROR:
        log.error("%s", text.decode("utf-8", "replace").rstrip())
    elif level == _GGML_LOG_LEVEL_WARN:
        # llama.cpp's warnings are about the model file (e.g. Qwen's plain "</s>" token looking like
        # a control token); what matters to a caller surfaces as an error or a return code
        log.info("%s", text.decode("utf-8", "replace").rstrip())


def init_backend() -> None:
    """Initialise llama.cpp once per process and route its log through `logging`."""
    global _log_callback
    with _init_lock:
        if _log_callback is not None:
            return
        _log_callback = llama.llama_log_callback(_on_log)
        llama.llama_log_set(_log_callback, ctypes.c_void_p(0))
        llama.llama_backend_init()


def cpu_has_amx() -> bool:
    """True on CPUs with Intel AMX tiles (read from /proc/cpuinfo; False where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_tile" in line.split()
    except OSError:
        pass
    return False


def extra_buffers_default() -> bool:
    """Whether llama.cpp may put weights in its "extra" CPU buffer types (AMX tiles, repacked
    layouts). Off on AMX CPUs: llama.cpp's AMX matmul segfaults in the first llama_decode on the
    AMX machines these benches run on (every model and quantisation tried: Q4_1, Q4_K, Q8_0), and a
    native build enables it whenever the compiler sees AMX. `TREESPEC_LLAMA_EXTRA_BUFFERS=on|off`
    overrides the choice.
    """
    env = os.environ.get("TREESPEC_LLAMA_EXTRA_BUFFERS", "").strip().lower()
    if env in ("on", "1", "true", "yes"):
        return True
    if env in ("off", "0", "false", "no"):
        return False
    return not cpu_has_amx()


class NativeModel:
    """One loaded GGUF model (weights, or only the vocabulary with `vocab_only`). The file is
    validated first (`shared.gguf_check`: a `GGUFError` for a header its tensors do not back).

    extra_buffers: let llama.cpp repack weights into its extra CPU buffer types (None: see
    `extra_buffers_default`).
    """

    def __init__(
        self, path: str | Path, *, vocab_only: bool = False, extra_buffers: bool | None = None
    ) -> None:
        init_backend()
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        check_gguf(self.path)  # llama.cpp aborts the process on some headers: refuse them first
        params = llama.llama_model_default_params()
        params.vocab_only = vocab_only
        params.n_gpu_layers = 0  # the edge runs on the CPU; a GPU build would otherwise grab layers
        params.use_extra_bufts = extra_buffers_default() if extra_buffers is None else extra_buffers
        ptr = llama.llama_model_load_from_file(str(self.path).encode(), params)
        if not ptr:
            raise OSError(
                f"llama.cpp could not load {self.path}: is it a GGUF model file of a supported architecture?"
            )
        self.ptr: Any = ptr
        self.vocab: Any = llama.llama_model_get_vocab(ptr)
        self.n_vocab = int(llama.llama_vocab_n_tokens(self.vocab))

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as text, or None when the key is absent."""
        size = 256
        while True:
            buf = ctypes.create_string_buffer(size)
            n = int(llama.llama_model_meta_val_str(self.ptr, key.encode(), buf, size))
            if n < 0:
                return None
            if n < size:
                return buf.raw[:n].decode("utf-8", "replace")
            size = n + 1

    @property
    def n_layer(self) -> int:
        return int(llama.llama_model_n_layer(self.ptr))

    def close(self) -> None:
        ptr, self.ptr = getattr(self, "ptr", None), None
        if ptr:
            llama.llama_model_free(ptr)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown may have torn down the module already
            pass
