"""Sessions kept after their connection dropped, so that the client's resume finds its KV cache.

A client that names `session.resume` in its hello gets a resume token in its welcome. When that
connection drops without a close (a network cut, a proxy restart), the session's engine sequence is
not freed: its generation ends as a cancel would end it, and the sequence, with the KV cache of
every committed token, is *parked* under the token for `resume_keep_s`. The client's resume is a
new session whose hello names the token and whose prompt is the whole committed sequence: the
session claims the parked sequence, and at its prompt takes it over when the sequence is idle by
then, so the engine keeps the longest common prefix of its cache and the new prompt and prefills
only the rest (`StepRunner.start`). A sequence still running its last round then, or a token
nobody holds (another replica, expired, reclaimed), means a prefill of the whole prompt, exactly
as without the feature. The output is the same either way: cached rows are the rows a prefill
computes.

A parked sequence holds no generation, so its blocks are reclaimable like any idle session's
(`kv_room.py`): memory pressure frees them first. Parked sequences expire after `keep_s`, the
oldest goes when more than `max_parked` are kept, and a token is claimed once, by the principal
(API key) that owned the session.

A token is `<tag>.<random>`: the tag names the replica that holds the session (a fleet's router
sends the resume there; `cloud_verifier.fleet.router`), the random part is 128 bits, so a token
cannot be guessed.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass

from cloud_verifier.engine import Engine
from cloud_verifier.step import SeqState

log = logging.getLogger(__name__)

TAG_SEPARATOR = "."


def new_token(tag: str) -> str:
    """A fresh resume token of the replica `tag` (empty: no tag)."""
    random = secrets.token_urlsafe(16)
    return f"{tag}{TAG_SEPARATOR}{random}" if tag else random


def token_tag(token: str) -> str:
    """The replica tag a resume token names ("" if none)."""
    tag, sep, _ = token.rpartition(TAG_SEPARATOR)
    return tag if sep else ""


@dataclass
class Parked:
    """One parked sequence: the engine it lives in, its owner's name and when it expires."""

    seq: SeqState
    engine: Engine
    principal: str
    expires: float


class ParkedSessions:
    """The sequences kept for a resume, by token (see the module doc)."""

    def __init__(self, keep_s: float = 30.0, tag: str = "", max_parked: int = 256) -> None:
        self.keep_s = keep_s  # 0: nothing is parked (no token is given out)
        self.tag = tag  # the replica's tag in its tokens (a fleet replica's id)
        self.max_parked = max_parked
        self._parked: OrderedDict[str, Parked] = OrderedDict()
        self._timer: asyncio.TimerHandle | None = None
        self.parked_total = 0
        self.expired_total = 0

    def __len__(self) -> int:
        return len(self._parked)

    def tokens(self) -> list[str]:
        """The tokens held now (what a replica publishes to its router)."""
        return list(self._parked)

    @property
    def enabled(self) -> bool:
        return self.keep_s > 0

    def new_token(self) -> str | None:
        """A token for a new session (None: resuming is off)."""
        return new_token(self.tag) if self.enabled else None

    def park(self, token: str, seq: SeqState, engine: Engine, principal: str) -> None:
        """Keep `seq` (its generation already ended) under `token` for keep_s seconds."""
        if not self.enabled:
            engine.close(seq)
            return
        old = self._parked.pop(token, None)
        if old is not None:  # (a token is one session's: never seen twice)
            old.engine.close(old.seq)
        self._parked[token] = Parked(seq, engine, principal, time.monotonic() + self.keep_s)
        self.parked_total += 1
        while len(self._parked) > self.max_parked:
            _, oldest = self._parked.popitem(last=False)
            oldest.engine.close(oldest.seq)
        self._arm()

    def claim(self, token: str, principal: str) -> SeqState | None:
        """The sequence parked under `token` for `principal`, taken out of the store (the caller
        owns it now and closes it); None if there is none, it expired, or it is someone else's."""
        self.expire()
        p = self._parked.get(token)
        if p is None:
            return None
        if p.principal != principal:
            log.warning("resume token of another principal refused", extra={"principal": principal})
            return None
        del self._parked[token]
        return p.seq

    def expire(self, now: float | None = None) -> int:
        """Close the sequences past their time; how many."""
        now = time.monotonic() if now is None else now
        gone = [t for t, p in self._parked.items() if p.expires <= now]
        for t in gone:
            p = self._parked.pop(t)
            p.engine.close(p.seq)
        self.expired_total += len(gone)
        return len(gone)

    def close_all(self) -> None:
        """Free every parked sequence (the service stops)."""
        for p in self._parked.values():
            p.engine.close(p.seq)
        self._parked.clear()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self) -> None:
        """Expire the next sequence on time (on the running loop; without one, expiry happens at
        the next claim)."""
        if self._timer is not None or not self._parked:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        first = min(p.expires for p in self._parked.values())
        self._timer = loop.call_later(max(0.0, first - time.monotonic()) + 0.01, self._fire)

    def _fire(self) -> None:
        self._timer = None
        self.expire()
        self._arm()
