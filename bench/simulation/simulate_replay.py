"""The discrete-event replay behind bench.simulation.simulate: one traced generation's rounds re-costed under
a drafter and a verifier cost curve and a policy (RTT, outcomes pre-speculated per tree, the miss
path's cost, the outcome cache's depth). bench/simulation/simulate.py's docstring has the trace format and
what a replay can honestly change.

The model (a discrete-event replay, one generation at a time):

- the edge has one drafting thread; it runs the logged draft actions in their order, each
  re-costed (its evaluations at the drafter curve's ms for their rows, plus the action's logged
  time outside evaluations), none before the verdict it followed in the log has arrived, and
  each after the same slack it had in the log (the core's own work between actions, sends);
- a tree leaves when the action that drafted it ends (plus the logged gap to its send) and
  reaches the verifier RTT/2 (+ half the link overhead measured in the traces) later;
- the verifier verifies the rounds in the logged order: a round sent after a miss starts when
  its tree arrives; after a hit the next starts when the previous verification ends (+ the
  server's per-round overhead measured in the traces), or when its tree arrives if later (a late
  hit: the verifier stalls). A verification takes V(N), N the tree's nodes (as the verifier's
  cost curve counts them; the prompt's round keeps its logged time, it holds the prefill, except
  with the flat verifier); the verdict reaches the edge RTT/2 later;
- on a miss the edge drafts synchronously (the logged miss-path draft re-costed: T_b) and sends;
  the conditional drafts of the old speculation not yet begun are dropped, and the one under way
  stops after its current evaluation (the core abandons a draft a verdict rules out); leaves
  being evaluated are finished;
- a generation's ms/token is (the replayed span from its first draft to its last verdict + the
  logged time outside that span) / its tokens.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from bench.simulation.simulate_trace import Curve, Overheads, TracedGeneration
from edge_client.stats import RoundTrace, SendEvent, VerdictEvent

# draft actions a miss drops when it comes before they begin (conditional drafts are also abandoned
# after the evaluation under way; leaves, once begun, are finished)
CUT_KINDS = ("conditional", "leaves")
SCENARIOS = ("colocated", "separate", "flat")


@dataclass
class _Draft:
    """A draft action on the replayed drafting thread."""

    epoch: int  # verdicts taken up before it started (it waits for the last of them)
    kind: str
    evals: list[tuple[int, float]]  # (rows, logged ms) of each evaluation
    other_ms: float  # its logged time outside evaluations
    slack_ms: float  # logged wait after it could have started (the core's work, sends)
    trees: int
    sends: list[SendEvent] = field(default_factory=list)
    send_gap_ms: dict[int, float] = field(default_factory=dict)  # round -> ms from its end to the send
    fixed_ms: float | None = None  # a fixed time instead of its evaluations (--backup-ms)
    synthetic: bool = False  # a miss path the policy made (no draft of the log)


def _drafts(trace: RoundTrace) -> list[_Draft]:
    vt = [v.t for v in trace.verdicts]
    out: list[_Draft] = []
    prev_end: float | None = None
    for d in sorted(trace.drafts, key=lambda e: e.t0):
        epoch = bisect.bisect_right(vt, d.t0)
        ready = d.t0 if prev_end is None else max(prev_end, vt[epoch - 1] if epoch else prev_end)
        evals = [(int(r), float(ms)) for _, r, ms in d.evaluations]
        other = max(0.0, (d.t1 - d.t0) * 1e3 - sum(ms for _, ms in evals))
        out.append(_Draft(epoch, d.kind, evals, other, max(0.0, (d.t0 - ready) * 1e3), d.trees))
        prev_end = d.t1
    # each send belongs to the last draft that ended before it
    ends = [d.t1 for d in sorted(trace.drafts, key=lambda e: e.t0)]
    for s in trace.sends:
        i = bisect.bisect_right(ends, s.t + 1e-9) - 1
        if i < 0:
            i = 0
        out[i].sends.append(s)
        out[i].send_gap_ms[s.round] = max(0.0, (s.t - ends[i]) * 1e3)
    return out


# --------------------------------------------------------------------------- the replay
@dataclass(frozen=True)
class Costs:
    """What drafting and verifying cost in a scenario (None: the trace's own logged ms)."""

    name: str
    drafter: Curve | None = None
    verifier: Curve | None = None
    prefill: str = "logged"  # round 0's verification: "logged" (it holds the prompt's prefill) or "curve"


@dataclass(frozen=True)
class Policy:
    """The knobs a replay can change (module docstring). None: as logged."""

    rtt_ms: float | None = None
    n: int | None = None
    backup_ms: float | None = None
    depth: int | None = None  # the deepest a conditional chain is drafted (_capped)
    depth_miss: bool = False  # the "then a miss" reading: a round a cap truncated is followed by a miss

    def label(self) -> str:
        knobs = (("rtt", self.rtt_ms), ("N", self.n), ("T_b", self.backup_ms), ("depth", self.depth))
        text = ", ".join(f"{k} {v:g}" for k, v in knobs if v is not None)
        if self.depth is not None and self.depth_miss:
            text += " (then a miss)"
        return "logged" if self == Policy() else text


@dataclass(frozen=True)
class Replay:
    """One generation replayed."""

    tokens: int
    ms: float  # replayed wall time (span + outside)
    span_ms: float
    outside_ms: float
    rounds: int
    decided: int
    hits: int
    stall_ms: float  # late hits: the verifier waited for the next tree
    miss_draft_ms: float  # synchronous drafting after misses (the critical path's)
    verify_ms: float  # the verifier's busy time
    prespec_ms: float  # drafting off the critical path
    tokens_lost: int = 0  # tokens a chain depth cap took from the rounds it truncated (_capped)

    @property
    def ms_per_token(self) -> float:
        return self.ms / self.tokens if self.tokens else 0.0


def _dropped_rounds(sends: Sequence[SendEvent], n: int | None) -> set[int]:
    """Conditional trees a policy of N outcomes per parent does not draft: beyond the N likeliest
    of their parent's, and the conditional trees below those."""
    if n is None:
        return set()
    by_parent: dict[int, list[SendEvent]] = {}
    for s in sends:
        if s.parent is not None:
            by_parent.setdefault(s.parent, []).append(s)
    dropped: set[int] = set()
    for kids in by_parent.values():
        kids.sort(key=lambda s: (-s.prob, s.round))
        dropped.update(s.round for s in kids[n:])
    return _with_descendants(sends, dropped)


def _with_descendants(sends: Sequence[SendEvent], rounds: set[int]) -> set[int]:
    """`rounds` and every conditional tree below them (trees of outcomes of trees never drafted
    were never drafted either)."""
    out = set(rounds)
    changed = True
    while changed:
        changed = False
        for s in sends:
            if s.parent in out and s.round not in out:
                out.add(s.round)
                changed = True
    return out


@dataclass(frozen=True)
class Capped:
    """A chain depth cap D applied to a log (Policy.depth): the conditional chains deeper than D
    (round -> D), the verdicts whose round it truncates (index -> tokens lost: the chain accepted
    more than D nodes), and, in the "then a miss" reading (Policy.depth_miss), the rounds no longer drafted
    because of it (the trees pre-speculated for a truncated round's logged outcome, which did not
    happen, and those below them)."""

    depth: dict[int, int]
    lost: dict[int, int]
    dropped: set[int]


def _capped(
    sends: Sequence[SendEvent],
    vs: Sequence[VerdictEvent],
    cap: int | None,
    dropped: set[int],
    next_miss: bool = False,
) -> Capped:
    """The depth cap's effect (Capped). A chain verified with a nodes accepted gives min(a, D) + 1
    tokens under the cap: the same round when a <= D (the same outcome, the same bonus token),
    else a - D tokens fewer and another outcome: every node accepted, and as the bonus the target's
    token after node D, which is the chain's own node D + 1 (the target accepted it). That is the
    outcome the edge pre-speculates first for any tree (all accepted, the draft's top-1 next), so by
    default the round that follows keeps its logged hit and timing; with `next_miss` (the "then a
    miss" reading) the tree the log pre-speculated for the logged outcome is useless and a hit on it
    becomes a miss. Later rounds stay as logged either way: their tokens are the
    log's, the lost ones are not made up."""
    if cap is None:
        return Capped({}, {}, set())
    depth = {
        s.round: cap
        for s in sends
        if s.parent is not None and s.nodes == s.depth and s.depth > cap and s.round not in dropped
    }
    lost = {j: v.accepted - cap for j, v in enumerate(vs) if v.round in depth and v.accepted > cap}
    if not next_miss:
        return Capped(depth, lost, set())
    wrong = _with_descendants(sends, {r for j in lost if (r := vs[j].next) is not None and not vs[j].done})
    # a chain no longer drafted (a miss path's tree verified in its place, as logged) is not capped
    depth = {r: d for r, d in depth.items() if r not in wrong}
    lost = {j: n for j, n in lost.items() if vs[j].round in depth}
    return Capped(depth, lost, wrong)


def logged_outcomes(trace: RoundTrace) -> int:
    """The most conditional trees the log sent for the outcomes of one tree."""
    per: dict[int, int] = {}
    for s in trace.sends:
        if s.parent is not None:
            per[s.parent] = per.get(s.parent, 0) + 1
    return max(per.values(), default=0)


def _eval_ms(costs: Costs, rows: int, logged: float) -> float:
    """One drafter evaluation of `rows` rows: at the drafter curve, else its logged ms."""
    return logged if costs.drafter is None else costs.drafter(rows)


def _draft_ms(costs: Costs, d: _Draft) -> float:
    """A draft action's time: its evaluations (_eval_ms) and its logged time outside them."""
    return sum(_eval_ms(costs, r, ms) for r, ms in d.evals) + d.other_ms


def _verify_ms(
    costs: Costs,
    vs: Sequence[VerdictEvent],
    nodes: Mapping[int, int],
    j: int,
    scale: Mapping[int, float] | None = None,
) -> float:
    """Verdict j's verification: at the verifier curve for its tree's nodes, else (and for the
    prompt's round 0 with a logged prefill) its logged ms (times `scale`'s factor for its round:
    a tree the policy made smaller)."""
    v = vs[j]
    if costs.verifier is None or (j == 0 and costs.prefill == "logged"):
        return v.verify_ms * (scale or {}).get(v.round, 1.0)
    return costs.verifier(nodes.get(v.round, 0))


def _miss_path(drafts: Sequence[_Draft], costs: Costs, backup_ms: float | None) -> tuple[float, float, float]:
    """The log's own miss paths (plain drafts after a verdict) take `backup_ms` when given (their
    fixed_ms is set); a miss path the policy makes: (its drafting time: `backup_ms`, else as long as
    the log's (median), else the first tree's drafting without its prompt sync; its slack; its gap
    to the send), the last two the log's miss paths' medians (0 without any)."""
    miss_drafts = [d for d in drafts if d.kind == "plain" and d.epoch > 0]
    if backup_ms is not None:
        for d in miss_drafts:
            d.fixed_ms = backup_ms
    if backup_ms is not None:
        template = backup_ms
    elif miss_drafts:
        template = statistics.median(_draft_ms(costs, d) for d in miss_drafts)
    else:
        first = next((d for d in drafts if d.kind == "plain"), None)
        ext = first.evals[1:] if first is not None else []
        template = sum(_eval_ms(costs, r, ms) for r, ms in ext) + (
            _eval_ms(costs, 1, ext[0][1]) if ext else 0.0
        )
    slack_plain = statistics.median(d.slack_ms for d in miss_drafts) if miss_drafts else 0.0
    gaps = [g for d in miss_drafts for g in d.send_gap_ms.values()]
    gap_plain = statistics.median(gaps) if gaps else 0.0
    return template, slack_plain, gap_plain


def _thinned(d: _Draft, dropped: set[int], own: Curve, cap: Mapping[int, int] | None = None) -> _Draft | None:
    """A draft action of the log under the policy: None when every tree it drafted is one the
    policy does not draft (`dropped`), else without those trees' sends and with fewer rows in each
    evaluation (their logged ms scaled along the generation's own drafter curve `own`), and
    without the evaluations past a depth cap (`cap`: round -> D, chains only, _cut_levels)."""
    d = _cut_levels(d, cap or {})
    kept = [s for s in d.sends if s.round not in dropped]
    if d.kind in CUT_KINDS and d.sends and not kept and len(d.sends) >= d.trees:
        return None  # every tree it drafted is one the policy does not draft
    if len(kept) < len(d.sends) and d.trees:
        left = d.trees - (len(d.sends) - len(kept))
        if all(s.nodes == s.depth for s in d.sends):
            # chains drafted together (the outcome cache's schedule): an evaluation holds a row
            # per chain still growing and the likeliest chains are the deepest, so keeping the
            # `left` likeliest caps every evaluation's rows at `left`
            fewer = [min(r, left) for r, _ in d.evals]
        else:  # trees of one shape in lockstep: each evaluation holds every tree's rows
            fewer = [max(1, round(r * left / d.trees)) for r, _ in d.evals]
        # the logged ms of fewer rows: scaled along this generation's own drafter curve
        evals = [(n, ms * own(n) / max(own(r), 1e-9)) for n, (r, ms) in zip(fewer, d.evals, strict=True)]
        d = replace(d, evals=evals, sends=kept)
    return d


def _cut_levels(d: _Draft, cap: Mapping[int, int]) -> _Draft:
    """A draft of chains (one, or several together: evaluation l holds a row for every chain
    deeper than l) whose deepest chains a depth cap shortens: the evaluations past the deepest
    chain left are not run. Drafts of trees, or whose evaluations do not match their chains'
    depths, stay as logged (at their logged cost)."""
    if not d.sends or not any(s.round in cap for s in d.sends) or d.fixed_ms is not None:
        return d
    if not all(s.parent is not None and s.nodes == s.depth for s in d.sends) or len(d.sends) < d.trees:
        return d
    old = max(s.depth for s in d.sends)
    new = max(min(s.depth, cap.get(s.round, s.depth)) for s in d.sends)
    if new >= old or len(d.evals) < old:
        return d
    return replace(d, evals=d.evals[: len(d.evals) - (old - new)])


def _plan(
    vs: Sequence[VerdictEvent],
    hit: Sequence[bool],
    drafts: Sequence[_Draft],
    dropped: set[int],
    nodes: Mapping[int, int],
    own: Curve,
    miss: tuple[float, float, float],
    cap: Mapping[int, int] | None = None,
) -> list[tuple[int, int, int, _Draft]]:
    """The draft actions of the replayed thread as (epoch, miss path first, log order, draft),
    sorted: a miss path of the policy's (`miss`: _miss_path's time, slack and gap) after each
    logged hit it turns into a miss, and the log's drafts under the policy (_thinned; `cap`: the
    depth cap's chains)."""
    template, slack_plain, gap_plain = miss
    plan: list[tuple[int, int, int, _Draft]] = []
    for j, v in enumerate(vs):
        if v.hit and not hit[j]:
            nxt = v.next
            assert nxt is not None
            s = SendEvent(v.t, nxt, None, nodes.get(nxt, 0), 0, 0, 1.0, 0)
            syn = _Draft(j + 1, "plain", [], 0.0, slack_plain, 1, [s], {nxt: gap_plain}, template, True)
            plan.append((j + 1, 0, -1, syn))
    for i, logged in enumerate(drafts):
        d = _thinned(logged, dropped, own, cap)
        if d is not None:
            plan.append((d.epoch, 1, i, d))
    plan.sort(key=lambda x: x[:3])
    return plan


@dataclass
class _Clock:
    """The replay's event loop (module docstring), in ms from when the first draft began: when
    each tree reaches the verifier (`arrive`, by round) and each verdict the edge (`verdict_at`),
    when the verifier and the drafting thread are next free, and the time spent stalling (the
    verifier waiting for a late hit's tree), drafting after misses, verifying and pre-speculating."""

    vs: Sequence[VerdictEvent]
    hit: Sequence[bool]
    costs: Costs
    nodes: Mapping[int, int]
    up: float  # a tree's way to the verifier
    down: float  # a verdict's way to the edge
    server_ms: float  # the server's per-round overhead between verifications back to back
    scale: Mapping[int, float] = field(default_factory=dict)  # logged verify ms x this, by round
    arrive: dict[int, float] = field(default_factory=dict)
    verdict_at: list[float] = field(default_factory=list)
    verify_end: float = 0.0
    thread_free: float = 0.0
    stall: float = 0.0
    miss_draft: float = 0.0
    busy: float = 0.0
    prespec: float = 0.0

    def settle_verdicts(self) -> None:
        """Verify the rounds in the logged order while their trees' arrival is known."""
        while len(self.verdict_at) < len(self.vs):
            j = len(self.verdict_at)
            a = self.arrive.get(self.vs[j].round)
            if a is None:
                return
            start = a
            if j and self.hit[j - 1]:  # verified after the previous one, if its tree is there in time
                free = self.verify_end + self.server_ms
                self.stall += max(0.0, a - free)
                start = max(a, free)
            start = max(start, self.verify_end)
            v = _verify_ms(self.costs, self.vs, self.nodes, j, self.scale)
            self.busy += v
            self.verify_end = start + v
            self.verdict_at.append(self.verify_end + self.down)

    def first_miss_from(self, epoch: int) -> float | None:
        """When the first miss at or after verdict `epoch` reaches the edge (None: not known yet)."""
        for j in range(epoch, len(self.verdict_at)):
            if not self.hit[j] and not self.vs[j].done:
                return self.verdict_at[j]
        return None

    def run(self, d: _Draft) -> None:
        """Run draft action `d` on the drafting thread once the verdict it follows has arrived
        (and its slack): skipped when a verdict ruled it out before it began, a conditional draft
        abandoned after the evaluation under way when a miss arrives; its trees leave when it ends."""
        self.settle_verdicts()
        if d.epoch > len(self.verdict_at):
            raise ValueError("trace inconsistent: a draft follows a verdict whose tree was never sent")
        opened = self.verdict_at[d.epoch - 1] if d.epoch else 0.0
        start = max(self.thread_free, opened) + d.slack_ms
        cut = self.first_miss_from(d.epoch) if d.kind in CUT_KINDS else None
        if cut is not None and cut <= start:
            return  # a verdict ruled it out before it began
        if d.kind == "leaves":
            cut = None  # evaluating leaves is not abandoned once begun
        t = start
        stopped = False
        if d.fixed_ms is not None:
            t += d.fixed_ms
        else:
            n_eval = max(1, len(d.evals))
            for rows, ms in d.evals:
                t += _eval_ms(self.costs, rows, ms) + d.other_ms / n_eval
                if cut is not None and t >= cut:
                    stopped = True  # abandoned after the evaluation under way
                    break
            if not d.evals:
                t += d.other_ms
        self.thread_free = t
        if d.kind == "plain" and d.epoch > 0:
            self.miss_draft += t - start
        elif d.kind in CUT_KINDS:
            self.prespec += t - start
        if not stopped:
            for s in d.sends:
                self.arrive[s.round] = t + d.send_gap_ms.get(s.round, 0.0) + self.up


def replay(
    gen: TracedGeneration, costs: Costs, policy: Policy = Policy(), over: Overheads = Overheads()
) -> Replay:
    """Replay one generation's rounds (module docstring) under `costs` and `policy`: the log's
    draft actions planned under the policy (_plan), then run in order on the replayed clock
    (_Clock), each verdict as soon as its tree's send time is known."""
    tr = gen.trace
    vs = tr.verdicts
    rtt = gen.rtt_ms if policy.rtt_ms is None else policy.rtt_ms
    up = down = (rtt + over.link) / 2
    drafts = _drafts(tr)
    nodes = {s.round: s.nodes for s in tr.sends}
    samples = [(r, ms) for d in drafts for r, ms in d.evals]
    own = Curve.fit(samples) if samples else Curve.flat(0.0)
    dropped = _dropped_rounds(tr.sends, policy.n)
    capped = _capped(tr.sends, vs, policy.depth, dropped, policy.depth_miss)
    dropped |= capped.dropped
    scale = _verify_scale(gen, capped.depth)
    nodes.update(capped.depth)
    miss = _miss_path(drafts, costs, policy.backup_ms)
    # the policy: the conditional trees it does not draft; a hit on one of them becomes a miss
    hit = [v.hit and not (v.next is not None and v.next in dropped) for v in vs]
    plan = _plan(vs, hit, drafts, dropped, nodes, own, miss, capped.depth)

    t_origin = min(e.t0 for e in tr.drafts) if tr.drafts else vs[0].t
    clock = _Clock(vs, hit, costs, nodes, up, down, over.server, scale)
    for _, _, _, d in plan:
        clock.run(d)
    clock.settle_verdicts()
    if len(clock.verdict_at) < len(vs):
        raise ValueError("trace inconsistent: a verified round's tree was never sent")

    outside = max(0.0, gen.wall_ms - (vs[-1].t - t_origin) * 1e3)
    span = clock.verdict_at[-1]
    lost = sum(capped.lost.values())
    return Replay(
        tokens=gen.tokens - lost,
        ms=span + outside,
        span_ms=span,
        outside_ms=outside,
        rounds=len(vs),
        decided=sum(1 for v in vs if not v.done),
        hits=sum(1 for j, v in enumerate(vs) if hit[j] and not v.done),
        stall_ms=clock.stall,
        miss_draft_ms=clock.miss_draft,
        verify_ms=clock.busy,
        prespec_ms=clock.prespec,
        tokens_lost=lost,
    )


def _verify_scale(gen: TracedGeneration, depth: Mapping[int, int]) -> dict[int, float]:
    """For the logged verify ms of chains a depth cap shortens (round -> D): the ratio of the
    generation's own verifier fit (fit_verifier) at D nodes to its logged nodes."""
    if not depth:
        return {}
    curve = fit_verifier([gen])
    nodes = {s.round: s.nodes for s in gen.trace.sends}
    return {r: curve(d) / max(curve(nodes[r]), 1e-9) for r, d in depth.items()}


# --------------------------------------------------------------------------- scenarios
def fit_drafter(gens: Sequence[TracedGeneration]) -> Curve:
    """The drafter's ms per evaluation of n rows, from the traces' own evaluations."""
    return Curve.fit((r, ms) for g in gens for d in g.trace.drafts for _, r, ms in d.evaluations)


def fit_verifier(gens: Sequence[TracedGeneration]) -> Curve:
    """The verifier's ms per forward of a tree of N nodes, from the traces' verdicts
    (round 0 left out: its time holds the prompt's prefill)."""
    samples: list[tuple[float, float]] = []
    for g in gens:
        nodes = {s.round: s.nodes for s in g.trace.sends}
        for v in g.trace.verdicts:
            if v.round != 0 and v.round in nodes:
                samples.append((nodes[v.round], v.verify_ms))
    return Curve.fit(samples)
