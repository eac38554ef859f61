"""Replay logged rounds (bench.end_to_end.network --trace) under other costs and policies: ms/token
co-located (the validation: it must match the measured figure), for the edge and the verifier on
separate machines, for a verifier whose cost is flat in the tree's size (a GPU's shape), and for
policies (outcomes pre-speculated per round, the miss path's drafting cost, the round trip), in
seconds.

Input: the round traces `bench.end_to_end.network --trace PATH` writes (`{"config", "generations": [{"mode",
"rtt_ms", "temperature", "prompt_index", "trace", "stats"}]}`, `trace` an
`edge_client.stats.RoundTrace`: every send, verdict and draft action of a generation with the
drafter's evaluations, on the edge's clock).

The model, a discrete-event replay of one generation at a time, is described in
bench/simulation/simulate_replay.py's docstring, beside its code.

Scenarios: `colocated` (the trace's own timings: every evaluation's and verification's logged
ms; this must reproduce the measured ms/token, the validation column), `separate` (the drafter
and verifier cost curves: --drafter-curve / --verifier-curve, else fit from the traces' own
evaluations and verdicts, i.e. co-located costs smoothed), `flat` (the drafter curve, and a
verifier that costs --flat-verifier ms whatever the tree's size). "x ar" divides by mode ar's
ms/token in the same scenario: measured (ar generations in the trace files, the edge idle), else
the verifier's one-node forward.

What a replay can honestly change, and what not:

- RTT (--rtt-ms): any value; the rounds' outcomes stay as logged;
- N (--n): outcomes pre-speculated per tree, at most what the log drafted: the conditional trees
  of each tree beyond its N likeliest (by the outcome model's odds when sent) are not drafted (a
  lockstep draft of several trees evaluates proportionally fewer rows; a schedule of chains, the
  likeliest deepest, at most N rows an evaluation), and a hit on one of them becomes a miss with
  a synchronous draft. A replay cannot invent hits for outcomes never drafted: N at or beyond the
  log's is the log (rows say `n_as_logged`); for larger N the hit rate needs the prediction
  ceiling (bench.simulation.outcomes);
- the miss path's cost (--backup-ms): the synchronous draft after a miss takes this long; the
  tokens of the round it starts stay as logged (a cheaper backup tree also accepts fewer tokens,
  which the replay cannot know: pair it with bench.simulation.outcomes / bench.end_to_end.network's measured
  tau);
- the outcome cache's chain depth (--depth D): conditional chains deeper than D are drafted D deep
  (the evaluations past the deepest chain left are not run; a tree verified in their place is
  smaller: V(D), co-located its logged ms scaled along the generation's own verifier fit). A chain
  that accepted a <= D nodes gives the same round (the same outcome and bonus token); one that
  accepted more gives a - D tokens fewer and another outcome: all D accepted, and as the bonus the
  chain's own next node (the target had accepted it), the outcome the edge pre-speculates first.
  Each cap is replayed in two readings: the next round keeps its logged hit and timing, and
  "then a miss": the tree pre-speculated for the logged outcome is useless and a hit on it becomes
  a miss, whose tree and those after it (miss paths) keep their logged tokens uncapped. Neither
  bounds the other (the first caps more chains, so loses more tokens); read them together. Later
  rounds stay as logged and the lost tokens are not made up: ms/token is over the tokens left,
  rows say `tokens_lost`;
- not Saguaro's C (mss/rrs): scaling the draft's probabilities changes which trees are sampled
  and verified, hence the verdicts, which a replay keeps; measure it with bench.end_to_end.network
  --saguaro-c;
- timing-driven decisions of the core (the cost gate, the backup shape chosen, which drafts a
  verdict cut short) stay as logged, and so do the verdicts (hit or miss, tokens).

    python -m bench simulate bench/out/network_trace.json --rtt-ms 0,50,100 --n 1,2,4 \\
        --verifier-curve bench/out/verifier_curve.json --flat-verifier 30 --json bench/out/sim.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import add_common_args, table
from bench.lib import runner
from bench.lib.runner import Result, UsageError

# the replay model (bench.simulation.simulate_replay), re-exported here
from bench.simulation.simulate_replay import CUT_KINDS as CUT_KINDS
from bench.simulation.simulate_replay import SCENARIOS as SCENARIOS
from bench.simulation.simulate_replay import Capped as Capped
from bench.simulation.simulate_replay import Costs as Costs
from bench.simulation.simulate_replay import Policy as Policy
from bench.simulation.simulate_replay import Replay as Replay
from bench.simulation.simulate_replay import fit_drafter as fit_drafter
from bench.simulation.simulate_replay import fit_verifier as fit_verifier
from bench.simulation.simulate_replay import logged_outcomes as logged_outcomes
from bench.simulation.simulate_replay import replay as replay

# the cost curves, traced generations and overheads (bench.simulation.simulate_trace), re-exported here
from bench.simulation.simulate_trace import Curve as Curve
from bench.simulation.simulate_trace import Overheads as Overheads
from bench.simulation.simulate_trace import TracedGeneration as TracedGeneration
from bench.simulation.simulate_trace import load_generations as load_generations
from bench.simulation.simulate_trace import trace_from_dict as trace_from_dict


@dataclass(frozen=True)
class Row:
    """One scenario x policy over every generation."""

    scenario: str
    policy: Policy
    replays: tuple[Replay, ...]
    measured_ms_per_token: float | None  # co-located, logged policy only
    ar_ms_per_token: float | None
    logged_outcomes: int = 0  # the most conditional trees the log drafted for one tree's outcomes

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.replays)

    @property
    def ms_per_token(self) -> float:
        return sum(r.ms for r in self.replays) / max(1, self.tokens)

    def as_dict(self) -> dict[str, Any]:
        rs = self.replays
        rounds = max(1, sum(r.rounds for r in rs))
        decided = sum(r.decided for r in rs)
        misses = max(1, decided - sum(r.hits for r in rs))
        err = (
            None
            if self.measured_ms_per_token is None
            else round(100 * (self.ms_per_token / self.measured_ms_per_token - 1), 2)
        )
        return {
            "scenario": self.scenario,
            "policy": self.policy.label(),
            # N at or beyond what the log drafted replays the log: a replay cannot invent hits
            "n_as_logged": self.policy.n is not None and self.policy.n >= self.logged_outcomes,
            "logged_outcomes_per_tree": self.logged_outcomes,
            "rtt_ms": self.policy.rtt_ms,
            "n": self.policy.n,
            "backup_ms": self.policy.backup_ms,
            "depth": self.policy.depth,
            "depth_then_miss": self.policy.depth_miss,
            "tokens_lost": sum(r.tokens_lost for r in rs),
            "ms_per_token": round(self.ms_per_token, 3),
            "measured_ms_per_token": None
            if self.measured_ms_per_token is None
            else round(self.measured_ms_per_token, 3),
            "error_pct": err,
            "x_ar": None if not self.ar_ms_per_token else round(self.ms_per_token / self.ar_ms_per_token, 3),
            "tau": round(self.tokens / rounds, 3),
            "hit_rate": round(sum(r.hits for r in rs) / decided, 4) if decided else None,
            "verify_ms_per_round": round(sum(r.verify_ms for r in rs) / rounds, 2),
            "stall_ms_per_round": round(sum(r.stall_ms for r in rs) / rounds, 2),
            "miss_draft_ms_per_miss": round(sum(r.miss_draft_ms for r in rs) / misses, 2),
            "prespec_ms_per_round": round(sum(r.prespec_ms for r in rs) / rounds, 2),
            "verifier_ms_per_token": round(sum(r.verify_ms for r in rs) / max(1, self.tokens), 3),
            "per_generation_ms_per_token": [round(r.ms_per_token, 3) for r in rs],
        }


def simulate(
    gens: Sequence[TracedGeneration],
    scenarios: dict[str, Costs],
    policies: Sequence[Policy],
    ar_ms_per_token: Mapping[str, float | None] | None = None,
    progress: bool = False,
) -> tuple[list[Row], Overheads]:
    """Every scenario x policy over `gens` (one mode, temperature and logged RTT); the overheads
    measured in them. `ar_ms_per_token`: mode ar's ms/token in each scenario, for the "x ar"
    column (a scenario not named: its verifier's one-row forward + the server's overhead; none
    with the logged costs)."""
    over = Overheads.measure(gens)
    measured = sum(g.wall_ms for g in gens) / max(1, sum(g.tokens for g in gens))
    most = max((logged_outcomes(g.trace) for g in gens), default=0)
    bar = None
    if progress:
        from tqdm import tqdm

        total = len(scenarios) * len(policies) * len(gens)
        bar = tqdm(total=total, desc="replay", file=sys.stderr, delay=2.0)
    rows: list[Row] = []
    for name, costs in scenarios.items():
        # mode ar streams a token per one-row forward: its cost per token in this scenario
        if ar_ms_per_token is not None and name in ar_ms_per_token:
            ar_ms = ar_ms_per_token[name]
        else:
            ar_ms = None if costs.verifier is None else costs.verifier(1) + over.server
        for pol in policies:
            reps = []
            for g in gens:
                reps.append(replay(g, costs, pol, over))
                if bar is not None:
                    bar.update()
            logged = pol == Policy()
            shown = measured if name == "colocated" and logged else None
            rows.append(Row(name, pol, tuple(reps), shown, ar_ms, most))
    if bar is not None:
        bar.close()
    return rows, over


def _floats(flag: str, text: str | None) -> list[float]:
    if not text:
        return []
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} takes comma-separated numbers, got {text!r}") from None


def policies_of(
    rtts: Sequence[float], ns: Sequence[int], backups: Sequence[float], depths: Sequence[int] = ()
) -> list[Policy]:
    """The logged policy first, then every combination of the values given (a knob not given
    stays as logged)."""
    out = [Policy()]
    for rtt in [None, *rtts]:
        for n in [None, *ns]:
            for b in [None, *backups]:
                for depth in [None, *depths]:
                    # a depth cap: the next hit kept, then the "then a miss" reading (_capped)
                    for p in [Policy(rtt, n, b, depth)] + ([Policy(rtt, n, b, depth, True)] if depth else []):
                        if p not in out:
                            out.append(p)
    return out


EPILOG = """\
what a replay can change: the RTT (any value), N (at most the outcomes the log drafted per tree:
the others' conditional trees are not drafted and a hit on one becomes a miss; N at or beyond
the log's replays the log, rows say n_as_logged; larger N needs the prediction ceiling of
bench.simulation.outcomes), the miss path's drafting time (the round's tokens stay as logged), the depth of
the outcome cache's chains (a chain that accepted more than the cap loses those tokens; the next
round keeps its hit, or, the other reading, "then a miss"), and the costs (scenarios).
What it cannot: the verdicts (hit or miss, tokens), the core's timing-driven choices (cost gate,
backup shape, which drafts a verdict cut short): they stay as logged; nor Saguaro's C, which
changes the draft's distribution, hence the verdicts (measure it with bench.end_to_end.network --saguaro-c).
columns: ms/tok (replayed), measured (co-located, logged policy), err % (the validation),
x ar (against mode ar in the same scenario), tau, hit (hit rate), V/round (verification),
stall/round (the verifier waiting for a late hit's tree), T_b/miss (synchronous drafting after
a miss), verifier ms/tok (the verifier's busy time per token: the cloud's cost)."""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The epilog's lines as written, each flag's default after its help."""


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.epilog = EPILOG
    ap.formatter_class = _HelpFormatter
    ap.add_argument(
        "traces", nargs="+", type=Path, help="trace files written by bench.end_to_end.network --trace PATH"
    )
    ap.add_argument(
        "--modes",
        default=None,
        help="comma-separated bench modes to replay (default: every traced mode but ar)",
    )
    ap.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help="colocated: the trace's own timings (validation); separate: the cost curves; flat: the drafter "
        "curve and a verifier flat in N (default: all three)",
    )
    ap.add_argument(
        "--drafter-curve",
        type=Path,
        default=None,
        metavar="PATH",
        help="the drafter's ms per evaluation of n rows measured in isolation: CSV `rows,ms` or JSON "
        '({"rows": [...], "ms": [...]}, [[rows, ms], ...] or {"rows": ms}); default: fit (median per row '
        "count) from the traces' own evaluations, i.e. co-located",
    )
    ap.add_argument(
        "--verifier-curve",
        type=Path,
        default=None,
        metavar="PATH",
        help="the verifier's ms per forward of a tree of N nodes measured in isolation, same formats, or "
        "the verifier's own start-up measurement ({\"verify_cost_ms\": {N: ms}}, the cost cache's file, "
        "as welcome advertises it); default: fit from the traces' verdicts (verify_ms against tree "
        "size), i.e. co-located",
    )
    ap.add_argument(
        "--flat-verifier",
        type=float,
        default=None,
        metavar="MS",
        help="the flat scenario's verifier: MS per forward whatever N (a GPU's shape; also the prompt's "
        "round); default: mode ar's measured ms/token in the trace files (a one-row step, the edge idle), "
        "else the verifier curve's cheapest point",
    )
    ap.add_argument(
        "--flat-curve",
        type=Path,
        default=None,
        metavar="PATH",
        help="the flat scenario's verifier as a measured curve instead of one number (any --verifier-curve "
        "format, or a GPU check's forward file, `bench.gpu_forward --json`: the target's forward ms at "
        "1..64 rows on the GPU, nearly flat); overrides --flat-verifier",
    )
    _policy_args(ap)


