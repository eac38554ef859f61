"""The TypeScript client's fixtures (tests.clients.typescript_support), for every test here."""

from __future__ import annotations

from tests.clients.typescript_support import built, tiny_export

__all__ = ["built", "tiny_export"]  # fixtures, used by name
