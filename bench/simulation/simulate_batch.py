"""Many edge sessions against one batching verifier: what waiting to fill a batch does (the
batch wait of cloud_verifier/batch_wait.py against none, and against a fixed wait).

`python -m bench simulate TRACES --batch-wait off,rule,fixed:3 --clients 1,4,16` runs this
instead of the one-generation replay (bench/simulation/simulate.py's docstring has the trace format).

The model (a discrete-event run of C clients on one verifier, in ms):

- each client runs 4 traced generations one after another (`per_client`; client i starts at
  generation 4i, round robin over the trace's generations of a mode, temperature and RTT), its
  first prompt reaching the verifier at a random offset in [0, 500 ms) (`stagger_ms`, seeded):
  each verified round of the log in order, its tree of the logged nodes, its verdict giving the
  logged tokens;
- after a verdict the client's next round is at the verifier again: at once when the log's verdict
  was a hit (the next tree was there already), else the RTT (+ the link overhead measured in the
  traces) and the edge's logged time from taking the verdict up to sending its next tree (drafting
  after a miss) later (--regular-edges: also with every miss's edge time the generation's median,
  an edge whose arrivals are predictable); a generation's next one starts an RTT after its last
  verdict;
- the verifier runs one forward at a time of every round ready when it starts (the engine packs
  them all), costing the curve at the forward's rows (each round: row 0 + its nodes; the prompt's
  prefill is not modelled); before a forward it waits by the policy:
    off       never;
    rule      cloud_verifier.batch_wait.plan_wait as the engine calls it: the curve as the engine's
              {N nodes: ms}, each client's arrival predicted by an ArrivalPredictor from its own
              gaps, re-decided at every arrival, bounded by gather_ms (3, the EngineConfig default;
              `rule:MS` another bound) and half of the ready rows' forward;
    fixed:MS  the engine before the rule: while any client is between rounds (not a new
              generation), up to min(MS, the last forward / 4), going early when none is left;
- figures: verifier s/token (its forwards' time over the tokens: the cloud's cost; its waits
  apart, `wait s/token`), user ms/token (each generation's span from its prompt leaving the edge
  to its last verdict reaching it, over its tokens, token-weighted), sessions per forward and the
  forwards that waited.

What it leaves out: the verifier's own per-round work, the token budget (16 clients x 17 rows fit
the default 512), prefill cost, and any change of the edge's drafting with the verifier's timing
(a late verdict does not change how long the edge drafts after it).
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from bench.lib.runner import Result, UsageError
from bench.simulation.simulate_trace import Curve, Overheads, TracedGeneration
from cloud_verifier.batch_wait import MIN_WAIT_MS, ArrivalPredictor, plan_wait, wait_bound_ms

# this machine's CPU verifier (forward ms by rows), the figures of the batch-wait task
CPU_CURVE = Curve(((1.0, 69.0), (4.0, 84.0), (8.0, 132.0), (16.0, 252.0)))
DEFAULT_GATHER_MS = 3.0


@dataclass(frozen=True)
class Round:
    """A verified round of a traced generation: its nodes and tokens, and the ms from the previous
    verdict to it being at the verifier beyond the round trip (0: a hit, the tree was there)."""

    nodes: int
    tokens: int
    edge_ms: float
    hit_before: bool


def rounds_of(gen: TracedGeneration, regular: bool = False) -> list[Round]:
    """The verified rounds of a generation, in order (bench.simulation.simulate's trace); `regular`: every
    miss's edge time the generation's median (an edge as steady as a clock: its arrivals are
    predictable)."""
    tr = gen.trace
    sends = {s.round: s for s in tr.sends}
    vs = tr.verdicts
    out: list[Round] = []
    for j, v in enumerate(vs):
        s = sends.get(v.round)
        nodes = s.nodes if s is not None else 0
        if j == 0:
            out.append(Round(nodes, v.tokens, 0.0, False))
            continue
        prev = vs[j - 1]
        edge = max(0.0, (s.t - prev.t) * 1e3) if s is not None and not prev.hit else 0.0
        out.append(Round(nodes, v.tokens, edge, prev.hit))
    if regular:
        edges = [r.edge_ms for r in out[1:] if not r.hit_before]
        mid = statistics.median(edges) if edges else 0.0
        out = [r if i == 0 or r.hit_before else replace(r, edge_ms=mid) for i, r in enumerate(out)]
    return out


@dataclass(frozen=True)
class WaitPolicy:
    kind: str  # off, rule, fixed
    ms: float = DEFAULT_GATHER_MS

    @classmethod
    def parse(cls, text: str) -> WaitPolicy:
        kind, _, ms = text.partition(":")
        if kind not in ("off", "rule", "fixed") or (kind == "off" and ms):
            raise ValueError(f"--batch-wait: {text!r} is not off, rule, rule:MS or fixed:MS")
        if kind == "fixed" and not ms:
            raise ValueError("--batch-wait fixed takes its ms: fixed:MS")
        value = float(ms) if ms else DEFAULT_GATHER_MS
        if value < 0:
            raise ValueError("--batch-wait: ms of 0 or more")
        return cls(kind, value)

    def label(self) -> str:
        return "off" if self.kind == "off" else f"{self.kind}:{self.ms:g}"


@dataclass
class _Client:
    plan: list[list[Round]]  # its generations' rounds
    gen: int = 0
    j: int = 0  # the next round of the generation
    arrive: float = 0.0  # when that round is at the verifier
    between: bool = False  # between rounds of a generation (the engine's WAITING), not a new one
    gen_start: float = 0.0


def run_batch(
    gens: Sequence[TracedGeneration],
    curve: Curve,
    clients: int,
    policy: WaitPolicy,
    rtt_ms: float,
    link_ms: float = 0.0,
    per_client: int = 4,
    stagger_ms: float = 500.0,
    seed: int = 0,
    regular: bool = False,
) -> dict[str, Any]:
    """C clients on one verifier under a wait policy (module docstring): the figures."""
    rng = random.Random(seed)
    rounds = [rounds_of(g, regular) for g in gens]
    cs = [
        _Client([rounds[(i * per_client + k) % len(rounds)] for k in range(per_client)])
        for i in range(clients)
    ]
    for c in cs:
        c.arrive = c.gen_start = rng.uniform(0.0, stagger_ms)
    engine_curve = {int(x) - 1: ms for x, ms in curve.points}  # as the engine's {N nodes: ms}
    pred = ArrivalPredictor()
    seen: set[tuple[int, int, int]] = set()  # (client, generation, round) arrivals noted
    trip = rtt_ms + link_ms
    t = busy = waited_total = 0.0
    forwards = waited = sessions_total = tokens = 0
    last_fwd = 0.0
    gen_ms: list[tuple[float, int]] = []

    def active() -> list[int]:
        return [i for i, c in enumerate(cs) if c.gen < len(c.plan)]

    def note(now: float) -> list[int]:
        """The clients whose round is at the verifier by `now` (their arrival noted once)."""
        ready = []
        for i in active():
            c = cs[i]
            if c.arrive <= now + 1e-9:
                ready.append(i)
                if (key := (i, c.gen, c.j)) not in seen:
                    seen.add(key)
                    pred.submitted(i, c.arrive / 1e3)  # the predictor's clock: seconds
        return ready

    def rows_of(ids: Sequence[int]) -> int:
        return sum(1 + cs[i].plan[cs[i].gen][cs[i].j].nodes for i in ids)

    while act := active():
        t = max(t, min(cs[i].arrive for i in act))
        t0 = t
        if policy.kind != "off" and clients > 1:
            t = _wait(policy, t0, engine_curve, cs, note, rows_of, pred, last_fwd)
        ready = note(t)
        rows = rows_of(ready)
        dur = curve(rows)
        forwards += 1
        waited += t > t0 + 1e-9
        waited_total += t - t0
        sessions_total += len(ready)
        busy += dur
        last_fwd = dur
        t += dur
        tokens += _advance(cs, ready, t, trip, pred, gen_ms)
    user_tokens = sum(n for _, n in gen_ms)
    return {
        "clients": clients,
        "edges": "regular" if regular else "logged",
        "batch_wait": policy.label(),
        "forwards": forwards,
        "tokens": tokens,
        "verifier_s_per_token": round(busy / 1e3 / max(1, tokens), 5),
        "wait_s_per_token": round(waited_total / 1e3 / max(1, tokens), 5),
        "user_ms_per_token": round(sum(ms for ms, _ in gen_ms) / max(1, user_tokens), 2),
        "sessions_per_forward": round(sessions_total / max(1, forwards), 3),
        "waited_forwards": waited,
        "mean_wait_ms": round(waited_total / max(1, waited), 3),
        "span_s": round(t / 1e3, 3),
    }


def _advance(
    cs: Sequence[_Client],
    ready: Sequence[int],
    t: float,
    trip: float,
    pred: ArrivalPredictor,
    gen_ms: list[tuple[float, int]],
) -> int:
    """The `ready` clients' rounds were verified by `t`: move each to its next round (or its next
    generation, an RTT later), noting what the predictor learns; the tokens they got."""
    tokens = 0
    for i in ready:
        c = cs[i]
        gen = c.plan[c.gen]
        r = gen[c.j]
        tokens += r.tokens
        c.j += 1
        if c.j >= len(gen):  # the generation ended: the next one's prompt an RTT later
            gen_ms.append((t - c.gen_start + trip, sum(x.tokens for x in gen)))
            c.gen, c.j, c.between = c.gen + 1, 0, False
            c.arrive = c.gen_start = t + trip
            pred.idle(i)
            continue
        nxt = gen[c.j]
        c.between = not nxt.hit_before
        c.arrive = t if nxt.hit_before else t + trip + nxt.edge_ms
        if c.between:
            pred.verdict(i, t / 1e3, 1 + r.nodes)
    return tokens


def _wait(
    policy: WaitPolicy,
    t0: float,
    engine_curve: dict[int, float],
    cs: list[_Client],
    note: Any,
    rows_of: Any,
    pred: ArrivalPredictor,
    last_fwd: float,
) -> float:
    """When the forward starts, the verifier free and a round ready at t0 (the policy's wait)."""

    def next_arrival(after: float) -> float | None:
        times = [c.arrive for c in cs if c.gen < len(c.plan) and c.arrive > after + 1e-9]
        return min(times, default=None)

    if policy.kind == "fixed":
        deadline = t0 + min(policy.ms, last_fwd / 4)
        t = t0
        while t < deadline:
            if not any(c.between and c.gen < len(c.plan) and c.arrive > t + 1e-9 for c in cs):
                return t
            nxt = next_arrival(t)
            t = deadline if nxt is None else min(nxt, deadline)
        return t
    bound = wait_bound_ms(engine_curve, rows_of(note(t0)), policy.ms)
    t = t0
    while True:
        ready = note(t)
        arrivals = []
        for i, c in enumerate(cs):
            if c.gen < len(c.plan) and c.between and c.arrive > t + 1e-9:
                a = pred.expected(i, t / 1e3)
                if a is not None:
                    arrivals.append(a)
        w = plan_wait(engine_curve, rows_of(ready), len(ready), arrivals, bound - (t - t0))
        if w <= MIN_WAIT_MS:
            return t
        nxt = next_arrival(t)
        t = t + w if nxt is None else min(nxt, t + w)


def as_table(rows: Sequence[dict[str, Any]]) -> str:
    """A markdown table of run_batch rows (with their curve's name)."""
    head = (
        "| mode | T | edges | curve | clients | batch wait | verifier s/token | user ms/token | "
        "sessions/forward | forwards waited | mean wait ms |"
    )
    lines = [head, "|---|---:|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['temperature']:g} | {r['edges']} | {r['curve']} | {r['clients']} | "
            f"{r['batch_wait']} | "
            f"{r['verifier_s_per_token']:.4f} | {r['user_ms_per_token']:.1f} | "
            f"{r['sessions_per_forward']:.2f} | {r['waited_forwards']}/{r['forwards']} | "
            f"{r['mean_wait_ms']:.2f} |"
        )
    return "\n".join(lines)


def batch_result(a: argparse.Namespace, gens: Sequence[TracedGeneration]) -> Result:
    """bench.simulation.simulate --batch-wait: every curve (the CPU's, and the flat one when given) x
    --clients x --batch-wait: its rows, their table and the curves and groups (the JSON's `groups`)."""
    try:
        policies = [WaitPolicy.parse(x) for x in a.batch_wait.split(",") if x]
        counts = [int(x) for x in (a.clients or "1,4,16").split(",") if x]
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    curves: dict[str, Curve] = {}
    curves["cpu"] = Curve.load(a.verifier_curve) if a.verifier_curve else CPU_CURVE
    if a.flat_curve:
        curves["flat (gpu)"] = Curve.load(a.flat_curve)
    elif a.flat_verifier is not None:
        curves["flat"] = Curve.flat(a.flat_verifier)
    groups: dict[tuple[str, float, float], list[TracedGeneration]] = {}
    for g in gens:
        groups.setdefault((g.mode, g.temperature, g.rtt_ms), []).append(g)
    out: list[dict[str, Any]] = []
    meta: dict[str, Any] = {"curves": {name: c.as_dict() for name, c in curves.items()}}
    for (mode, temp, logged_rtt), gs in groups.items():
        over = Overheads.measure(gs)
        rtt = logged_rtt if not a.rtt_ms else float(a.rtt_ms.split(",")[0])
        meta[f"{mode} T={temp:g} rtt={rtt:g}"] = {"generations": len(gs), "link_ms": round(over.link, 3)}
        for regular in (False, True) if a.regular_edges else (False,):
            for name, curve in curves.items():
                for n in counts:
                    for pol in policies:
                        r = run_batch(gs, curve, n, pol, rtt, over.link, regular=regular)
                        out.append({"mode": mode, "temperature": temp, "curve": name, "rtt_ms": rtt, **r})
    return Result(out, as_table(out), extra={"groups": meta})
