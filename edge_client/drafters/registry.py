"""Draft backends by name. Backends are imported only when asked for, so an app that drafts with
llama.cpp never imports torch (and a torch-only test never needs llama-cpp-python)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from edge_client.drafters.base import Drafter

# name -> (module, class, what to install when the import fails)
BACKENDS: dict[str, tuple[str, str, str]] = {
    "llama_cpp": ("edge_client.drafters.llama_cpp", "LlamaCppDrafter", "pip install 'treespec[edge]'"),
    "torch": ("edge_client.drafters.torch_drafter", "TorchDrafter", "pip install 'treespec[cloud]'"),
    "onnx": ("edge_client.drafters.onnx_drafter", "OnnxDrafter", "pip install 'treespec[onnx]'"),
}


def available_backends() -> list[str]:
    return list(BACKENDS)


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


def create_drafter(backend: str, model: str, **options: Any) -> Drafter:
    """A drafter of backend `backend` for `model` (a draft alias, a GGUF path, or for torch also a
    target name such as `tiny`). `options` go to the backend's constructor (n_threads, max_nodes, ...)."""
    factory: Callable[..., Drafter] = backend_class(backend)  # backends take (model, **options)
    return factory(model, **options)