def _policy_args(ap: argparse.ArgumentParser) -> None:
    """The policies replayed (each knob's values besides the logged one) and the batch-wait mode."""
    ap.add_argument(
        "--rtt-ms", default=None, help="comma-separated round-trip times to replay besides the logged one"
    )
    ap.add_argument(
        "--n",
        default=None,
        help="comma-separated outcomes pre-speculated per round to replay: each tree's conditional trees "
        "beyond the N likeliest are not drafted (a hit on one becomes a miss); at most what the log drafted",
    )
    ap.add_argument(
        "--backup-ms",
        default=None,
        help="comma-separated drafting times (ms) of the miss path's synchronous tree to replay instead "
        "of the logged ones (the round's tokens stay as logged)",
    )
    ap.add_argument(
        "--depth",
        default=None,
        help="comma-separated depth caps of the outcome cache's conditional chains to replay: a chain "
        "deeper than D is drafted D deep (fewer evaluations, a smaller tree to verify); when it had "
        "accepted more than D nodes the round loses those tokens; each cap is replayed with the next round's "
        "hit kept, and turned into a miss ('then a miss')",
    )
    ap.add_argument(
        "--batch-wait",
        default=None,
        metavar="POLICIES",
        help="instead of the replay: many clients on one batching verifier (bench.simulate_batch), "
        "comma-separated waits before a forward: off, rule (cloud_verifier.batch_wait, bound 3 ms; rule:MS "
        "another), fixed:MS (the wait before the rule); costs: --verifier-curve (default: this CPU's), "
        "and --flat-curve / --flat-verifier when given",
    )
    ap.add_argument(
        "--clients", default=None, help="with --batch-wait: comma-separated client counts (default 1,4,16)"
    )
    ap.add_argument(
        "--regular-edges",
        action="store_true",
        help="with --batch-wait: also run each edge with every miss's drafting at its median (predictable)",
    )
    add_common_args(ap, json=True, json_help="groups: each group's curves and overheads", no_progress=True)


