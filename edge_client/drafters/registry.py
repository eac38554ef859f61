"""Draft backends by name. Backends are imported only when asked for, so an app that drafts with
llama.cpp never imports torch (and a torch-only test never needs llama-cpp-python).

`auto` (the default of `create_drafter` and of the edge CLI's --drafter) is not a backend but a
choice between two: llama.cpp and the ONNX int8 export of the same draft, whichever is faster on
this device (measured once, cached; edge_client.drafters.choice)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from edge_client.drafters.base import Drafter
from edge_client.drafters.choice import AUTO
from shared.model_store import DEFAULT_DRAFT

# name -> (module, class, what to install when the import fails)
BACKENDS: dict[str, tuple[str, str, str]] = {
    "llama_cpp": ("edge_client.drafters.llama_cpp", "LlamaCppDrafter", "pip install 'treespec[edge]'"),
    "torch": ("edge_client.drafters.torch_drafter", "TorchDrafter", "pip install 'treespec[cloud]'"),
    "onnx": ("edge_client.drafters.onnx_drafter", "OnnxDrafter", "pip install 'treespec[onnx]'"),
}


def available_backends() -> list[str]:
    return list(BACKENDS)


def backend_choices() -> list[str]:
    """What a --drafter flag accepts: `auto` (the default) and every backend."""
    return [AUTO, *BACKENDS]


def backend_class(name: str) -> type[Drafter]:
    """The Drafter subclass registered as `name` (imports its module now)."""
    try:
        module_name, cls_name, install = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown drafter backend {name!r}; one of {', '.join(BACKENDS)}") from None
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ImportError(
            f"drafter backend {name!r} needs a package that is missing ({exc}): {install}"
        ) from exc
    cls: type[Drafter] = getattr(module, cls_name)
    return cls


def create_drafter(backend: str = AUTO, model: str = DEFAULT_DRAFT, **options: Any) -> Drafter:
    """A drafter of backend `backend` for `model` (a draft alias, a GGUF path, or for torch also a
    target name such as `tiny`). `options` go to the backend's constructor (n_threads, max_nodes, ...).

    backend `auto`: llama.cpp or ONNX Runtime, whichever `choice.choose_backend` finds faster here
    (on first use of an alias: exports it to ONNX int8 and times both; later: read from the cache);
    it drafts with the thread count it measured unless `n_threads` is given."""
    if backend == AUTO:
        from edge_client.drafters.choice import choose_backend

        choice = choose_backend(str(model), n_threads=options.get("n_threads") or None)
        backend = choice.backend
        if choice.threads and not options.get("n_threads"):
            options = {**options, "n_threads": choice.threads}
        options = {**choice.options, **options}
    factory: Callable[..., Drafter] = backend_class(backend)  # backends take (model, **options)
    return factory(model, **options)
