"""API keys, the trust policy (docs/architecture.md §4) and per-key limits.

A key file holds one key per line, then optional words: `trusted`, `sessions=N` (at most N
concurrent sessions and HTTP generations under this key) and `tokens_per_min=M` (prompt and
generated tokens per minute, a token bucket of one minute's worth; a generation reserves its prompt
+ max tokens when it starts and gets back what it did not generate: cloud_verifier/admission.py),
e.g.

    # the mobile app
    k-3f9a1c trusted sessions=4 tokens_per_min=20000  # the current key
    k-7b#e2 sessions=1

A comment is a word that begins with `#`: a line whose first word does, or anything after a `#`
that follows whitespace. A `#` inside a word is part of it (the key `k-7b#e2` above is kept whole),
so a key may contain `#` but not begin with it. A key given twice is an error naming both lines.
`KeyStore.reload` reads the file again (the server does on SIGHUP): a file that fails to parse
leaves the keys in use as they were.

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
        self._named = len(self._keys)  # names given so far: a new key never takes an old key's name

    @classmethod
    def from_file(cls, path: str | None, trust_anonymous: bool = False) -> KeyStore:
        """The keys of `path` (OSError, or ValueError naming the file and line); None: open access."""
        if path is None:
            log.warning(
                "no --api-key-file: access is open and every client is untrusted%s",
                " (but --trust-anonymous lets them use mss/rrs)" if trust_anonymous else "",
            )
            return cls(None, trust_anonymous)
        store = cls({}, trust_anonymous)
        store.open_access = False
        store.reload(path)
        return store

    def reload(self, path: str) -> int:
        """Read the key file again; returns how many keys it holds. New requests and sessions see
        the new keys (open ones keep the principal they were admitted with); a key still in the
        file keeps its name, so its per-key limits count on. On OSError or ValueError nothing
        changes. Replacing the list is one assignment: a lookup sees the old keys or the new."""
        names = {k: p.name for k, p in self._keys}
        named = self._named
        keys: list[tuple[bytes, Principal]] = []
        for key, words, where in _read(path):
            name = names.get(key.encode())
            if name is None:
                name, named = f"key#{named}", named + 1
            keys.append((key.encode(), _principal(name, words, where)))
        self._keys, self._named = keys, named
        return len(keys)

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


def _read(path: str) -> list[tuple[str, list[str], str]]:
    """(key, its words, "path:line") per key line of a key file."""
    out: list[tuple[str, list[str], str]] = []
    first: dict[str, int] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        words = line.split()
        for i, w in enumerate(words):
            if w.startswith("#"):  # a comment: a word that begins with '#' and the rest of the line
                del words[i:]
                break
        if not words:
            continue
        key, *rest = words
        if key in first:
            raise ValueError(f"{path}:{n}: this key is already on line {first[key]}")
        first[key] = n
        out.append((key, rest, f"{path}:{n}"))
    if not out:
        raise ValueError(f"{path}: no keys; remove --api-key-file for open access")
    return out


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
