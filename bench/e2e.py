"""End to end on one machine: target-only AR vs sequence vs tree speculation (DESIGN section 6).

Starts the verifier in its own process on its own cores, drafts with llama.cpp on the other
cores (one thread), and runs every mode on the same Spec-Bench prompts, interleaved prompt by
prompt so that drift in the machine's speed hits every mode alike.

    python -m bench.e2e --prompts 20 --tokens 128 --draft smollm2-135m-q4 --json bench/out/e2e.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.harness import BenchPrompt, CoreSplit, Verifier, load_prompts, table
from edge_client.client import EdgeClient, Generation, PrespecConfig, TreeSpec
from edge_client.drafters.registry import create_drafter
from edge_client.transport import LinkShape
from shared.messages import Mode
from shared.tree import ExpansionConfig

MODES = ("ar", "sequence", "tree")


@dataclass(frozen=True)
class Variant:
    """One way of generating that a bench compares: target-only, or a tree shape (+ pre-speculation)."""

    ar: bool = False
    tree: TreeSpec | None = None
    prespec: bool | PrespecConfig = False


FRUGAL_MIN_GAIN = 0.1


def variants(names: Sequence[str], tree: ExpansionConfig) -> dict[str, Variant]:
    table = {
        "ar": Variant(ar=True),
        "sequence": Variant(tree=TreeSpec("sequence", tree)),
        "tree": Variant(tree=TreeSpec("static", tree)),
        "tree_prespec": Variant(tree=TreeSpec("static", tree), prespec=True),
        # pre-speculation without the cost gate: every predicted outcome up to the fan-out
        "tree_prespec_ungated": Variant(tree=TreeSpec("static", tree), prespec=PrespecConfig(gate=False)),
        # pre-speculation holding back trees expected to save < 0.1 ms per ms of drafting (min_gain)
        "tree_prespec_frugal": Variant(
            tree=TreeSpec("static", tree), prespec=PrespecConfig(min_gain=FRUGAL_MIN_GAIN)
        ),
        "sequence_prespec": Variant(tree=TreeSpec("sequence", tree), prespec=True),
        "budget": Variant(tree=TreeSpec("budget")),
        "budget_prespec": Variant(tree=TreeSpec("budget"), prespec=True),
    }
    return {n: table[n] for n in names}


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

    def add(self, gen: Generation, forwards: float) -> None:
        st = gen.stats
        n = max(len(gen.tokens), 1)
        self.ms_per_token.append(st.ms_per_token)
        self.tau.append(st.tau)
        self.forwards_per_token.append(forwards / n)
        self.tokens.append(gen.tokens)
        self.rounds += st.rounds
        self.total_tokens += len(gen.tokens)
        self.bytes_up += st.bytes_up
        self.bytes_down += st.bytes_down
        self.hits += st.hits
        self.decided += st.decided
        self.predicted_hits += st.predicted_hits
        for k, v in st.hits_by_depth.items():
            self.hits_by_depth[k] = self.hits_by_depth.get(k, 0) + v
        for k, v in st.decided_by_depth.items():
            self.decided_by_depth[k] = self.decided_by_depth.get(k, 0) + v
        self.round_draft_ms.extend(st.draft_ms)
        self.round_verify_ms.extend(st.verify_ms)
        self.round_rtt_ms.extend(st.rtt_ms)
        self.prespec_ms += st.prespec_ms
        self.prespec_sent += st.prespec_sent
        self.prespec_cancelled += st.prespec_cancelled
        self.prespec_refused += st.prespec_refused

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
        }


async def run_modes(
    url: str,
    drafter: Any,
    prompts: Sequence[BenchPrompt],
    tokens: int,
    temperature: float,
    spec_mode: Mode,
    tree: ExpansionConfig,
    forwards: Callable[[], float],
    seed: int = 0,
    on_chunk: Callable[[str, int, str], None] | None = None,
    modes: Sequence[str] = MODES,
    progress: bool = True,
    link: LinkShape | None = None,
    api_key: str | None = None,
    couple: bool = True,
) -> tuple[dict[str, ModeRuns], dict[str, list[float]]]:
    """Each prompt in each mode (interleaved prompt by prompt); per-mode runs and the tree mode's
    tau per category. One session per mode, all through the same link. `couple`: coupled
    sample-and-match drafting (EdgeClient's `couple`)."""
    runs = {m: ModeRuns() for m in modes}
    by_cat: dict[str, list[float]] = {}
    vs = variants(modes, tree)
    clients = {
        m: EdgeClient(url, drafter, tree=v.tree, prespec=v.prespec, link=link, api_key=api_key, couple=couple)
        for m, v in vs.items()
    }
    for c in clients.values():
        await c.connect()
    try:
        # warm both sides up (first-call allocations, caches)
        c0 = next(iter(clients.values()))
        async for _ in c0.generate("Hello", max_new_tokens=8, mode=spec_mode, temperature=temperature):
            pass
        bar = tqdm(total=len(prompts) * len(modes), desc="e2e", disable=not progress, file=sys.stderr)
        for i, p in enumerate(prompts):
            for m, v in vs.items():
                client = clients[m]
                f0 = forwards()
                async for chunk in client.generate(
                    p.text,
                    max_new_tokens=tokens,
                    temperature=temperature,
                    seed=seed + i,
                    mode=Mode.AR if v.ar else spec_mode,
                ):
                    if on_chunk is not None:
                        on_chunk(m, i, chunk)
                gen: Generation | None = client.last
                assert gen is not None
                runs[m].add(gen, forwards() - f0)
                if m == "tree":
                    by_cat.setdefault(p.category, []).append(gen.stats.tau)
                bar.update(1)
        bar.close()
    finally:
        for c in clients.values():
            await c.close()
    return runs, by_cat


def report(runs: dict[str, ModeRuns], by_cat: dict[str, list[float]], exact: bool) -> dict[str, Any]:
    modes = {m: r.summary() for m, r in runs.items()}
    identical: bool | None = None
    if exact and "ar" in runs:
        ar = runs["ar"].tokens
        identical = all(runs[m].tokens == ar for m in runs if m != "ar")
    return {
        "modes": modes,
        "tau_by_category": {c: round(statistics.mean(v), 4) for c, v in sorted(by_cat.items())},
        "identical_to_ar": identical,
    }


def print_report(result: dict[str, Any], title: str) -> None:
    rows = []
    ar_ms = result["modes"].get("ar", {}).get("ms_per_token") or 0.0
    for m, s in result["modes"].items():
        speed = ar_ms / s["ms_per_token"] if s["ms_per_token"] and ar_ms else 0.0
        rows.append([m, s["ms_per_token"], s["tau"], s["target_forwards_per_token"], speed])
    print(f"\n{title}")
    print(table(rows, ["mode", "ms/token", "tau", "target fwd/token", "speedup vs ar"]))
    if result["tau_by_category"]:
        print(table([[c, t] for c, t in result["tau_by_category"].items()], ["category", "tau (tree)"]))
    print(f"identical to target-only AR: {result['identical_to_ar']}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.e2e",
        description="Target-only AR vs sequence vs tree speculation end to end on Spec-Bench prompts "
        "(verifier and edge pinned to disjoint cores).",
    )
    ap.add_argument(
        "--prompts", type=int, default=20, help="Spec-Bench dev prompts (round-robin over categories)"
    )
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    ap.add_argument(
        "--mode",
        default=None,
        choices=["greedy", "match", "mss", "rrs"],
        help="speculative verification mode (default: greedy at temperature 0, match above)",
    )
    ap.add_argument("--draft", default="smollm2-135m-q4", help="draft alias or GGUF path")
    ap.add_argument("--drafter", default="llama_cpp", choices=["llama_cpp", "torch"], help="draft backend")
    ap.add_argument("--model", default="smollm2-135m", help="target model of the verifier")
    ap.add_argument(
        "--tree", default="1,1,3,1,1,1,1,1", help="expansion config; the sequence draft is as deep"
    )
    ap.add_argument(
        "--url", default=None, help="use a running verifier at this ws:// URL instead of starting one"
    )
    ap.add_argument("--seed", type=int, default=0, help="sampling seed of the first prompt (then +1 each)")
    ap.add_argument("--json", default=None, help="write the results to this JSON file")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = ap.parse_args(argv)
    mode = Mode(a.mode) if a.mode else (Mode.GREEDY if a.temperature == 0 else Mode.MATCH)
    if mode.stochastic and a.temperature <= 0:
        ap.error(f"--mode {mode.value} needs --temperature > 0")
    split = CoreSplit.auto()
    print(split.describe(), flush=True)
    prompts = load_prompts(a.prompts)
    tree = ExpansionConfig.parse(a.tree)
    verifier = None
    if a.url is None:
        extra = ["--trust-anonymous"] if mode.stochastic else []
        verifier = Verifier(a.model, cores=split.verifier, threads=len(split.verifier), args=extra).start()
        url = verifier.url
        forwards = verifier.forwards
    else:
        url = a.url
        forwards = _remote_forwards(url)
    split.pin_edge()
    drafter = create_drafter(a.drafter, a.draft, n_threads=1)
    try:
        runs, by_cat = asyncio.run(
            run_modes(
                url,
                drafter,
                prompts,
                a.tokens,
                a.temperature,
                mode,
                tree,
                forwards,
                a.seed,
                progress=not a.no_progress,
            )
        )
    finally:
        drafter.close()
        if verifier is not None:
            verifier.stop()
    exact = mode in (Mode.GREEDY, Mode.MATCH)
    result = report(runs, by_cat, exact)
    result["config"] = {
        "prompts": a.prompts,
        "tokens": a.tokens,
        "temperature": a.temperature,
        "mode": mode.value,
        "draft": a.draft,
        "drafter": a.drafter,
        "model": a.model,
        "tree": a.tree,
        "cores": {"edge": list(split.edge), "verifier": list(split.verifier)},
    }
    print_report(
        result,
        f"{a.model} verifier, draft {a.draft} ({a.drafter}), {mode.value} T={a.temperature}, "
        f"{a.prompts} prompts x {a.tokens} tokens (medians)",
    )
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=2))
    return 0


def _remote_forwards(url: str) -> Callable[[], float]:
    v = Verifier("remote")
    host_port = url.split("//", 1)[1].split("/", 1)[0]
    v.port = int(host_port.rsplit(":", 1)[1])
    return v.forwards


if __name__ == "__main__":
    sys.exit(main())
