"""API keys, the trust policy (DESIGN section 4) and per-key limits.

A key file holds one key per line, then optional words: `trusted`, `sessions=N` (at most N
concurrent sessions and HTTP generations under this key) and `tokens_per_min=M` (tokens generated
per minute, a token bucket of one minute's worth); `#` starts a comment, e.g.

    k-3f9a1c trusted sessions=4 tokens_per_min=20000

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
    """Who a session belongs to: the key's index in the file (never the key itself), its trust and
    its limits (None: only the server's)."""

    name: str
    trusted: bool
    max_sessions: int | None = None
    tokens_per_min: int | None = None

    @property
    def allowed_modes(self) -> tuple[Mode, ...]:
        return TRUSTED_MODES if self.trusted else UNTRUSTED_MODES


class AuthError(Exception):
    pass


class KeyStore:
    def __init__(self, keys: dict[str, bool | Principal] | None, trust_anonymous: bool = False) -> None:
        self._keys = [
            (k.encode(), v if isinstance(v, Principal) else Principal(f"key#{i}", v))
            for i, (k, v) in enumerate((keys or {}).items())
        ]
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
        keys: dict[str, bool | Principal] = {}
        for n, line in enumerate(Path(path).read_text().splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            key, *words = line.split()
            keys[key] = _principal(f"key#{len(keys)}", words, f"{path}:{n}")
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
        found: Principal | None = None
        for k, principal in self._keys:
            if hmac.compare_digest(k, given) and found is None:
                found = principal
        if found is not None:
            return found
        if self.open_access:
            return Principal("anonymous", self.trust_anonymous)
        raise AuthError("unknown API key")


def _principal(name: str, words: list[str], where: str) -> Principal:
    trusted = False
    limits: dict[str, int] = {}
    for w in words:
        if w == "trusted":
            trusted = True
            continue
        field, _, value = w.partition("=")
        if field not in ("sessions", "tokens_per_min") or not value.isdigit() or int(value) < 1:
            raise ValueError(
                f"{where}: expected 'KEY [trusted] [sessions=N] [tokens_per_min=M]' (N, M >= 1), got {w!r}"
            )
        limits[field] = int(value)
    return Principal(name, trusted, limits.get("sessions"), limits.get("tokens_per_min"))
