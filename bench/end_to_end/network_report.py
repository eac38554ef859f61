"""bench.end_to_end.network's results: the modes and row keys, where a mode's time goes (`decomposition`), the
merge of runs made in pieces (`--merge`), the tables, the JSON and trace files, the goals and the
plot."""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from typing import Any

from bench.harness import read_runs, save_figure, table, write_json
from bench.lib.runner import Result
from bench.lib.stats import median
from edge_client.stats import GenerationStats

MODES = ("ar", "sequence", "tree", "tree_prespec")
OPTIONAL = (
    "auto",
    "auto_cost",
    "tree_prespec_ungated",
    "tree_prespec_frugal",
    "tree_prespec_single",
    "tree_prespec_cache",
    "tree_prespec_fulltree",
    "tree_prespec_chain",
    "tree_prespec_top",
    "tree_prespec_uniform",
    "sequence_prespec",
    "sequence_prespec_single",
    "budget",
    "budget_prespec",
    "budget_prespec_single",
    "budget_prespec_cache",
    "tree_mss",
    "tree_prespec_mss",
    "tree_rrs",
    "tree_prespec_rrs",
    "tree_prespec_rrs_single",
)
# run settings that must agree for rows of several files to form one table (--merge)
SAME_RUN = (
    "draft",
    "model",
    "humaneval",
    "prompts",
    "tokens",
    "tree",
    "proxy",
    "jitter_ms",
    "bandwidth_mbps",
    "no_couple",
)
ROW_KEYS = (
    *("rtt_ms", "mode", "temperature", "ms_per_token", "tau", "hit_rate", "target_forwards_per_token"),
    *("bytes_up_per_token", "bytes_down_per_token", "draft_ms_per_round", "verify_ms_per_round"),
    "rtt_ms_per_round",
)
# where the time goes (decomposition), in rows of this release; rows of older files lack them
TIME_KEYS = (
    *("V_ms", "V_idle_ms", "V_idle_replay_ms", "T_b_ms", "p", "stall_ms_per_round"),
    *("prefill_share_ms_per_token", "decode_ms_per_token", "ttft_ms", "gap_ms"),
)


# the goals at RTT 50, co-located: a pre-speculating mode's ms/token against ar's, by temperature
GOAL_X_AR = {0.0: 0.35, 0.7: 0.45}


