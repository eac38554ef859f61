"""Admission control: slots for generations, per-key limits, and a bounded queue of waiting work.

Every WebSocket session (from its welcome) and every HTTP generation holds one slot of
`capacity` (the server's max_sessions) and one of its key's `sessions=N`. A WebSocket hello that
finds no slot is refused at once (close 1013, with the wait to retry in the reason); an HTTP request
waits in a FIFO queue of at most `max_waiting` for up to `wait_s`, then gets 429 with Retry-After.
A key's `tokens_per_min` is a token bucket holding one minute's worth, charged for prompt and
output tokens alike. An HTTP generation reserves its whole cost at admission (prompt + max_tokens,
as a real API counts a request against its rate limit before running it): it is refused while
the bucket holds less (the wait until it refills is the Retry-After), and the tokens it did not
generate are refunded when it ends. A WebSocket generation reserves its prompt + max_new_tokens
the same way when it starts and is refunded what it did not generate when it ends. A key whose
limit changes (the key file reloaded) keeps its bucket's level, at the new rate. Nothing here
grows with the number of requests beyond `max_waiting` waiters; `close` (the drain) refuses the
waiters at once.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from dataclasses import dataclass, field

from cloud_verifier.auth import Principal


class AdmissionRefused(Exception):
    """No room now: `reason` says why, `retry_after_s` when to try again."""

    def __init__(self, reason: str, retry_after_s: float) -> None:
        super().__init__(reason)
        self.reason = reason
        self.retry_after_s = max(1, math.ceil(retry_after_s))


@dataclass
class _Bucket:
    rate: float  # tokens per second
    capacity: float
    level: float
    at: float = field(default_factory=time.monotonic)

    def refill(self) -> float:
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now
        return self.level


@dataclass(frozen=True)
class Ticket:
    """One held slot; give it back with Admission.release."""

    key: str


class Admission:
    def __init__(self, capacity: int, max_waiting: int, wait_s: float) -> None:
        self.capacity = capacity
        self.max_waiting = max_waiting
        self.wait_s = wait_s
        self.in_use = 0
        self.closed = False  # draining: nothing new is admitted
        self._per_key: collections.Counter[str] = collections.Counter()
        self._buckets: dict[str, _Bucket] = {}
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def _check(self, who: Principal, tokens: int = 0) -> None:
        if self.closed:
            raise AdmissionRefused("the server is draining: use another replica", 5)
        if who.max_sessions is not None and self._per_key[who.name] >= who.max_sessions:
            raise AdmissionRefused(
                f"this key's limit of {who.max_sessions} concurrent sessions is reached", 1
            )
        self.check_tokens(who, tokens)

    def check_tokens(self, who: Principal, tokens: int = 0) -> None:
        """AdmissionRefused unless the key's tokens-per-minute bucket holds `tokens` (0: is not empty); a
        cost over the whole bucket is never admitted (the caller refuses it first, as too large)."""
        if who.tokens_per_min is not None:
            b = self._bucket(who)
            need = max(tokens, 1)
            if b.refill() < need:
                what = f"{tokens} tokens" if tokens else "it"
                raise AdmissionRefused(
                    f"this key's limit of {who.tokens_per_min} tokens per minute is reached "
                    f"(it has {max(0, int(b.level))} left now, this request needs {what})",
                    (need - b.level) / b.rate,
                )

    def _bucket(self, who: Principal) -> _Bucket:
        assert who.tokens_per_min is not None
        per_min = float(who.tokens_per_min)
        b = self._buckets.get(who.name)
        if b is None:
            b = self._buckets[who.name] = _Bucket(per_min / 60.0, per_min, per_min)
        elif b.capacity != per_min:  # the key file was reloaded with another limit for this key
            b.refill()
            b.rate, b.capacity = per_min / 60.0, per_min
            b.level = min(b.level, per_min)
        return b

    def close(self) -> None:
        """Admit nothing new (the drain) and refuse every waiter now rather than at its timeout."""
        self.closed = True
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_exception(AdmissionRefused("the server is draining: use another replica", 5))

    def try_acquire(self, who: Principal) -> Ticket:
        """A slot now, or AdmissionRefused."""
        self._check(who)
        if self.in_use >= self.capacity or self._waiters:
            raise AdmissionRefused(f"the server is at its limit of {self.capacity} sessions", 1)
        return self._take(who)

    async def acquire(self, who: Principal, tokens: int = 0) -> Ticket:
        """A slot, waiting in the queue for up to wait_s if there is room in it; else AdmissionRefused.
        `tokens` (an HTTP generation's prompt + max_tokens) are taken from the key's bucket with
        the slot: give back what was not used with `refund`. Cancelled while it waits (its client
        went away), it leaves the queue and holds nothing, even if a slot was just handed to it."""
        self._check(who, tokens)
        if self.in_use < self.capacity and not self._waiters:
            return self._take(who, tokens)
        if len(self._waiters) >= self.max_waiting:
            raise AdmissionRefused(
                f"the server is at capacity and {self.max_waiting} requests already wait", 1
            )
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            async with asyncio.timeout(self.wait_s):
                await asyncio.shield(fut)
        except TimeoutError:
            self._give_back(fut)
            raise AdmissionRefused(f"no slot within {self.wait_s:g} s", 1) from None
        except asyncio.CancelledError:
            self._give_back(fut)
            raise
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)
        try:
            self._check(who, tokens)  # the key's own limits, again after the wait
        except AdmissionRefused:
            self._grant_next_or_free()
            raise
        self._per_key[who.name] += 1
        self._reserve(who, tokens)
        return Ticket(who.name)  # in_use was handed over by release()

    def _give_back(self, fut: asyncio.Future[None]) -> None:
        """A waiter leaves without its slot: one handed to it at the last moment passes on."""
        if fut.done() and not fut.cancelled() and fut.exception() is None:  # not refused by close
            self._grant_next_or_free()
        else:
            fut.cancel()

    def _take(self, who: Principal, tokens: int = 0) -> Ticket:
        self.in_use += 1
        self._per_key[who.name] += 1
        self._reserve(who, tokens)
        return Ticket(who.name)

    def _reserve(self, who: Principal, tokens: int) -> None:
        if who.tokens_per_min is not None and tokens:
            b = self._bucket(who)
            b.refill()
            b.level -= tokens

    def release(self, ticket: Ticket) -> None:
        self._per_key[ticket.key] -= 1
        if self._per_key[ticket.key] <= 0:
            del self._per_key[ticket.key]
        self._grant_next_or_free()

    def _grant_next_or_free(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot passes to the waiter: in_use stays
                return
        self.in_use -= 1

    def spend(self, who: Principal, tokens: int) -> None:
        """Tokens prefilled or generated under `who` (its bucket may go negative: the next
        generation waits)."""
        self._reserve(who, tokens)

    def refund(self, who: Principal, tokens: int) -> None:
        """Give back reserved tokens that were not used (a generation ended before max_tokens)."""
        if who.tokens_per_min is not None and tokens:
            b = self._bucket(who)
            b.level = min(b.capacity, b.refill() + tokens)
