"""Room in the paged KV pool for every generation the engine runs: reservations, a queue, preemption.

A generation is *admitted* when the most it can grow to fits beside what every admitted generation
reserved: its committed tokens at their longest (prompt + max_new_tokens, within max_context) and
the largest tree one of its rounds may carry (`worst_positions`). Otherwise it waits, before its
prefill, in a first-come-first-served queue (an HTTP request and a WebSocket prompt alike); a
generation that ends or closes gives its reservation back and the waiters that now fit are admitted
in order. Nothing that fits the pool alone is refused: a worst case larger than the pool reserves
the whole pool (it runs when nothing else is admitted). Only a prompt the pool cannot hold even
empty is admitted at once without a reservation, so that its step refuses it (BUSY) without a wait.

Blocks held by a session with no generation admitted (a WebSocket session's context cached between
generations, a queued prompt's cached prefix) are reclaimable: they are freed when an admitted
round needs the room, and that session prefills its context again if it continues.

Preemption is the fallback when a step's rounds still do not fit (a round that outgrew its
reservation), vLLM's recompute preemption: the latest-admitted session that holds blocks and was
admitted after the round's own has its KV freed, and the engine later prefills it again from its
committed tokens, so its output is unchanged and its client sees a delay. A round that finds no
such victim waits for a later step; the earliest-admitted session always runs, so the engine never
livelocks. A preempted session keeps its admission (and its place in the order).

Only the event loop's thread uses a KVRoom, between engine steps (step.py says which thread owns
what); the pool's own bookkeeping is under the pool's lock.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.model.kv_cache import PagedKVCache


def worst_positions(prompt_len: int, max_new_tokens: int, max_context: int, tree_rows: int) -> int:
    """The most KV positions a generation can hold at once: its committed tokens at their longest
    (at least one token is always generated; max_context bounds the rest), then a round's rows past
    them (row 0 is the last committed token, so a round of `tree_rows` nodes reaches `tree_rows`
    positions further)."""
    longest = max(prompt_len + 1, min(prompt_len + max_new_tokens, max_context))
    return longest + tree_rows


@dataclass
class KVRoom:
    """Which generations hold room in `kv`: reservations in blocks, the admission order, the queue."""

    kv: PagedKVCache
    reserved: dict[int, int] = field(default_factory=dict)  # admitted session -> blocks reserved
    order: dict[int, int] = field(default_factory=dict)  # admitted session -> admission number
    queue: collections.deque[tuple[int, int]] = field(default_factory=collections.deque)  # (sid, blocks)
    doomed: set[int] = field(default_factory=set)  # admitted sessions whose prompt the pool cannot hold
    preemptions: int = 0  # sessions whose blocks were freed for an earlier-admitted session's round
    _admitted: int = 0

    @property
    def reserved_blocks(self) -> int:
        return sum(self.reserved.values())

    @property
    def queued(self) -> int:
        return len(self.queue)

    def request(self, sid: int, positions: int, first: int) -> bool:
        """Admit `sid`'s new generation (True), or queue it until it fits (False). `positions`: the
        most it can hold (worst_positions); `first`: the positions of its first round."""
        self.release(sid)
        kv = self.kv
        if kv.blocks_for(first) > kv.num_blocks:  # never fits: its step refuses it at once
            self._admit(sid, 0)
            self.doomed.add(sid)
            return True
        blocks = min(kv.blocks_for(positions), kv.num_blocks)
        if not self.queue and self.reserved_blocks + blocks <= kv.num_blocks:
            self._admit(sid, blocks)
            return True
        self.queue.append((sid, blocks))
        return False

    def release(self, sid: int) -> None:
        """`sid`'s generation ended, or it closed: its reservation (or its place in the queue) goes.
        Call `admit_waiting` after it."""
        self.reserved.pop(sid, None)
        self.order.pop(sid, None)
        self.doomed.discard(sid)
        if any(q == sid for q, _ in self.queue):
            self.queue = collections.deque((q, b) for q, b in self.queue if q != sid)

    def admit_waiting(self) -> list[int]:
        """Admit the queue's first sessions while they fit, in order; the sessions admitted."""
        admitted = []
        while self.queue and self.reserved_blocks + self.queue[0][1] <= self.kv.num_blocks:
            sid, blocks = self.queue.popleft()
            self._admit(sid, blocks)
            admitted.append(sid)
        return admitted

    def _admit(self, sid: int, blocks: int) -> None:
        self._admitted += 1
        self.reserved[sid] = blocks
        self.order[sid] = self._admitted

    def fit(self, rounds: Sequence[tuple[int, int]]) -> tuple[set[int], list[int]]:
        """Make room for a step's rounds, (session, rows) each: the sessions whose rounds run now, and
        the sessions preempted for them (their KV freed: recompute them from their committed tokens).
        Reclaimable blocks go first, then later-admitted sessions' blocks (the latest first)."""
        kv = self.kv
        need = {sid: kv.blocks_needed(sid, rows) for sid, rows in rounds}
        free = kv.num_free_blocks
        if sum(need.values()) <= free:
            return set(need), []
        runs: set[int] = set()
        preempted: list[int] = []
        for sid, _ in sorted(rounds, key=lambda r: self.order.get(r[0], math.inf)):
            if sid in preempted:
                continue
            if sid in self.doomed:  # the step refuses it (BUSY): it takes nothing from anyone
                runs.add(sid)
                continue
            while free < need[sid] and (victim := self._victim(sid, runs)) is not None:
                free += kv.blocks_held(victim)
                kv.truncate(victim, 0)
                if victim in self.order:
                    preempted.append(victim)
                    self.preemptions += 1
            if free >= need[sid]:
                runs.add(sid)
                free -= need[sid]
        return runs, preempted

    def _victim(self, sid: int, runs: set[int]) -> int | None:
        """Whose blocks go next for `sid`'s round: a session with no generation admitted, else the
        latest-admitted session admitted after `sid`; never one whose round already runs."""
        kv = self.kv
        holders = [s for s in kv.sequences() if s not in runs and s != sid and kv.blocks_held(s)]
        idle = [s for s in holders if s not in self.order]
        if idle:
            return idle[0]
        mine = self.order.get(sid, math.inf)
        later = [s for s in holders if self.order[s] > mine]
        return max(later, key=self.order.__getitem__, default=None)