def decomposition(gens: Sequence[GenerationStats]) -> dict[str, float | None]:
    """Where one mode's time went over its generations, the terms of

        ms/token x tau ~= V + (1 - p) (RTT + T_b) + stall + prefill share

    V_ms: the median over rounds of the verify ms the verdicts report (every verdict but each
    generation's first, whose verify holds the prompt's prefill).
    V_idle_ms: the median over the same rounds of the verifier's time for the same trees with the
    edge idle: its advertised forward ms at each verified tree's nodes (welcome.verify_cost_ms,
    measured at its start-up with nothing drafting beside it; GenerationStats.idle_verify_ms). V_ms
    over V_idle_ms is what co-location (the edge drafting on the next core) costs the verifier.
    None for mode ar (it drafts nothing: its V_ms is the edge-idle figure).
    T_b_ms: the median over rounds of the synchronous drafting after a miss (each generation's
    critical-path drafts but the first, drafted before the prompt); None when no round missed.
    stall_ms_per_round: from the round traces (GenerationStats.trace). After a hit (the next tree
    was already at the server, or on its way, when a verdict arrived) the next verdict should follow
    one verify later; the stall of that round is the time between the two verdicts' arrivals minus
    the later verdict's verify_ms (the tree still travelling, the verifier's queue). A miss's wait
    is RTT + T_b, not stall. Summed over the hit rounds and divided by every round after each
    generation's first verdict (hits and misses); None without traces.
    prefill_share_ms_per_token: the median over generations of the prompt's round-0 time (from
    sending the prompt to its verdict; in mode ar, which drafts nothing, the time to the first
    verdict) over the generation's tokens.
    ttft_ms: the median over generations of the time to the first token.
    gap_ms: the median over rounds of the verifier's wait for the edge (verdict.gap_ms: from its
    previous verdict to this round's tree reaching its engine); None when the verifier did not send
    it.
    p, the hit rate, is the row's hit_rate.
    """
    verify = [ms for st in gens for ms in st.verify_ms[1:]]
    idle = [ms for st in gens for ms in st.idle_verify_ms[1:]]
    drafts = [ms for st in gens for ms in st.draft_ms[1:]]
    gaps = [ms for st in gens for ms in st.gap_ms]
    stall, rounds, traced = 0.0, 0, False
    prefill: list[float] = []
    for st in gens:
        tr = st.trace
        round0_ms: float | None = None
        if tr is not None:
            traced = True
            vs = tr.verdicts
            rounds += max(len(vs) - 1, 0)
            for prev, cur in itertools.pairwise(vs):
                if prev.hit:
                    stall += (cur.t - prev.t) * 1e3 - cur.verify_ms
            sent0 = next((e.t for e in tr.sends if e.round == 0), None)
            if vs and sent0 is not None:
                round0_ms = (vs[0].t - sent0) * 1e3
        if round0_ms is None and st.first_token_s:
            first_draft = st.draft_ms[0] if st.draft_ms else 0.0
            round0_ms = st.first_token_s * 1e3 - first_draft
        if round0_ms is not None and st.tokens:
            prefill.append(round0_ms / st.tokens)
    return {
        "V_ms": median(verify, 4),
        "V_idle_ms": median(idle, 4),
        "T_b_ms": median(drafts, 4),
        "stall_ms_per_round": round(stall / rounds, 4) if traced and rounds else None,
        "prefill_share_ms_per_token": median(prefill, 4),
        "gap_ms": median(gaps, 4),
        "ttft_ms": median([st.first_token_s * 1e3 for st in gens if st.first_token_s], 4),
    }


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4.2), squeeze=False)
    for ax, t in zip(axes[0], temps, strict=True):
        for mode in dict.fromkeys(r["mode"] for r in rows):
            pts = sorted(
                (r["rtt_ms"], r["ms_per_token"]) for r in rows if r["temperature"] == t and r["mode"] == mode
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
        ax.set_title(f"{'greedy' if t == 0 else f'match, T={t}'}")
        ax.set_xlabel("round-trip time (ms)")
        ax.set_ylabel("ms per token (median)")
        ax.grid(alpha=0.3)
        ax.legend()
    save_figure(fig, path, dpi=120)


def merge(paths: Sequence[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows of several `--json` files of one setup (the last file wins for a repeated (RTT, mode,
    T)), and the first file's config with `merged_from` added."""
    docs, first = read_runs(
        paths,
        "bench.end_to_end.network",
        "rows",
        list,
        "no 'rows' list; is it a bench.end_to_end.network --json file?",
        SAME_RUN,
    )
    merged: dict[tuple[float, str, float], dict[str, Any]] = {}
    for path, doc in docs:
        for i, r in enumerate(doc["rows"]):
            if not isinstance(r, dict) or any(k not in r for k in ROW_KEYS):
                raise ValueError(f"{path}: row {i} lacks one of {', '.join(ROW_KEYS)}")
            merged[(float(r["rtt_ms"]), str(r["mode"]), float(r["temperature"]))] = r
    order = {m: i for i, m in enumerate(MODES + OPTIONAL)}
    rows = sorted(merged.values(), key=lambda r: (r["rtt_ms"], r["temperature"], order.get(r["mode"], 99)))
    config = {
        **first,
        "rtt_ms": ",".join(f"{x:g}" for x in sorted({r["rtt_ms"] for r in rows})),
        "temperatures": ",".join(f"{x:g}" for x in sorted({r["temperature"] for r in rows})),
        "modes": ",".join(dict.fromkeys(r["mode"] for r in rows)),
        "merged_from": list(paths),
        "json": None,
        "plot": None,
        "merge": None,
    }
    return rows, config


def report(rows: list[dict[str, Any]], config: dict[str, Any]) -> Result:
    """The runner's Result: the rows (complete, with `config`), the printed text (the table, where
    the time goes, the goals, the identity line) and the plot."""
    c = config
    merged = f", merged from {len(c['merged_from'])} files" if c.get("merged_from") else ""
    n_he, n_sb = c.get("humaneval", 0), c.get("prompts")
    size = f"{n_he} HumanEval + {n_sb} Spec-Bench prompts x {c.get('tokens')} tokens"
    lines = [
        f"\n{c.get('model')} verifier, draft {c.get('draft')}, {size}{merged} (medians)",
        render_table(rows),
    ]
    lines += where_time_goes(rows) + goals(rows)
    line = _identity_line(rows)
    if line:
        lines.append(line)
    return Result(rows, "\n".join(lines), config=config, plot=lambda path: plot(rows, str(path)))


def render_table(rows: Sequence[dict[str, Any]]) -> str:
    """The main table: a row per RTT, temperature and mode."""
    return table(
        [
            [
                r["rtt_ms"],
                r["temperature"],
                r["mode"],
                r["ms_per_token"],
                r["tau"],
                "-" if r["hit_rate"] is None else r["hit_rate"],
                r["target_forwards_per_token"],
                r["bytes_up_per_token"],
                r["bytes_down_per_token"],
                r["draft_ms_per_round"],
                r["verify_ms_per_round"],
                r["rtt_ms_per_round"],
            ]
            for r in rows
        ],
        [
            "rtt",
            "T",
            "mode",
            "ms/token",
            "tau",
            "hit",
            "fwd/token",
            "B up/tok",
            "B down/tok",
            "draft ms/rnd",
            "verify ms/rnd",
            "net ms/rnd",
        ],
    )


def where_time_goes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The decomposition's table (TIME_KEYS) for the rows that have any of it (its lines)."""
    timed = [r for r in rows if any(r.get(k) is not None for k in TIME_KEYS)]
    if not timed:
        return []
    head = ["rtt", "T", "mode", "ms/token", "tau", "V ms", "V idle ms", "V idle replay", "T_b ms", "p"]
    head += ["stall ms/rnd", "prefill ms/tok", "decode ms/tok", "TTFT ms", "gap ms"]
    cells = [
        [r["rtt_ms"], r["temperature"], r["mode"], r["ms_per_token"], r["tau"]]
        + ["-" if r.get(k) is None else r[k] for k in TIME_KEYS]
        for r in timed
    ]
    return [
        "\nwhere the time goes (ms/token x tau ~= V + (1 - p)(RTT + T_b) + stall + prefill share)",
        table(cells, head),
    ]


def write_trace(path: str | None, config: dict[str, Any], generations: list[dict[str, Any]]) -> None:
    """The --trace file: {"config", "generations": [{mode, rtt_ms, temperature, prompt_index, trace,
    stats}]} (bench.simulation.simulate reads it), rewritten after every RTT x temperature block."""
    if path:  # bench.simulation.simulate's input, not a result: its own format
        write_json(path, {"config": config, "generations": generations})


def identical_to_ar(
    entries: Sequence[dict[str, Any]], skip: Collection[str] = ()
) -> dict[tuple[str, float, float], bool | None]:
    """For each (mode, rtt_ms, temperature) of the --trace entries but mode ar's: whether every
    generation's tokens equal mode ar's for the same prompt at the same temperature (at any RTT: ar's
    tokens do not depend on it; greedy, or sample-and-match seeded as ar is). None for the modes in
    `skip` (mss / rrs: their promise is ar's distribution, not its tokens) and where some prompt has
    no ar generation at that temperature to compare with."""
    ar = {
        (e["temperature"], e["prompt_index"]): e["tokens"]
        for e in entries
        if e["mode"] == "ar" and e.get("tokens") is not None
    }
    out: dict[tuple[str, float, float], bool | None] = {}
    for e in entries:
        key = (e["mode"], e["rtt_ms"], e["temperature"])
        if e["mode"] == "ar":
            continue
        ref = ar.get((e["temperature"], e["prompt_index"]))
        if e["mode"] in skip or ref is None or e.get("tokens") is None:
            out[key] = None
        elif out.get(key, True) is not None:
            out[key] = out.get(key, True) and e["tokens"] == ref
    return out


def _identity_line(rows: Sequence[dict[str, Any]]) -> str | None:
    checked = [r for r in rows if r.get("identical_to_ar") is not None]
    if not checked:
        return None
    differ = [
        f"{r['mode']} (rtt {r['rtt_ms']:g}, T {r['temperature']:g})"
        for r in checked
        if not r["identical_to_ar"]
    ]
    if differ:
        return "NOT identical to ar's tokens: " + ", ".join(differ)
    return f"identical to ar's tokens, prompt for prompt: all {len(checked)} rows checked"


def prespec_base(mode: str) -> str | None:
    """The mode whose tree a pre-speculating mode drafts without pre-speculation (tree_prespec_mss:
    tree_mss, budget_prespec: budget, tree_prespec_cache: tree); None for a mode that does not."""
    if "_prespec" not in mode:
        return None
    head, _, tail = mode.partition("_prespec")
    return head + tail if tail in ("", "_mss", "_rrs") else head


def goal_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The issue's goals as measured (benchmark figures, not tests): each pre-speculating mode against
    the same tree without it at every RTT, and against ar at RTT 50 (GOAL_X_AR)."""
    ms = {(r["rtt_ms"], r["mode"], r["temperature"]): float(r["ms_per_token"]) for r in rows}
    lines = []
    for t in sorted({r["temperature"] for r in rows}):
        ar50 = ms.get((50, "ar", t))
        for m in sorted({m for (_, m, tt) in ms if tt == t and prespec_base(m)}):
            base = prespec_base(m)
            pairs = [
                (rtt, ms[(rtt, m, t)] / ms[(rtt, base, t)])
                for rtt in sorted({k[0] for k in ms})
                if (rtt, m, t) in ms and (rtt, base, t) in ms
            ]
            if pairs:
                ratios = ", ".join(f"RTT {rtt:g}: {x:.3f}" for rtt, x in pairs)
                slower = ", ".join(f"{rtt:g}" for rtt, x in pairs if x > 1) or "none"
                lines.append(f"T={t:g}: {m}/{base} {ratios}; slower at RTT {slower}")
            if ar50 and (50, m, t) in ms:
                x = ms[(50, m, t)] / ar50
                goal = GOAL_X_AR.get(t)
                verdict = (
                    "" if goal is None else f" (goal <= {goal:.2f}: {'met' if x <= goal else 'not met'})"
                )
                lines.append(f"T={t:g}: at RTT 50 {m}/ar = {x:.3f}{verdict}")
    return lines


def goals(rows: list[dict[str, Any]]) -> list[str]:
    """goal_lines, then what the round trip costs the static tree (RTT 50 against RTT 0)."""
    lines = goal_lines(rows)
    for t in sorted({r["temperature"] for r in rows}):
        by = {(r["rtt_ms"], r["mode"]): r for r in rows if r["temperature"] == t}
        t0, t50 = by.get((0, "tree")), by.get((50, "tree"))
        if t0 and t50:
            lines.append(
                f"T={t:g}: tree ms/token at RTT 50 - at RTT 0 = "
                f"{t50['ms_per_token'] - t0['ms_per_token']:.1f} "
                f"(expected ~50/tau = {50 / t50['tau']:.1f})"
            )
    return lines
