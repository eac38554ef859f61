"""API keys and the trust policy (DESIGN section 4).

A key file holds one key per line, optionally followed by the word `trusted`; `#` starts a comment.
Trusted keys may use the stochastic modes mss/rrs (a client that lies about q can bias its own
output, so only clients we trust may send q); everyone else gets greedy, match and ar. Without a
key file access is open and every client is untrusted, unless `trust_anonymous` (development).
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass
from pathlib import Path

from shared.messages import Mode

log = logging.getLogger(__name__)

UNTRUSTED_MODES = (Mode.GREEDY, Mode.MATCH, Mode.AR)
TRUSTED_MODES = (Mode.GREEDY, Mode.MATCH, Mode.MSS, Mode.RRS, Mode.AR)


@dataclass(frozen=True)
class Principal:
    """Who a session belongs to: the key's index in the file (never the key itself) and its trust."""

    name: str
    trusted: bool

    @property
    def allowed_modes(self) -> tuple[Mode, ...]:
        return TRUSTED_MODES if self.trusted else UNTRUSTED_MODES


class AuthError(Exception):
    pass


class KeyStore:
    def __init__(self, keys: dict[str, bool] | None, trust_anonymous: bool = False) -> None:
        self._keys = [(k.encode(), trusted) for k, trusted in (keys or {}).items()]
        self.open_access = keys is None
        self.trust_anonymous = trust_anonymous

    @classmethod
    def from_file(cls, path: str | None, trust_anonymous: bool = False) -> KeyStore:
        if path is None:
            log.warning(
                "no --api-key-file: access is open and every client is untrusted%s",
                " (but --trust-anonymous lets them use mss/rrs)" if trust_anonymous else "",
            )
            return cls(None, trust_anonymous)
        keys: dict[str, bool] = {}
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) > 2 or (len(parts) == 2 and parts[1] != "trusted"):
                raise ValueError(f"{path}:{n}: expected 'KEY' or 'KEY trusted', got {line!r}")
            keys[parts[0]] = len(parts) == 2
        if not keys:
            raise ValueError(f"{path}: no keys; remove --api-key-file for open access")
        return cls(keys, trust_anonymous)

    def authenticate(self, key: str | None) -> Principal:
        """The principal for `key`, or AuthError. Compares against every key in constant time."""
        if key is None:
            if self.open_access:
                return Principal("anonymous", self.trust_anonymous)
            raise AuthError("this server needs an API key (Authorization: Bearer KEY or hello.api_key)")
        given = key.encode()
        found: tuple[int, bool] | None = None
        for i, (k, trusted) in enumerate(self._keys):
            if hmac.compare_digest(k, given) and found is None:
                found = (i, trusted)
        if found is not None:
            return Principal(f"key#{found[0]}", found[1])
        if self.open_access:
            return Principal("anonymous", self.trust_anonymous)
        raise AuthError("unknown API key")
