"""Draft models behind one interface (`Drafter`), chosen by name from a registry."""

from edge_client.drafters.base import (
    ContextFullError,
    Drafter,
    DrafterError,
    DrafterStats,
    WorkspaceFullError,
)
from edge_client.drafters.registry import available_backends, backend_class, create_drafter

__all__ = [
    "ContextFullError",
    "Drafter",
    "DrafterError",
    "DrafterStats",
    "WorkspaceFullError",
    "available_backends",
    "backend_class",
    "create_drafter",
]
