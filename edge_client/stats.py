"""What a generation measured: rounds, tokens per round, acceptance, timings, bytes, pre-speculation."""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SendEvent:
    """A tree left (round 0: with the prompt). parent: the round whose outcome it assumes (None:
    drafted below the committed sequence); ahead: tokens it assumes beyond the committed sequence
    when it left; prob: the odds the outcome model gave it of being verified."""

    t: float
    round: int
    parent: int | None
    nodes: int
    depth: int
    ahead: int
    prob: float
    size: int


@dataclass(frozen=True)
class VerdictEvent:
    """A verdict was taken up (t: when it arrived). accepted: nodes accepted; hit: the next tree
    was at the server already; next: the round now in flight (None: none, a miss)."""

    t: float
    round: int
    accepted: int
    tokens: int
    verify_ms: float
    hit: bool
    next: int | None
    done: bool


@dataclass(frozen=True)
class DraftEvent:
    """One draft action on the drafting thread, from t0 to t1: kind (plain, conditional, leaves,
    reanchor), the trees asked for, and each evaluation of the first drafter as (kind, rows, ms):
    "sync" of the committed tail or "extend" of draft nodes."""

    t0: float
    t1: float
    kind: str
    trees: int
    evaluations: tuple[tuple[str, int, float], ...]


@dataclass
class RoundTrace:
    """Every send, verdict and draft of a generation on the core's clock (seconds), for replaying
    the rounds under other costs (bench.simulate). Off unless asked for (EdgeClient(trace=True))."""

    sends: list[SendEvent] = field(default_factory=list)
    verdicts: list[VerdictEvent] = field(default_factory=list)
    drafts: list[DraftEvent] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "sends": [dataclasses.asdict(e) for e in self.sends],
            "verdicts": [dataclasses.asdict(e) for e in self.verdicts],
            "drafts": [dataclasses.asdict(e) for e in self.drafts],
        }


