"""Mode auto: each round, the action with the most expected tokens per millisecond of the user's
time (objective `latency`), or the fewest verifier milliseconds per token no slower than `ar` by
more than a stated factor (objective `cost`), among letting the target stream and speculating.

Every price is measured where it is paid: the forward a next round would run in and what its rows
add to it come with every verdict (`verdict.forward_ms` / `marginal_ms`: the verifier's live cost
curve with the other sessions' rows it expects beside this one, so a loaded verifier looks dear);
the drafter's evaluation costs and the round trip are measured on the edge.

    stream:       the target decodes one token per forward, row 0 alone: forward_ms[0] a token for
                  the user, marginal_ms[0] a token for the cloud, no drafting and no round trip
                  after the first token;
    speculation:  a round of N nodes yields `tokens` (1 + expected accepted) in forward_ms[N] of
                  the verifier, plus, on a miss (odds 1 - hit rate), the drafting and the round
                  trip of the fallback tree; the cloud pays marginal_ms[N] for it.

While a tree is in flight the edge also leaves a stream waiting at the verifier where that is
priced faster than a verifier idle while the edge drafts (objective latency; `fallback_pays`): on a
miss the target streams instead of idling while the edge drafts, and the edge sends
its next tree below the sequence it knows; the verifier re-roots that tree below the tokens it
streamed meanwhile wherever they follow one of its paths (shared.tree_match.reroot) and verifies it
instead of the next stream step, so the stream hands over to it without a round trip. A generation
starts the same way: the prompt's answer streams (the prefill's token first) while the edge drafts
its first tree, so the time to the first token is the prefill's alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

OBJECTIVES = ("latency", "cost")


@dataclass(frozen=True)
class Plan:
    """What mode auto optimises.

    objective:    "latency" (the user's ms per token) or "cost" (the verifier's ms per token)
    max_slowdown: with "cost", a choice may be at most this factor slower per token than `ar`
                  (the target streaming alone)
    margin:       streaming replaces speculation only when it is this much faster (or cheaper):
                  estimates are noisy, and flapping between the two loses both
    explore:      while the target streams by choice, a tree is drafted anyway every this many
                  tokens: streaming teaches nothing of the drafts, and their odds may have changed
    explore_slow: the same while the realized rates (Realized) say speculation ran slower for the
                  user than the stream: trees go only this often, to measure them again
    """

    objective: str = "latency"
    max_slowdown: float = 1.25
    margin: float = 0.05
    explore: int = 8
    explore_slow: int = 32

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be 'latency' or 'cost', got {self.objective!r}")
        if self.explore < 1:
            raise ValueError(f"explore must be at least 1, got {self.explore!r}")
        if self.explore_slow < self.explore:
            raise ValueError(f"explore_slow must be at least explore, got {self.explore_slow!r}")
        if not self.max_slowdown >= 1.0:
            raise ValueError(f"max_slowdown must be at least 1, got {self.max_slowdown!r}")


@dataclass
class Rate:
    """Tokens and ms of the user's wall time, both decayed by `keep` per observation: a rate
    that follows the recent verdicts (about 1 / (1 - keep) of them)."""

    keep: float
    tokens: float = 0.0
    ms: float = 0.0
    seen: int = 0

    def add(self, tokens: int, ms: float) -> None:
        self.tokens = self.keep * self.tokens + tokens
        self.ms = self.keep * self.ms + max(ms, 0.0)
        self.seen += 1

    @property
    def ms_per_token(self) -> float | None:
        return self.ms / self.tokens if self.tokens > 0 else None


SPECULATIVE_KINDS = ("chain", "tree", "prespec")  # GenerationStats.kinds besides "stream"


@dataclass
class Realized:
    """What the user's tokens actually cost under mode auto, by kind of round: the wall time from
    one verdict to the next over the tokens it brought (a stream step's, a tree drafted after a
    miss or while the target streamed (chain, tree), a pre-speculated one (prespec)). The plans
    price rounds from estimates; this is the check on them: where a kind of speculation has been
    measurably slower for the user than the stream (`slower`), auto streams instead and drafts only
    to measure again (Plan.explore_slow), so that it does not stay slower than `ar`.

    A generation's first verdict (the prompt's prefill) is left out. Kept per client (Learned),
    so one generation's lesson carries to the next."""

    rates: dict[str, Rate] = field(default_factory=dict)
    min_seen: int = 4  # verdicts on each side before `slower` may say yes

    def observe(self, kind: str, tokens: int, ms: float) -> None:
        keep = 0.95 if kind == "stream" else 0.85  # about the last 20 stream steps, 7 trees
        self.rates.setdefault(kind, Rate(keep=keep)).add(tokens, ms)

    def ms_per_token(self, kinds: tuple[str, ...]) -> tuple[float | None, int]:
        """The pooled ms per token of `kinds` and how many verdicts it rests on."""
        rs = [self.rates[k] for k in kinds if k in self.rates]
        tokens, ms = sum(r.tokens for r in rs), sum(r.ms for r in rs)
        return (ms / tokens if tokens > 0 else None), sum(r.seen for r in rs)

    def slower(self, margin: float, kinds: tuple[str, ...] = SPECULATIVE_KINDS) -> bool:
        """Rounds of `kinds` have cost the user more per token than the stream, by more than
        `margin`, each side measured on at least min_seen verdicts."""
        spec, n_spec = self.ms_per_token(kinds)
        stream, n_stream = self.ms_per_token(("stream",))
        if spec is None or stream is None or min(n_spec, n_stream) < self.min_seen:
            return False
        return spec > (1.0 + margin) * stream


