"""The estimates the speculation core sizes and gates its trees by, as explicit state, and the
budget of a dynamic tree they give.

`Learned` lives as long as the client (it carries over between generations): the acceptance
calibration, one outcome model per target temperature, the measured round trip and the last
tree sent (which sizes the next dynamic budget). `RoundEstimates` lives for one generation: the
running drafting, per-evaluation and verify times, and when the verdict in flight is due.

How many nodes a dynamic tree should have: the budget from the server's measured cost curve.
Model (docs/architecture.md §6). One round costs

    round_ms(N) = rtt_ms + draft_ms(N) + verify_ms(N),    draft_ms(N) = draft_fixed_ms + draft_ms_per_node * N

where verify_ms(N) is the forward cost the server advertises in `welcome.verify_cost_ms` ({N: ms},
measured at start-up), interpolated linearly between measured sizes. A round yields

    tokens(N) = 1 + sum of the N largest gains,

because the accepted nodes of a tree form one path, so the expected accepted length is the sum over
nodes of P(node accepted), and a best-first tree holds the nodes of highest P. A node's gain is
its draft path probability (DraftResult.gains()), scaled by a calibration factor that corrects the
draft's over- or under-confidence (`AcceptanceCalibration`), or a geometric prior before any
draft exists. The budget is the N that maximises tokens(N) / round_ms(N): more nodes while a node
costs little (a flat GPU curve), fewer where every node adds forward time (these CPUs).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from edge_client.drafters.base import DrafterStats
from edge_client.speculation.auto import Realized
from edge_client.trees import DraftResult
from edge_client.trees.sampling import Landing

# ---------------------------------------------------------------------------------------------------
# The budget of a dynamic tree


def verify_ms(cost: Mapping[int, float], n: np.ndarray) -> np.ndarray:
    """Forward ms for n nodes [k] from the advertised curve: linear between points, flat below the
    smallest measured size (a forward never gets cheaper than that). n beyond the largest is not
    extrapolated; callers cap n at the largest measured size."""
    if not cost:
        raise ValueError("verify_cost_ms is empty: the server measured no forward sizes")
    xs = np.asarray(sorted(cost), dtype=np.float64)
    ys = np.asarray([cost[int(x)] for x in xs], dtype=np.float64)
    return np.interp(np.asarray(n, dtype=np.float64), xs, ys)


def geometric_gains(alpha: float, n: int) -> np.ndarray:
    """[n] gains of a chain whose every token is accepted with probability alpha: alpha^d.
    A prior for the first round; any tree has at least these gains for its best path."""
    return alpha ** np.arange(1, n + 1, dtype=np.float64)


def expected_tokens(gains: Sequence[float] | np.ndarray, n: int) -> float:
    """1 + the sum of the n largest gains (the bonus token always comes)."""
    g = np.sort(np.asarray(gains, dtype=np.float64))[::-1]
    return 1.0 + float(g[:n].sum())


def choose_budget(
    verify_cost_ms: Mapping[int, float],
    gains: Sequence[float] | np.ndarray,
    *,
    rtt_ms: float = 0.0,
    draft_ms_per_node: float = 0.0,
    draft_fixed_ms: float = 0.0,
    max_nodes: int | None = None,
    calibration: float = 1.0,
) -> int:
    """The node budget N maximising expected tokens per ms of round time (see the module docstring).

    gains: per-node acceptance estimates (any order); N never exceeds len(gains), the largest
    measured size in verify_cost_ms, or max_nodes (the server's limit).
    """
    g = np.sort(np.clip(np.asarray(gains, dtype=np.float64) * calibration, 0.0, 1.0))[::-1]
    limit = min(len(g), max(verify_cost_ms) if verify_cost_ms else 0)
    if max_nodes is not None:
        limit = min(limit, max_nodes)
    if limit < 1:
        return 1
    n = np.arange(1, limit + 1)
    tokens = 1.0 + np.cumsum(g[:limit])
    round_ms = rtt_ms + draft_fixed_ms + draft_ms_per_node * n + verify_ms(verify_cost_ms, n)
    rate = tokens / np.maximum(round_ms, 1e-9)
    return int(n[int(np.argmax(rate))])


def next_gains(alpha: float, cap: int, last: tuple[np.ndarray, np.ndarray, int] | None = None) -> np.ndarray:
    """Gains to size the next dynamic tree by: a geometric prior before any tree, else the last
    tree's nodes as the target accepts them (`last[0]`, their reach), what its frontier left out
    (`last[1]`) and a deeper chain below its depth (`last[2]`), so that a budget may grow past the
    last tree."""
    if last is None:
        return geometric_gains(alpha, cap)
    reach, frontier, depth = last
    deeper = alpha ** np.arange(depth + 1, depth + 1 + cap)
    return np.concatenate([reach, frontier, deeper])


@dataclass
class AcceptanceCalibration:
    """Ratio of tree tokens the target accepted to the draft's own estimate (sum of path probs),
    as an exponential moving average over rounds. Multiply gains by `factor` before budgeting."""

    factor: float = 1.0
    decay: float = 0.8  # weight of the past; 0.8 follows a change of text within ~5 rounds

    def update(self, expected_accepted: float, accepted: int) -> float:
        """Record one round: the draft expected `expected_accepted` tree tokens, `accepted` came."""
        if expected_accepted > 1e-6:
            ratio = min(accepted / expected_accepted, 4.0)
            self.factor = self.decay * self.factor + (1.0 - self.decay) * ratio
        return self.factor


# ---------------------------------------------------------------------------------------------------
# What is learned across generations and within one


def ema(old: float | None, new: float) -> float:
    """Exponential average of the running estimates (the first sample starts it)."""
    return new if old is None else 0.7 * old + 0.3 * new


@dataclass
class ChoiceModel:
    """How the target's next token relates to the draft's, for predicting outcomes.

    temperature 0 (greedy verification): the target takes the draft's top token with probability
    `alpha`, measured online as the fraction of verified positions where the target's token was the
    draft's top token (a Beta(8, 2) prior, decaying so it follows the text), and otherwise a token in
    proportion to the draft's other probabilities, scaled by a learned calibration `beta`. The
    draft's own softmax says little here: a draft can be right 95% of the time with a top
    probability of 0.4, and a weak draft's runners-up can carry half its mass yet hold the target's
    token one time in ten. beta = (times the target's token was one of the recorded alternatives
    after a miss of the top token) / (the probability the proportional rule gave them), decayed
    like alpha from a prior of 1 (two pseudo-observations), so a draft whose runners-up are
    rarely right stops being trusted to predict bonus tokens (and the cost gate stops drafting
    for them).

    temperature T > 0 (the target samples): the draft's distribution at temperature T stands in
    for the target's (deterministic trees rank on the draft at temperature 1, so it is sharpened;
    stochastic trees already carry q at T).

    Coupled drafting (mode match at T > 0, trees.Coupling) is modelled like greedy, with
    temperature 0: the coupled token is the "top" one, taken with probability alpha, and the
    runners-up are the landing model's candidates (trees.sampling.Landing): their recorded
    probabilities are the draft's mass outside the coupled token spread by where the target's
    token lands in the CDF when it misses (Ranking.probs), so the proportional rule gives the
    landing model's P(x | miss), calibrated by beta as above. `landing` learns the landing
    model's scale from the verdicts' mismatches at coupled rows, and every tree observed hands
    its drafting side (DraftResult.landing, the Coupling's) the learned state, so the next trees
    are ranked with it.
    """

    temperature: float = 0.0
    agree: float = 8.0
    tested: float = 10.0
    decay: float = 0.98
    alt_hits: float = 2.0
    alt_predicted: float = 2.0
    landing: Landing = field(default_factory=Landing)

    @property
    def alpha(self) -> float:
        return self.agree / self.tested

    @property
    def beta(self) -> float:
        """Calibration of the runners-up: observed / predicted share of misses they explain."""
        return self.alt_hits / self.alt_predicted

    def choice(self, tokens: np.ndarray, probs: np.ndarray, at_temperature: bool) -> dict[int, float]:
        """P(target's next token = x) for the draft's alternatives x at one row (rank order)."""
        ok = tokens >= 0
        toks, q = tokens[ok], probs[ok].astype(np.float64)
        if toks.size == 0:
            return {}
        if self.temperature == 0:
            share = runner_up_share(q)
            share *= min(self.beta, 1.0 / max(float(share.sum()), 1e-12)) * (1.0 - self.alpha)
            return {
                int(toks[0]): self.alpha,
                **{int(t): float(p) for t, p in zip(toks[1:], share, strict=True)},
            }
        if not at_temperature:
            tail = max(1.0 - float(q.sum()), 0.0)
            w = np.power(np.maximum(q, 1e-30), 1.0 / self.temperature)
            z = float(w.sum()) + tail ** (1.0 / self.temperature)
            q = w / max(z, 1e-30)
        return {int(t): float(p) for t, p in zip(toks, q, strict=True)}

    def observe(self, dr: DraftResult, accepted_nodes: Sequence[int], tokens: Sequence[int]) -> None:
        """Learn alpha from a verdict: at each row of the walked path (row 0, then the accepted
        nodes), did the target's token (the next accepted node's, or the bonus) equal the draft's
        top token there? Where it did not at a coupled row, the landing model learns where it
        landed instead."""
        rows = [-1, *accepted_nodes]
        for i, r in enumerate(rows):
            if i >= len(tokens):
                break
            alts, q = dr.alt_tokens[r + 1], dr.alt_probs[r + 1]
            top, target = int(alts[0]), int(tokens[i])
            if top < 0:
                continue
            self.agree = self.decay * self.agree + float(target == top)
            self.tested = self.decay * self.tested + 1.0
            if target != top:
                landing_row = dr.landing_rows.get(r + 1)
                if landing_row is not None:
                    self.landing.observe(landing_row, target)
                ok = alts >= 0
                predicted = float(runner_up_share(q[ok].astype(np.float64)).sum())
                hit = float(bool((alts[ok][1:] == target).any()))
                self.alt_hits = self.decay * self.alt_hits + hit
                self.alt_predicted = self.decay * self.alt_predicted + predicted
        if dr.landing is not None and dr.landing is not self.landing:
            dr.landing.adopt(self.landing)


def runner_up_share(q: np.ndarray) -> np.ndarray:
    """P(target = alternative r | target != the top token) for r = 1.. by the proportional rule:
    the draft's probabilities of its runners-up over its mass outside the top token."""
    rest = q[1:]
    tail = max(1.0 - float(q.sum()), 0.0)  # the draft's mass outside the alternatives
    return rest / max(float(rest.sum()) + tail, 1e-12)


@dataclass
class Learned:
    """What the edge learns across generations (one per client).

    calibration: accepted tree tokens over the draft's own estimate (dynamic budgets)
    choice:      outcome models per (target temperature, coupled), speculation.estimates.ChoiceModel
    rtt_ms:      exponential average of the measured round trip (0: none measured yet)
    last_draft:  the last tree sent (its reach and frontier size the next dynamic budget)
    cache_overrun: how much longer the outcome cache's chains took to draft than their priced
                 time (>= 1, an exponential average): the cache divides its time by it
    costs:       what each drafter's evaluations cost while this client drafted (drafter_costs)
    realized:    mode auto's measured ms per token while streaming and while speculating
                 (speculation.auto.Realized)
    """

    calibration: AcceptanceCalibration = field(default_factory=AcceptanceCalibration)
    choice: dict[tuple[float, bool], ChoiceModel] = field(default_factory=dict)
    rtt_ms: float = 0.0
    last_draft: DraftResult | None = None
    cache_overrun: float = 1.0
    costs: list[DrafterStats] = field(default_factory=list)
    realized: Realized = field(default_factory=Realized)

    def drafter_costs(self, n: int) -> tuple[DrafterStats, ...]:
        """This client's measurements of its `n` drafters' evaluations (speculation.executor
        .DraftStep feeds and reads them): its plans are priced by what it measured, never by what
        another client of a shared drafter measured (in another mode, under another load)."""
        while len(self.costs) < n:
            self.costs.append(DrafterStats())
        return tuple(self.costs[:n])

    def choice_model(self, temperature: float, coupled: bool = False) -> ChoiceModel:
        """The outcome model for this temperature (its acceptance estimate carries over). Coupled
        drafting (trees.Coupling) is modelled like greedy: the target takes the draft's coupled
        token with a learned probability, else one by the landing model (where p's inverse CDF
        lands near the keyed uniform; its scale is learned here too and carries over)."""
        key = (round(float(temperature), 3), coupled)
        if key not in self.choice:
            self.choice[key] = ChoiceModel(temperature=0.0 if coupled else key[0])
        return self.choice[key]

    def observe_cache_plan(self, planned_ms: float, took_ms: float) -> None:
        """Chains priced at `planned_ms` took `took_ms`: move cache_overrun a quarter of the way
        to their ratio (clipped to 1..4; a plan priced at nothing teaches nothing)."""
        if planned_ms > 0:
            ratio = min(4.0, max(1.0, took_ms / planned_ms))
            self.cache_overrun += 0.25 * (ratio - self.cache_overrun)

    def observe_rtt(self, rtt_ms: float) -> None:
        a = self.rtt_ms
        self.rtt_ms = rtt_ms if a == 0 else 0.8 * a + 0.2 * rtt_ms


@dataclass
class RoundEstimates:
    """Running estimates of one generation, for the cost gate (PrespecConfig.gate).

    draft_ms:    one tree's drafting time (None: nothing drafted yet)
    step_ms:     one drafter evaluation (a conditional draft is abandoned between evaluations)
    verify_ms:   one verification at the server
    verdict_due: perf_counter time the verdict in flight is expected (None: not known)
    """

    draft_ms: float | None = None
    step_ms: float | None = None
    verify_ms: float = 0.0
    verdict_due: float | None = None

    def note_draft(self, dr: DraftResult) -> None:
        self.draft_ms = ema(self.draft_ms, dr.draft_ms)
        if dr.evaluations > 0:
            self.step_ms = ema(self.step_ms, dr.draft_ms / dr.evaluations)

    def note_verify(self, verify_ms: float) -> None:
        self.verify_ms = ema(self.verify_ms or None, verify_ms)