@dataclass
class GenerationStats:
    """Per-generation figures. tau = tokens per verdict (bonus included)."""

    rounds: int = 0
    tokens: int = 0
    accepted_counts: list[int] = field(default_factory=list)  # rounds that accepted a node at depth d+1
    rtt_ms: list[float] = field(default_factory=list)  # send -> verdict minus the server's verify ms
    verify_ms: list[float] = field(default_factory=list)
    # the server's wait before each round (verdict.gap_ms: from its previous verdict to this round's
    # tree being verified; ~0 for a pending tree, drafting + round trip after a miss)
    gap_ms: list[float] = field(default_factory=list)
    draft_ms: list[float] = field(default_factory=list)  # drafting on the critical path (not pre-speculation)
    tree_nodes: list[int] = field(default_factory=list)
    # the verifier's advertised forward ms for each verified tree's nodes (welcome.verify_cost_ms, measured
    # at its start-up with no edge drafting beside it): the same rounds' verify time with the edge idle
    idle_verify_ms: list[float] = field(default_factory=list)
    bytes_up: int = 0
    bytes_down: int = 0
    prespec_sent: int = 0  # conditional trees sent
    prespec_ms: float = 0.0  # drafting time spent on them (off the critical path)
    prespec_gated: int = 0  # times the cost gate held pre-speculation back until the next message
    prespec_cancelled: int = 0  # conditional drafts abandoned because a verdict ruled them out
    prespec_refused: int = 0  # conditional trees the server had no room for (TOO_MANY_PENDING), dropped
    hits: int = 0  # verdicts after which the next tree was already at the server
    decided: int = 0  # verdicts that left the generation running (the ones a hit could follow)
    predicted_hits: float = 0.0  # sum over decided verdicts of the predicted odds of a hit (calibration)
    hits_by_depth: dict[int, int] = field(default_factory=dict)  # accepted length of the outcome -> hits
    decided_by_depth: dict[int, int] = field(default_factory=dict)
    wall_s: float = 0.0
    first_token_s: float = 0.0
    resumes: int = 0  # times the connection dropped and the generation went on on a new session
    trace: RoundTrace | None = None  # every send, verdict and draft (None: not traced)
    # the miss path's trees by shape (speculation.backup)
    backups: dict[str, int] = field(default_factory=dict)
    # verdicts by the kind of round they answered: stream (one token the target streamed),
    # prespec (a tree sent before the verdict it assumed), chain, tree
    kinds: dict[str, int] = field(default_factory=dict)
    plans: dict[str, int] = field(default_factory=dict)  # mode auto's choices after a miss
    # mode auto: by kind of round, the tokens its verdicts brought and the user's wall time from
    # the previous verdict to each (the generation's first verdict, the prefill's, left out)
    kind_tokens: dict[str, int] = field(default_factory=dict)
    kind_ms: dict[str, float] = field(default_factory=dict)

    def count_round(self, kind: str) -> None:
        self.kinds[kind] = self.kinds.get(kind, 0) + 1

    def time_round(self, kind: str, tokens: int, ms: float) -> None:
        self.kind_tokens[kind] = self.kind_tokens.get(kind, 0) + tokens
        self.kind_ms[kind] = self.kind_ms.get(kind, 0.0) + ms

    @property
    def tau(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0

    @property
    def accepted_per_depth(self) -> list[float]:
        """Fraction of rounds that accepted a node at depth 1, 2, ..."""
        return [c / self.rounds for c in self.accepted_counts] if self.rounds else []

    @property
    def ms_per_token(self) -> float:
        return self.wall_s * 1e3 / self.tokens if self.tokens else 0.0

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.decided if self.decided else None

    @property
    def predicted_hit_rate(self) -> float | None:
        """Mean odds of a hit that the outcome model gave the conditional drafts it started
        (against hit_rate: how well calibrated the outcome model is)."""
        return self.predicted_hits / self.decided if self.decided else None

    def hit_rate_by_depth(self) -> dict[int, float]:
        return {k: self.hits_by_depth.get(k, 0) / n for k, n in sorted(self.decided_by_depth.items()) if n}

    def record_accepted(self, depths: list[int]) -> None:
        for d in depths:
            while len(self.accepted_counts) < d:
                self.accepted_counts.append(0)
            self.accepted_counts[d - 1] += 1

    def record_outcome(self, accepted: int, hit: bool, predicted: float = 0.0) -> None:
        self.decided += 1
        self.predicted_hits += predicted
        self.decided_by_depth[accepted] = self.decided_by_depth.get(accepted, 0) + 1
        if hit:
            self.hits += 1
            self.hits_by_depth[accepted] = self.hits_by_depth.get(accepted, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        def med(x: list[float]) -> float:
            return round(statistics.median(x), 3) if x else 0.0

        return {
            "rounds": self.rounds,
            "tau": round(self.tau, 4),
            "accepted_per_depth": [round(a, 4) for a in self.accepted_per_depth],
            "rtt_ms": med(self.rtt_ms),
            "verify_ms": med(self.verify_ms),
            "gap_ms": med(self.gap_ms) if self.gap_ms else None,
            "draft_ms": med(self.draft_ms),
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "tokens": self.tokens,
            "ms_per_token": round(self.ms_per_token, 3),
            "prespec_sent": self.prespec_sent,
            "prespec_gated": self.prespec_gated,
            "prespec_cancelled": self.prespec_cancelled,
            "hit_rate": None if self.hit_rate is None else round(self.hit_rate, 4),
            "predicted_hit_rate": (
                None if self.predicted_hit_rate is None else round(self.predicted_hit_rate, 4)
            ),
            "hit_rate_by_depth": {str(k): round(v, 4) for k, v in self.hit_rate_by_depth().items()},
            "backups": dict(self.backups),
            "kinds": dict(self.kinds),
            "plans": dict(self.plans),
            "kind_tokens": dict(self.kind_tokens),
            "kind_ms": {k: round(v, 3) for k, v in self.kind_ms.items()},
        }


@dataclass
class GenerationResult:
    """The outcome of one `generate` call (also filled while streaming)."""

    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    stats: GenerationStats = field(default_factory=GenerationStats)
    reason: str | None = None
