"""What one generation asks of the speculation core (the tree shape, pre-speculation, the request), what
it is told of the drafter, and how it reports a refused generation."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from edge_client.speculation.auto import Plan
from edge_client.trees import Coupling, Saguaro, Sampling
from shared.messages import Error, Mode
from shared.tree import ExpansionConfig
from shared.wire import DEFAULT_WIRE_LIMITS

MAX_TREE_NODES = DEFAULT_WIRE_LIMITS.max_nodes  # the most nodes one tree frame may hold


@dataclass(frozen=True)
class TreeSpec:
    """The shape of the trees the edge drafts.

    static:   SpecInfer expansion <k1..km> (`expansion`)
    budget:   best-first tree of `budget` nodes (0: chosen each round from the server's cost curve)
    sequence: a chain of `depth` tokens (default: as deep as the static tree)
    """

    kind: Literal["static", "budget", "sequence"] = "static"
    expansion: ExpansionConfig = field(default_factory=ExpansionConfig)
    budget: int = 0
    depth: int = 0

    def __post_init__(self) -> None:
        nodes, level = 0, 1
        for k in self.expansion.ks:  # the static tree's nodes, stopping once past the limit
            level *= k
            nodes += level
            if nodes > MAX_TREE_NODES:
                break
        for what, n in (
            ("an expansion tree of", nodes),
            ("a budget of", self.budget),
            ("a depth of", self.depth),
        ):
            if not 0 <= n <= MAX_TREE_NODES:
                raise ValueError(
                    f"{what} {n}{'+' if n > MAX_TREE_NODES else ''} nodes: a tree holds at most "
                    f"{MAX_TREE_NODES} (the protocol's limit)"
                )

    @property
    def chain_depth(self) -> int:
        return self.depth or self.expansion.depth


class _Setting(str, enum.Enum):
    """A setting with named values: each is its string (str(), format() and JSON give the value)."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Allocation(_Setting):
    """How a tree's outcomes get conditional trees (speculation.outcomes.predict_outcomes)."""

    GEOMETRIC = "geometric"  # Saguaro's fan-out across accepted lengths
    TOP = "top"  # simply the most likely outcomes
    UNIFORM = "uniform"  # the same number at every accepted length


class BackupPolicy(_Setting):
    """The tree drafted after a miss (speculation.backup; PrespecConfig.backup)."""

    AUTO = "auto"  # the configured shape or a chain, whichever the measured costs favour
    TREE = "tree"  # always the configured shape
    CHAIN = "chain"  # always the best chain


ALLOCATIONS = tuple(a.value for a in Allocation)
BACKUPS = tuple(b.value for b in BackupPolicy)


def _one_of(values: tuple[str, ...]) -> str:
    """'a', 'b' or 'c': the allowed values, as an error names them."""
    quoted = [repr(v) for v in values]
    return f"{', '.join(quoted[:-1])} or {quoted[-1]}"


@dataclass(frozen=True)
class PrespecConfig:
    """How much to pre-speculate per round.

    fanout:      conditional trees drafted for the outcomes of one tree (Saguaro's geometric
                 allocation across accepted lengths, edge_client.speculation.outcomes)
    max_chain:   how many rounds ahead a speculation may reach (2: also the outcomes of a
                 conditional tree, before the verdict that would start it)
    byte_budget: bytes of conditional trees sent between two verdicts
    allocation:  "geometric" (Saguaro's fan-out), "top" (simply the most likely outcomes) or
                 "uniform" (the same number at every accepted length)
    r:           power-law exponent of the miss rate in the geometric rule
    gate:        draft a conditional tree only when its expected saving (hit: no drafting and no
                 round trip on the critical path) outweighs its expected cost (miss: the fallback
                 draft waits on the edge's one drafting thread until the conditional draft is
                 abandoned, at most one evaluation); edge_client.speculation.outcomes.worth_drafting
    min_gain:    with the gate, expected critical-path ms a conditional tree must save per ms spent
                 drafting it. 0 (latency first): draft whatever costs no expected latency; raise it
                 where edge energy matters, to hold back trees that would rarely be used
    batch:       conditional trees drafted together in lockstep (one drafter evaluation per level
                 for all of them; budget shapes: per best-first round), trees.lockstep
    batch_min_prob: a candidate joins the batch of a more likely one only when at least this likely
    leaf_min_reach: a sent tree's leaves (drafted but not evaluated) are evaluated after sending, to
                 predict the bonus token of the outcomes that accept them; only the leaves accepted
                 with at least this probability are (the side branches of a sampled tree, or every
                 leaf of a weak draft's, are almost never reached: evaluating them only occupies
                 the drafting thread, at about the cost of a tree node each)
    saguaro_c:   Saguaro sampling in mss / rrs (trees.Saguaro): at every node the q row the draws
                 come from and the verifier receives has the weights of the `fanout` + (draws
                 there) likeliest tokens, the drafted ones and the bonus candidates pre-speculation
                 caches, scaled by C (0 < C <= 1; 1: off), so that the bonus after a rejection
                 lands on a cached token more often. Output stays exactly the target's (the
                 verifier tests the draws against the row they came from); acceptance may fall
    cache:       the outcome cache (speculation.schedule; off by default: on the real pair
                 co-located it raised the hit rate but lowered tau and added late hits; docs/edge.md,
                 "Pre-speculation"):
                 the likeliest outcome of the tree in flight gets a tree of the configured shape,
                 drafted alone; then up to `outcomes` further outcomes are drafted together as
                 chains whose depths are planned against the drafter's measured cost per
                 evaluation and the time left before the verdict is due (static and sequence
                 shapes in greedy / match; otherwise, or before the drafter's costs are measured,
                 trees are batched as with cache off: `batch` at a time, each of the configured
                 shape)
    outcomes:    with the cache, the outcomes of one tree queued as candidates (Saguaro's N)
    backup:      the tree drafted after a miss, when its drafting is on the critical path
                 (speculation.backup): "auto" prices the configured shape and chains of every depth
                 with measured costs and drafts the one with the most tokens per ms of round
                 (greedy verification; at T > 0 the configured shape); "tree" always drafts the
                 configured shape; "chain" always the best chain
    """

    fanout: int = 3
    max_chain: int = 3
    batch: int = 4
    batch_min_prob: float = 0.03
    byte_budget: int = 64 * 1024
    allocation: Allocation | str = Allocation.GEOMETRIC  # a str is taken as its Allocation
    r: float = 1.0
    gate: bool = True
    min_gain: float = 0.0
    leaf_min_reach: float = 0.02
    saguaro_c: float = 1.0
    backup: BackupPolicy | str = BackupPolicy.AUTO  # a str is taken as its BackupPolicy
    cache: bool = False
    outcomes: int = 24

    def __post_init__(self) -> None:
        # the enum settings also take their values as strings (the CLI's, a JSON file's)
        for name, kind in (("allocation", Allocation), ("backup", BackupPolicy)):
            value = getattr(self, name)
            if not isinstance(value, kind):
                if value not in tuple(k.value for k in kind):
                    allowed = _one_of(tuple(k.value for k in kind))
                    raise ValueError(f"PrespecConfig.{name} must be {allowed}, got {value!r}")
                object.__setattr__(self, name, kind(value))
        checks = (
            ("fanout", self.fanout >= 1, "at least 1"),
            ("max_chain", self.max_chain >= 1, "at least 1"),
            ("batch", self.batch >= 1, "at least 1"),
            ("batch_min_prob", 0 <= self.batch_min_prob <= 1, "in [0, 1]"),
            ("byte_budget", self.byte_budget >= 0, "0 or more"),
            ("r", self.r > 0, "positive"),
            ("min_gain", self.min_gain >= 0, "0 or more"),
            ("leaf_min_reach", 0 <= self.leaf_min_reach <= 1, "in [0, 1]"),
            ("saguaro_c", 0 < self.saguaro_c <= 1, "in (0, 1] (1: off)"),
            ("outcomes", self.outcomes >= 1, "at least 1"),
        )
        for name, ok, what in checks:
            if not ok:
                raise ValueError(f"PrespecConfig.{name} must be {what}, got {getattr(self, name)!r}")

    @property
    def saguaro(self) -> Saguaro | None:
        """Saguaro sampling for the mss / rrs trees of a pre-speculating generation (its
        Sampling.saguaro), None when saguaro_c is 1."""
        return Saguaro(self.saguaro_c, self.fanout) if self.saguaro_c < 1 else None


@dataclass(frozen=True)
class Request:
    """What one generation asks for, as the speculation core needs it."""

    mode: Mode
    tree: TreeSpec
    sampling: Sampling | None = None
    rng: np.random.Generator | None = None
    coupling: Coupling | None = None  # mode match at temperature > 0 (edge_client.trees.Coupling)
    plan: Plan | None = None  # mode auto: streaming or speculating, round by round (speculation.auto)


class Refused(Exception):
    """The verifier refused the generation (an error frame about it, not a dropped speculation)."""

    def __init__(self, error: Error) -> None:
        super().__init__(error.message)
        self.error = error


@dataclass(frozen=True)
class DrafterProfile:
    """What the core's dynamic budget and miss path need to know of the drafter (the draft step
    supplies it): its workspace, its ms per node, and its ms for one evaluation of n rows (None
    before it measured any)."""

    max_nodes: int
    ms_per_node: Callable[[], float]
    eval_ms: Callable[[int], float | None] = lambda rows: None


__all__ = ["Allocation", "BackupPolicy", "DrafterProfile", "PrespecConfig", "Refused", "Request", "TreeSpec"]
