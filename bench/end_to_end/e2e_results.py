"""bench.end_to_end.e2e's results: one generation's record, the runs of one mode (`ModeRuns`), the report and
its table, and the merge of results made in pieces (`--merge`)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.harness import BenchPrompt, read_runs, table
from edge_client.client import GenerationResult


def generation_record(
    gen: GenerationResult, forwards: float, prompt: BenchPrompt | None = None
) -> dict[str, Any]:
    """What one generation measured, as plain JSON (bench files keep these, so runs made in pieces
    can be put together and summarised again: `--merge`)."""
    st = gen.stats
    return {
        "prompt": None if prompt is None else str(prompt.question_id),
        "category": None if prompt is None else prompt.category,
        "tokens": list(gen.tokens),
        "ms_per_token": st.ms_per_token,
        "tau": st.tau,
        "rounds": st.rounds,
        "forwards": forwards,
        "bytes_up": st.bytes_up,
        "bytes_down": st.bytes_down,
        "hits": st.hits,
        "decided": st.decided,
        "predicted_hits": st.predicted_hits,
        "hits_by_depth": {str(k): v for k, v in st.hits_by_depth.items()},
        "decided_by_depth": {str(k): v for k, v in st.decided_by_depth.items()},
        "accepted_counts": list(st.accepted_counts),
        "draft_ms": list(st.draft_ms),
        "verify_ms": list(st.verify_ms),
        "rtt_ms": list(st.rtt_ms),
        "prespec_ms": st.prespec_ms,
        "prespec_sent": st.prespec_sent,
        "prespec_cancelled": st.prespec_cancelled,
        "prespec_refused": st.prespec_refused,
        "ttft_ms": st.first_token_s * 1e3,
        "wall_ms": st.wall_s * 1e3,
        "kinds": dict(st.kinds),
        "kind_tokens": dict(st.kind_tokens),
        "kind_ms": dict(st.kind_ms),
        "plans": dict(st.plans),
    }


@dataclass
class ModeRuns:
    ms_per_token: list[float] = field(default_factory=list)
    tau: list[float] = field(default_factory=list)
    forwards_per_token: list[float] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    rounds: int = 0
    total_tokens: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    hits: int = 0
    decided: int = 0
    predicted_hits: float = 0.0
    hits_by_depth: dict[int, int] = field(default_factory=dict)
    decided_by_depth: dict[int, int] = field(default_factory=dict)
    # rounds that accepted a node at depth d + 1 (index d), over every generation
    accepted_counts: list[int] = field(default_factory=list)
    # per category: [tokens, rounds] pooled over its generations
    by_category: dict[str, list[int]] = field(default_factory=dict)
    # over every generation: drafting on the critical path (one entry per synchronous draft), the
    # server's verify time and the network time (send -> verdict minus verify) per round, and the
    # pre-speculative drafting done off the critical path
    round_draft_ms: list[float] = field(default_factory=list)
    round_verify_ms: list[float] = field(default_factory=list)
    round_rtt_ms: list[float] = field(default_factory=list)
    prespec_ms: float = 0.0
    prespec_sent: int = 0
    prespec_cancelled: int = 0
    prespec_refused: int = 0
    records: list[dict[str, Any]] = field(default_factory=list)

    def add(self, gen: GenerationResult, forwards: float, prompt: BenchPrompt | None = None) -> None:
        self.add_record(generation_record(gen, forwards, prompt))

    def add_record(self, r: dict[str, Any]) -> None:
        n = max(len(r["tokens"]), 1)
        self.records.append(r)
        self.ms_per_token.append(r["ms_per_token"])
        self.tau.append(r["tau"])
        self.forwards_per_token.append(r["forwards"] / n)
        self.tokens.append(list(r["tokens"]))
        self.rounds += r["rounds"]
        self.total_tokens += len(r["tokens"])
        self.bytes_up += r["bytes_up"]
        self.bytes_down += r["bytes_down"]
        self.hits += r["hits"]
        self.decided += r["decided"]
        self.predicted_hits += r["predicted_hits"]
        for k, v in r["hits_by_depth"].items():
            self.hits_by_depth[int(k)] = self.hits_by_depth.get(int(k), 0) + v
        for k, v in r["decided_by_depth"].items():
            self.decided_by_depth[int(k)] = self.decided_by_depth.get(int(k), 0) + v
        for d, c in enumerate(r.get("accepted_counts", [])):
            while len(self.accepted_counts) <= d:
                self.accepted_counts.append(0)
            self.accepted_counts[d] += c
        if r.get("category"):
            cat = self.by_category.setdefault(r["category"], [0, 0])
            cat[0] += len(r["tokens"])
            cat[1] += r["rounds"]
        self.round_draft_ms.extend(r["draft_ms"])
        self.round_verify_ms.extend(r["verify_ms"])
        self.round_rtt_ms.extend(r["rtt_ms"])
        self.prespec_ms += r["prespec_ms"]
        self.prespec_sent += r["prespec_sent"]
        self.prespec_cancelled += r["prespec_cancelled"]
        self.prespec_refused += r["prespec_refused"]

    def summary(self) -> dict[str, Any]:
        def med(x: list[float]) -> float:
            return round(statistics.median(x), 4) if x else 0.0

        return {
            "ms_per_token": med(self.ms_per_token),
            "tau": med(self.tau),
            "target_forwards_per_token": med(self.forwards_per_token),
            "tau_pooled": round(self.total_tokens / self.rounds, 4) if self.rounds else 0.0,
            "bytes_up_per_token": round(self.bytes_up / max(self.total_tokens, 1), 2),
            "bytes_down_per_token": round(self.bytes_down / max(self.total_tokens, 1), 2),
            "hit_rate": round(self.hits / self.decided, 4) if self.decided else None,
            # the outcome model's mean odds of a hit for the outcomes it drafted for (calibrates hit_rate)
            "predicted_hit_rate": round(self.predicted_hits / self.decided, 4) if self.decided else None,
            "hit_rate_by_depth": {
                str(k): round(self.hits_by_depth.get(k, 0) / n, 4)
                for k, n in sorted(self.decided_by_depth.items())
            },
            # mean over rounds: a round whose tree was pre-speculated drafts nothing on the path
            "draft_ms_per_round": round(sum(self.round_draft_ms) / self.rounds, 4) if self.rounds else 0.0,
            "verify_ms_per_round": med(self.round_verify_ms),
            "rtt_ms_per_round": med(self.round_rtt_ms),
            "prespec_draft_ms_per_round": round(self.prespec_ms / self.rounds, 4) if self.rounds else 0.0,
            "prespec_trees_per_round": round(self.prespec_sent / self.rounds, 4) if self.rounds else 0.0,
            # conditional drafts abandoned mid-way because a verdict ruled their outcome out
            "prespec_cancelled_per_round": round(self.prespec_cancelled / self.rounds, 4)
            if self.rounds
            else 0.0,
            # conditional trees the server had no room for (TOO_MANY_PENDING), dropped
            "prespec_refused_per_round": round(self.prespec_refused / self.rounds, 4) if self.rounds else 0.0,
            # fraction of rounds whose accepted path reached depth d (1, 2, ...)
            "acceptance_by_depth": [round(c / self.rounds, 4) for c in self.accepted_counts]
            if self.rounds
            else [],
            # tokens per round pooled over each category's generations
            "tau_by_category": {
                c: round(t / r, 4) if r else 0.0 for c, (t, r) in sorted(self.by_category.items())
            },
            "by_suite": self.by_suite(),
        }

    def by_suite(self) -> dict[str, dict[str, float]]:
        """HumanEval and Spec-Bench apart (the goals are per suite): medians over the suite's
        generations of ms/token, tau and target forwards per token, and tau pooled."""
        groups: dict[str, list[dict[str, Any]]] = {}
        for r in self.records:
            if r.get("category"):
                groups.setdefault(suite_of(r["category"]), []).append(r)
        out = {}
        for suite, recs in sorted(groups.items()):
            tokens = sum(len(r["tokens"]) for r in recs)
            rounds = sum(r["rounds"] for r in recs)
            out[suite] = {
                "generations": len(recs),
                "ms_per_token": round(statistics.median(r["ms_per_token"] for r in recs), 4),
                "tau": round(statistics.median(r["tau"] for r in recs), 4),
                "tau_pooled": round(tokens / rounds, 4) if rounds else 0.0,
                "target_forwards_per_token": round(
                    statistics.median(r["forwards"] / max(len(r["tokens"]), 1) for r in recs), 4
                ),
            }
        return out


def suite_of(category: str) -> str:
    """The prompt suite of a category: HumanEval's one, or Spec-Bench's many."""
    return "humaneval" if category == "humaneval" else "spec_bench"


def report(runs: dict[str, ModeRuns], by_cat: dict[str, list[float]], exact: bool) -> dict[str, Any]:
    """Per-mode summaries, tau per category (of the tree mode, and per mode in each summary),
    whether every mode's tokens equal `ar`'s, and the per-generation records."""
    modes = {m: r.summary() for m, r in runs.items()}
    identical: bool | None = None
    if exact and "ar" in runs:
        ar = _by_prompt(runs["ar"])
        identical = all(_by_prompt(runs[m]) == ar for m in runs if m != "ar")
    tree = runs.get("tree")
    return {
        "modes": modes,
        "tau_by_category": tree.summary()["tau_by_category"] if tree is not None else {},
        "identical_to_ar": identical,
        "records": {m: r.records for m, r in runs.items()},
    }


def _by_prompt(runs: ModeRuns) -> dict[str | None, list[int]]:
    return {r["prompt"]: list(r["tokens"]) for r in runs.records}


def render_report(result: dict[str, Any], title: str) -> str:
    """The printed report: the title, the per-mode table, tau per category and per suite, the
    acceptance by depth and whether every mode's tokens equal ar's."""
    out: list[str] = []
    rows = []
    ar_ms = result["modes"].get("ar", {}).get("ms_per_token") or 0.0
    for m, s in result["modes"].items():
        speed = ar_ms / s["ms_per_token"] if s["ms_per_token"] and ar_ms else 0.0
        rows.append([m, s["ms_per_token"], s["tau"], s["target_forwards_per_token"], speed])
    out.append(f"\n{title}")
    out.append(table(rows, ["mode", "ms/token", "tau", "target fwd/token", "speedup vs ar"]))
    spec = [m for m in result["modes"] if m != "ar"]
    cats = sorted({c for m in spec for c in result["modes"][m]["tau_by_category"]})
    if cats:
        out.append(
            table(
                [[c, *(result["modes"][m]["tau_by_category"].get(c, "-") for m in spec)] for c in cats],
                ["category", *(f"tau {m}" for m in spec)],
            )
        )
    suites = [
        [m, suite, v["ms_per_token"], v["tau"], v["tau_pooled"], v["target_forwards_per_token"]]
        for m, s in result["modes"].items()
        for suite, v in s.get("by_suite", {}).items()
    ]
    if suites:
        out.append(table(suites, ["mode", "suite", "ms/token", "tau", "tau pooled", "target fwd/token"]))
    depth = max((len(result["modes"][m]["acceptance_by_depth"]) for m in spec), default=0)
    if depth:
        out.append("fraction of rounds accepting a node at depth d:")
        out.append(
            table(
                [
                    [m, *(f"{x:.2f}" for x in result["modes"][m]["acceptance_by_depth"])]
                    + ["-"] * (depth - len(result["modes"][m]["acceptance_by_depth"]))
                    for m in spec
                ],
                ["mode", *(str(d + 1) for d in range(depth))],
            )
        )
    out.append(f"identical to target-only AR: {result['identical_to_ar']}")
    return "\n".join(out)


def merge_results(paths: Sequence[str]) -> dict[str, Any]:
    """Put together the JSON of runs made in pieces (other modes, same settings and prompts): the
    per-generation records of every file (a later file's record replaces an earlier one for the
    same mode and prompt), summarised again."""
    docs, first = read_runs(
        paths,
        "bench.end_to_end.e2e",
        "records",
        dict,
        "no per-generation 'records'; was it written by this bench.end_to_end.e2e?",
        SAME_RUN,
    )
    records: dict[str, dict[str | None, dict[str, Any]]] = {}
    for _path, doc in docs:
        for mode, recs in doc["records"].items():
            for r in recs:
                records.setdefault(mode, {})[r.get("prompt")] = r
    runs: dict[str, ModeRuns] = {}
    for mode in sorted(records, key=lambda m: (m != "ar", m)):
        runs[mode] = ModeRuns()
        for r in records[mode].values():
            runs[mode].add_record(r)
    exact = first.get("mode") in ("greedy", "match")
    result = report(runs, {}, exact)
    result["config"] = {**first, "merged_from": list(paths), "modes": ",".join(runs)}
    return result


# settings that must agree for the records of several files to be put together (--merge)
SAME_RUN = (
    "model",
    "draft",
    "drafter",
    "humaneval",
    "prompts",
    "tokens",
    "temperature",
    "mode",
    "tree",
    "seed",
)