def measured_slower(plan: Plan, realized: Realized, kinds: tuple[str, ...] = SPECULATIVE_KINDS) -> bool:
    """Rounds of `kinds` have measurably cost the user more per token than the stream: beyond the
    plan's margin (objective latency), or beyond its allowed slowdown (cost)."""
    allowed = plan.margin if plan.objective == "latency" else plan.max_slowdown - 1.0
    return realized.slower(allowed, kinds)


def at(curve: Mapping[int, float], nodes: int) -> float:
    """ms at `nodes` from a cost map (linear between points, flat outside them)."""
    xs = np.asarray(sorted(curve), dtype=np.float64)
    ys = np.asarray([curve[int(x)] for x in xs], dtype=np.float64)
    return float(np.interp(float(nodes), xs, ys))


@dataclass(frozen=True)
class Option:
    """One action priced: the user's ms per token and the verifier's ms per token."""

    kind: str  # "stream" or "speculate"
    user_ms: float
    cloud_ms: float


def price_speculation(
    tokens: float,
    nodes: int,
    draft_ms: float,
    rtt_ms: float,
    hit_rate: float,
    forward: Mapping[int, float],
    marginal: Mapping[int, float],
) -> Option:
    """A speculative round of `nodes` nodes expected to yield `tokens` (see the module docstring)."""
    miss = (1.0 - min(max(hit_rate, 0.0), 1.0)) * (draft_ms + rtt_ms)
    t = max(tokens, 1e-9)
    return Option("speculate", (at(forward, nodes) + miss) / t, at(marginal, nodes) / t)


def price_stream(forward: Mapping[int, float], marginal: Mapping[int, float]) -> Option:
    return Option("stream", at(forward, 0), at(marginal, 0))


def choose(plan: Plan, spec: Option, stream: Option) -> Option:
    """The better of speculating and streaming under the plan's objective."""
    keep = 1.0 - plan.margin
    if plan.objective == "latency":
        return stream if stream.user_ms < keep * spec.user_ms else spec
    ar_ms = stream.user_ms  # `ar` is the target streaming: the slowdown is against it
    allowed = [o for o in (spec, stream) if o.user_ms <= plan.max_slowdown * ar_ms]
    if spec in allowed and stream in allowed:
        return stream if stream.cloud_ms < keep * spec.cloud_ms else spec
    return allowed[0] if allowed else min((spec, stream), key=lambda o: o.user_ms)


def fallback_pays(
    step_ms: float,
    draft_ms: float,
    rtt_ms: float,
    verify_ms: float,
    tokens: float,
    alpha: float,
    margin: float,
) -> bool:
    """Whether a stream waiting behind the tree in flight beats an idle verifier on a miss (the
    user's tokens per ms over the miss path; a renewal estimate).

    Without it the miss path yields `tokens` in draft + round trip + verify. With it the target
    streams a token every `step_ms` while the edge drafts; the edge's tree re-roots below the first
    streamed token with odds alpha (it follows the tree) and is verified once both are done,
    yielding the streamed token and the rest of the tree's; otherwise that token came alone and
    the edge drafts again."""
    idle = tokens / max(draft_ms + rtt_ms + verify_ms, 1e-9)
    took = alpha * (max(step_ms, draft_ms + rtt_ms) + verify_ms) + (1.0 - alpha) * step_ms
    streamed = (alpha * tokens + (1.0 - alpha)) / max(took, 1e-9)
    return streamed > (1.0 + margin) * idle


__all__ = [
    "OBJECTIVES",
    "SPECULATIVE_KINDS",
    "Option",
    "Plan",
    "Rate",
    "Realized",
    "at",
    "choose",
    "fallback_pays",
    "measured_slower",
    "price_speculation",
    "price_stream",
]