def parse_knobs(a: argparse.Namespace) -> tuple[list[str], list[Policy]]:
    """The scenarios to run and the policies to replay (policies_of the --rtt-ms, --n and
    --backup-ms values), each checked (else a usage error)."""
    scen_names = [x for x in a.scenarios.split(",") if x]
    bad = [x for x in scen_names if x not in SCENARIOS]
    if bad or not scen_names:
        raise UsageError(f"--scenarios: unknown {bad or 'none given'}; choose from {','.join(SCENARIOS)}")
    rtts = _floats("--rtt-ms", a.rtt_ms)
    ns = [int(x) for x in _floats("--n", a.n)]
    if any(n < 1 for n in ns):
        raise UsageError("--n takes counts of 1 or more")
    backups = _floats("--backup-ms", a.backup_ms)
    if any(x < 0 for x in (*rtts, *backups)):
        raise UsageError("--rtt-ms and --backup-ms take values of 0 or more")
    depths = [int(x) for x in _floats("--depth", a.depth)]
    if any(d < 1 for d in depths):
        raise UsageError("--depth takes depths of 1 or more")
    return scen_names, policies_of(rtts, ns, backups, depths)


def load_inputs(
    a: argparse.Namespace,
) -> tuple[list[TracedGeneration], list[TracedGeneration], Curve | None, Curve | None]:
    """The traced speculative generations (of --modes, when given) and the ar ones, and the
    drafter and verifier curves given (None: fit from the traces); a usage error when there is
    no speculative generation or a file cannot be read."""
    try:
        gens, ar = load_generations(a.traces)
        drafter = Curve.load(a.drafter_curve) if a.drafter_curve else None
        verifier = Curve.load(a.verifier_curve) if a.verifier_curve else None
    except (OSError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    if a.modes:
        keep = {m for m in a.modes.split(",") if m}
        gens = [g for g in gens if g.mode in keep]
    if not gens:
        raise UsageError(
            "no traced speculative generation in the trace files (run bench.network with --trace PATH)"
        )
    return gens, ar, drafter, verifier


@dataclass(frozen=True)
class GroupCosts:
    """One group's (mode, temperature, logged RTT) curves, every scenario of SCENARIOS and mode
    ar's ms/token in each (simulate's `ar_ms_per_token`)."""

    drafter: Curve
    verifier: Curve
    flat: Curve
    scenarios: dict[str, Costs]
    ar_ms_per_token: dict[str, float | None]


def group_costs(
    gs: Sequence[TracedGeneration],
    temp: float,
    rtt: float,
    ar: Sequence[TracedGeneration],
    drafter: Curve | None,
    verifier: Curve | None,
    flat_verifier: float | Curve | None,
) -> GroupCosts:
    """The costs of a group of generations at temperature `temp` and logged RTT `rtt`: the
    drafter and verifier curves given, else fit from the group's traces; the flat scenario's
    verifier: `flat_verifier` (ms per forward, or a measured curve such as a GPU check's), else
    mode ar's measured ms/token at the same temperature and RTT less the server's overhead, else
    the verifier curve's cheapest point."""
    d_curve = drafter or fit_drafter(gs)
    v_curve = verifier or fit_verifier(gs)
    ar_same = [g for g in ar if g.temperature == temp and g.rtt_ms == rtt]
    ar_ms = sum(g.wall_ms for g in ar_same) / max(1, sum(g.tokens for g in ar_same)) if ar_same else None
    over = Overheads.measure(gs)
    one_row = min(ms for _, ms in v_curve.points)  # the fit's cheapest forward (few rows)
    if isinstance(flat_verifier, Curve):
        flat_ms = flat_verifier(1)  # ar's one-row step on that verifier
    elif flat_verifier is not None:
        flat_ms = flat_verifier
    elif ar_ms is not None:
        flat_ms = max(0.0, ar_ms - over.server)  # ar's one-row step, the edge idle
    else:
        flat_ms = one_row
    flat = flat_verifier if isinstance(flat_verifier, Curve) else Curve.flat(flat_ms)
    ar_by = {
        "colocated": ar_ms,
        # ar runs with the edge idle: its measured step is already the verifier's own
        "separate": verifier(1) + over.server if verifier else (ar_ms or one_row + over.server),
        "flat": flat_ms + over.server,
    }
    all_scen = {
        "colocated": Costs("colocated"),
        "separate": Costs("separate", d_curve, v_curve),
        "flat": Costs("flat", d_curve, flat, prefill="curve"),
    }
    return GroupCosts(d_curve, v_curve, flat, all_scen, ar_by)


def run(a: argparse.Namespace) -> Result:
    scen_names, policies = parse_knobs(a)
    gens, ar, drafter, verifier = load_inputs(a)
    if a.batch_wait:
        from bench.simulation.simulate_batch import batch_result

        return batch_result(a, gens)
    try:
        flat_curve = Curve.load(a.flat_curve) if a.flat_curve else None
    except (OSError, ValueError) as exc:
        raise UsageError(f"--flat-curve: {exc}") from None
    flat_source = "--flat-verifier" if a.flat_verifier is not None else "ar's step"
    flat_source = str(a.flat_curve) if flat_curve else flat_source
    groups: dict[tuple[str, float, float], list[TracedGeneration]] = {}
    for g in gens:
        groups.setdefault((g.mode, g.temperature, g.rtt_ms), []).append(g)
    out_rows: list[dict[str, Any]] = []
    curves: dict[str, Any] = {}
    for (mode, temp, rtt), gs in groups.items():
        gc = group_costs(gs, temp, rtt, ar, drafter, verifier, flat_curve or a.flat_verifier)
        scen = {k: gc.scenarios[k] for k in scen_names}
        rows, over = simulate(gs, scen, policies, gc.ar_ms_per_token, progress=not a.no_progress)
        key = f"{mode} T={temp:g} rtt={rtt:g}"
        curves[key] = {
            "drafter": gc.drafter.as_dict(),
            "drafter_source": str(a.drafter_curve or "fit from the traces"),
            "verifier": gc.verifier.as_dict(),
            "verifier_source": str(a.verifier_curve or "fit from the traces"),
            "flat_verifier_ms": gc.flat(1),
            "flat_verifier": gc.flat.as_dict(),
            "flat_source": flat_source,
            "overheads_ms": {"link": round(over.link, 3), "server": round(over.server, 3)},
            "generations": len(gs),
        }
        for r in rows:
            out_rows.append({"mode": mode, "temperature": temp, "logged_rtt_ms": rtt, **r.as_dict()})
    return Result(out_rows, _report(out_rows, curves), extra={"groups": curves})


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


def _policy_cell(r: dict[str, Any]) -> str:
    if r["policy"] == "logged":
        return f"logged (rtt {r['logged_rtt_ms']:g})"
    if r["n_as_logged"]:
        return f"{r['policy']} (N: as logged, {r['logged_outcomes_per_tree']})"
    if r.get("tokens_lost"):
        return f"{r['policy']} ({r['tokens_lost']} tokens lost)"
    return str(r["policy"])


def _report(rows: Sequence[dict[str, Any]], groups: dict[str, Any]) -> str:
    def f(x: object, fmt: str = "{:.1f}") -> str:
        return "-" if x is None else fmt.format(x)

    lines: list[str] = []
    for key, g in groups.items():
        o = g["overheads_ms"]
        lines.append(
            f"{key}: {g['generations']} generations; drafter curve {g['drafter_source']}, verifier curve "
            f"{g['verifier_source']}, flat verifier {g['flat_verifier_ms']:.1f} ms at 1 row "
            f"({g['flat_source']}); measured overheads: "
            f"link {o['link']:.1f} ms a round trip, server {o['server']:.1f} ms a round"
        )
    header = [
        "mode", "T", "scenario", "policy", "ms/tok", "measured", "err %", "x ar", "tau", "hit",
        "V/round", "stall/round", "T_b/miss", "verifier ms/tok",
    ]  # fmt: skip
    body = [
        [
            r["mode"],
            f"{r['temperature']:g}",
            r["scenario"],
            _policy_cell(r),
            f(r["ms_per_token"]),
            f(r["measured_ms_per_token"]),
            f(r["error_pct"], "{:+.1f}"),
            f(r["x_ar"], "{:.2f}"),
            f(r["tau"], "{:.2f}"),
            f(r["hit_rate"], "{:.2f}"),
            f(r["verify_ms_per_round"]),
            f(r["stall_ms_per_round"]),
            f(r["miss_draft_ms_per_miss"]),
            f(r["verifier_ms_per_token"]),
        ]
        for r in rows
    ]
    lines.append(table(body, header))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
