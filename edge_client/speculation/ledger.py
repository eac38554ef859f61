"""The ledger of sent trees: the one owner of the edge's rounds.

A round's life, each step one method (nothing else writes the ledger's state):

    sent               a tree left: what it assumes, its odds, the leaves still to evaluate
    leaves_evaluated   its pending leaves were evaluated (or could not be: the workspace was full)
    workspace_moved    the drafter left the workspace the pending leaves were in
    expanding          its outcomes are queued as candidates for conditional trees (once)
    reexpand           ... again, after the tree in flight was replayed in a new workspace
    attempt            a conditional draft was started for an outcome of it
    answered           its verdict came: it leaves the ledger, with the odds attempted for it
    stale / refused    the server will never verify it (stale) or had no room for it (refused)
    forget_unreachable a verdict ruled it out: it can never be verified

The ClientProtocol keeps the wire trees of the outstanding rounds (it checks the server's frames
against them); the ledger keeps what only the edge knows: the draft with its probabilities and
workspace ids, the committed sequence the tree assumes, its odds, its parent.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from edge_client.trees import DraftResult


@dataclass(frozen=True)
class Speculation:
    """A tree that was sent: its draft, the committed sequence it assumes, and its odds."""

    round: int
    draft: DraftResult
    full: tuple[int, ...]  # the committed sequence the tree assumes (its row 0 is full[-1])
    prob: float  # estimated probability that it gets verified
    parent: int | None  # the round whose outcome it assumes (None: drafted below the committed sequence)
    sent_at: float = 0.0


@dataclass(frozen=True)
class Answered:
    """A verdict's tree as the ledger had it (None: not a tree this ledger sent, e.g. mode ar), and
    the share of its odds that conditional drafts were started for (GenerationStats.predicted_hits)."""

    spec: Speculation | None
    predicted: float


def extends(full: tuple[int, ...], committed: tuple[int, ...]) -> bool:
    """full strictly extends committed (the tree is still to be verified)."""
    return len(full) > len(committed) and full[: len(committed)] == committed


class Ledger:
    """Every sent tree not yet answered, by round (see the module docstring)."""

    def __init__(self) -> None:
        self._specs: dict[int, Speculation] = {}
        self._leaves: dict[int, tuple[int, ...]] = {}  # leaves still to evaluate, per tree
        self._expanded: set[int] = set()  # trees whose outcomes were queued already
        self._attempted: dict[int, float] = {}  # odds of the outcomes conditional drafts were started for

    # ------------------------------------------------------------------ reading
    def get(self, rid: int) -> Speculation | None:
        return self._specs.get(rid)

    def __getitem__(self, rid: int) -> Speculation:
        return self._specs[rid]

    def __contains__(self, rid: object) -> bool:
        return rid in self._specs

    def __iter__(self) -> Iterator[Speculation]:
        return iter(list(self._specs.values()))

    def __len__(self) -> int:
        return len(self._specs)

    def children_of(self, rid: int) -> list[Speculation]:
        """The conditional trees sent for outcomes of tree `rid`."""
        return [s for s in self._specs.values() if s.parent == rid]

    def ahead(self, spec: Speculation) -> int:
        """How many unverified trees stand between the committed sequence and this one."""
        n = 0
        while spec.parent is not None and spec.parent in self._specs:
            spec = self._specs[spec.parent]
            n += 1
        return n

    def leaves_pending(self) -> dict[int, tuple[int, ...]]:
        """The leaves still to evaluate, per tree still in the ledger."""
        return {r: nodes for r, nodes in self._leaves.items() if r in self._specs}

    def has_pending_leaves(self) -> bool:
        return bool(self._leaves)

    def to_expand(self, max_chain: int) -> list[int]:
        """Trees whose outcomes are not queued yet, leaves evaluated, fewer than `max_chain` ahead."""
        return [
            r
            for r, s in self._specs.items()
            if r not in self._leaves and r not in self._expanded and self.ahead(s) < max_chain
        ]

    # ------------------------------------------------------------------ transitions
    def sent(self, spec: Speculation, leaves: tuple[int, ...] = ()) -> None:
        """Tree `spec.round` left, with `leaves` still to evaluate while it is in flight."""
        if spec.round in self._specs:
            raise ValueError(f"round {spec.round} is in the ledger already")
        self._specs[spec.round] = spec
        if leaves:
            self._leaves[spec.round] = tuple(leaves)

    def leaves_evaluated(self, results: dict[int, DraftResult | None]) -> None:
        """The pending leaves of these trees were evaluated (a tree's new draft) or given up (None)."""
        for rid, dr in results.items():
            self._leaves.pop(rid, None)
            spec = self._specs.get(rid)
            if spec is not None and dr is not None:
                self._specs[rid] = dataclasses.replace(spec, draft=dr)

    def workspace_moved(self) -> None:
        """The drafter left the workspace: the leaves pending there can no longer be evaluated."""
        self._leaves.clear()

    def expanding(self, rid: int) -> Speculation | None:
        """Tree `rid`'s outcomes are queued now; None if it is unknown or queued already."""
        spec = self._specs.get(rid)
        if spec is None or rid in self._expanded:
            return None
        self._expanded.add(rid)
        return spec

    def reexpand(self, rid: int) -> None:
        """Tree `rid`'s outcomes may be queued again (its workspace was replayed)."""
        self._expanded.discard(rid)

    def attempt(self, parent: int, prob: float) -> None:
        self._attempted[parent] = self._attempted.get(parent, 0.0) + prob

    def answered(self, rid: int) -> Answered:
        """Tree `rid` got its verdict: it leaves the ledger."""
        spec = self._forget(rid)
        attempted = self._attempted.pop(rid, 0.0)
        predicted = min(1.0, attempted / spec.prob) if spec is not None and spec.prob > 0 else 0.0
        return Answered(spec, predicted)

    def stale(self, rid: int) -> None:
        """The server will never verify tree `rid`."""
        self._forget(rid)
        self._attempted.pop(rid, None)

    def refused(self, rid: int) -> bool:
        """The server had no room for conditional tree `rid`; False if it is not one (then the
        ledger is unchanged)."""
        spec = self._specs.get(rid)
        if spec is None or spec.parent is None:
            return False
        self._forget(rid)
        return True

    def forget_unreachable(self, committed: tuple[int, ...]) -> None:
        """Forget the trees that can no longer be verified after `committed`."""
        for rid, s in list(self._specs.items()):
            if not (extends(s.full, committed) or s.full == committed):
                self._forget(rid)
                self._attempted.pop(rid, None)

    def _forget(self, rid: int) -> Speculation | None:
        self._leaves.pop(rid, None)
        self._expanded.discard(rid)
        return self._specs.pop(rid, None)


__all__ = ["Answered", "Ledger", "Speculation", "extends"]
