"""The ledger of sent trees: what each assumes, its odds, and what is still to do with it."""

from __future__ import annotations

from dataclasses import dataclass, field

from edge_client.trees import DraftResult


@dataclass
class Speculation:
    """A tree that was sent: its draft, the committed sequence it assumes, and its odds."""

    round: int
    draft: DraftResult
    full: tuple[int, ...]  # the committed sequence the tree assumes (its row 0 is full[-1])
    prob: float  # estimated probability that it gets verified
    parent: int | None  # the round whose outcome it assumes (None: drafted below the committed sequence)
    sent_at: float = 0.0


def extends(full: tuple[int, ...], committed: tuple[int, ...]) -> bool:
    """full strictly extends committed (the tree is still to be verified)."""
    return len(full) > len(committed) and full[: len(committed)] == committed


@dataclass
class Ledger:
    """Every sent tree not yet answered, by round.

    leaves_pending: per tree, the leaves still to be evaluated (PrespecConfig.leaf_min_reach)
    expanded:       trees whose outcomes were queued as candidates already
    attempted:      per tree, the summed odds of the outcomes a conditional draft was started for
                    (sent or abandoned), for GenerationStats.predicted_hits
    """

    specs: dict[int, Speculation] = field(default_factory=dict)
    leaves_pending: dict[int, list[int]] = field(default_factory=dict)
    expanded: set[int] = field(default_factory=set)
    attempted: dict[int, float] = field(default_factory=dict)

    def ahead(self, spec: Speculation) -> int:
        """How many unverified trees stand between the committed sequence and this one."""
        n = 0
        while spec.parent is not None and spec.parent in self.specs:
            spec = self.specs[spec.parent]
            n += 1
        return n

    def drop(self, rid: int) -> Speculation | None:
        self.attempted.pop(rid, None)
        self.leaves_pending.pop(rid, None)
        return self.specs.pop(rid, None)

    def drop_conditional(self, rid: int) -> bool:
        """Forget conditional tree `rid` (refused by the server); False if it is not one."""
        spec = self.specs.get(rid)
        if spec is None or spec.parent is None:
            return False
        del self.specs[rid]
        self.leaves_pending.pop(rid, None)
        return True

    def forget_unreachable(self, committed: tuple[int, ...]) -> None:
        """Forget the trees that can no longer be verified after `committed`."""
        self.specs = {
            r: s for r, s in self.specs.items() if extends(s.full, committed) or s.full == committed
        }
