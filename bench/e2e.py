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
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.harness import BenchPrompt, CoreSplit, Verifier, load_suite, table
from edge_client.client import EdgeClient, GenerationResult, PrespecConfig, TreeSpec
from edge_client.defaults import recommended_tree
from edge_client.drafters.registry import create_drafter
from edge_client.transport import LinkShape
from shared.messages import Mode
from shared.model_store import DEFAULT_DRAFT, DEFAULT_TARGET
from shared.tree import ExpansionConfig

MODES = ("ar", "sequence", "tree")


@dataclass(frozen=True)
class Variant:
    """One way of generating that a bench compares: target-only, or a tree shape (+ pre-speculation)."""

    ar: bool = False
    tree: TreeSpec | None = None
    prespec: bool | PrespecConfig = False
    mode: Mode | None = None  # a verification mode of its own (e.g. rrs), else the run's


FRUGAL_MIN_GAIN = 0.1


def variants(names: Sequence[str], tree: ExpansionConfig) -> dict[str, Variant]:
    table = _variants(tree)
    return {n: table[n] for n in names}


def _variants(tree: ExpansionConfig) -> dict[str, Variant]:
    return {
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
        # conditional trees drafted one at a time instead of in lockstep batches
        "tree_prespec_single": Variant(tree=TreeSpec("static", tree), prespec=PrespecConfig(batch=1)),
        "sequence_prespec_single": Variant(tree=TreeSpec("sequence", tree), prespec=PrespecConfig(batch=1)),
        "budget": Variant(tree=TreeSpec("budget")),
        "budget_prespec": Variant(tree=TreeSpec("budget"), prespec=True),
        # recursive rejection sampling (a trusted key; sampled rows only)
        "tree_rrs": Variant(tree=TreeSpec("static", tree), mode=Mode.RRS),
        "tree_prespec_rrs": Variant(tree=TreeSpec("static", tree), prespec=True, mode=Mode.RRS),
    }


ALL_MODES = tuple(_variants(ExpansionConfig()))


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
        async for _ in c0.generate("Hello", max_new_tokens=4, mode=spec_mode, temperature=temperature):
            pass
        bar = tqdm(total=len(prompts) * len(modes), desc="e2e", disable=not progress, file=sys.stderr)
        for i, p in enumerate(prompts):
            for m, v in vs.items():
                client = clients[m]
                f0 = forwards()
                async for chunk in client.generate(
                    p.text,
                    raw=p.raw,
                    max_new_tokens=tokens,
                    temperature=temperature,
                    seed=seed + i,
                    mode=Mode.AR if v.ar else (v.mode or spec_mode),
                ):
                    if on_chunk is not None:
                        on_chunk(m, i, chunk)
                gen: GenerationResult | None = client.last
                assert gen is not None
                runs[m].add(gen, forwards() - f0, p)
                if m == "tree":
                    by_cat.setdefault(p.category, []).append(gen.stats.tau)
                bar.update(1)
        bar.close()
    finally:
        for c in clients.values():
            await c.close()
    return runs, by_cat


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


def print_report(result: dict[str, Any], title: str) -> None:
    rows = []
    ar_ms = result["modes"].get("ar", {}).get("ms_per_token") or 0.0
    for m, s in result["modes"].items():
        speed = ar_ms / s["ms_per_token"] if s["ms_per_token"] and ar_ms else 0.0
        rows.append([m, s["ms_per_token"], s["tau"], s["target_forwards_per_token"], speed])
    print(f"\n{title}")
    print(table(rows, ["mode", "ms/token", "tau", "target fwd/token", "speedup vs ar"]))
    spec = [m for m in result["modes"] if m != "ar"]
    cats = sorted({c for m in spec for c in result["modes"][m]["tau_by_category"]})
    if cats:
        print(
            table(
                [[c, *(result["modes"][m]["tau_by_category"].get(c, "-") for m in spec)] for c in cats],
                ["category", *(f"tau {m}" for m in spec)],
            )
        )
    depth = max((len(result["modes"][m]["acceptance_by_depth"]) for m in spec), default=0)
    if depth:
        print("fraction of rounds accepting a node at depth d:")
        print(
            table(
                [
                    [m, *(f"{x:.2f}" for x in result["modes"][m]["acceptance_by_depth"])]
                    + ["-"] * (depth - len(result["modes"][m]["acceptance_by_depth"]))
                    for m in spec
                ],
                ["mode", *(str(d + 1) for d in range(depth))],
            )
        )
    print(f"identical to target-only AR: {result['identical_to_ar']}")


def merge_results(paths: Sequence[str]) -> dict[str, Any]:
    """Put together the JSON of runs made in pieces (other modes, same settings and prompts): the
    per-generation records of every file (a later file's record replaces an earlier one for the
    same mode and prompt), summarised again."""
    if not paths:
        raise ValueError("name at least one JSON file")
    first: dict[str, Any] | None = None
    records: dict[str, dict[str | None, dict[str, Any]]] = {}
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: cannot read a bench.e2e JSON file ({exc})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("records"), dict):
            raise ValueError(f"{path}: no per-generation 'records'; was it written by this bench.e2e?")
        cfg = doc.get("config") or {}
        if first is None:
            first = cfg
        diff = [k for k in SAME_RUN if cfg.get(k) != first.get(k)]
        if diff:
            raise ValueError(
                f"{path} was run with other settings than {paths[0]}: "
                + ", ".join(f"{k} {cfg.get(k)!r} vs {first.get(k)!r}" for k in diff)
            )
        for mode, recs in doc["records"].items():
            for r in recs:
                records.setdefault(mode, {})[r.get("prompt")] = r
    assert first is not None
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


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.e2e",
        description="Target-only AR vs sequence vs tree speculation end to end on HumanEval and Spec-Bench "
        "dev prompts (verifier and edge pinned to disjoint cores).",
    )
    ap.add_argument("--humaneval", type=int, default=20, help="HumanEval dev prompts (the code prompt, raw)")
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
    ap.add_argument("--draft", default=DEFAULT_DRAFT, help="draft alias or GGUF path")
    ap.add_argument(
        "--drafter",
        default="llama_cpp",
        choices=["llama_cpp", "torch", "onnx"],
        help="draft backend (onnx: --draft may also be an `edge-client export-onnx` folder)",
    )
    ap.add_argument("--model", default=DEFAULT_TARGET, help="target model of the verifier")
    ap.add_argument(
        "--tree",
        default=None,
        help="expansion config of the tree modes; the sequence draft is as deep (default: the draft's "
        "recommended tree, edge_client.defaults)",
    )
    ap.add_argument(
        "--modes", default="ar,sequence,tree,budget", help=f"modes to run, from {','.join(ALL_MODES)}"
    )
    ap.add_argument(
        "--url", default=None, help="use a running verifier at this ws:// URL instead of starting one"
    )
    ap.add_argument("--seed", type=int, default=0, help="sampling seed of the first prompt (then +1 each)")
    ap.add_argument("--json", default=None, help="write the results to this JSON file")
    ap.add_argument(
        "--merge",
        default=None,
        metavar="A.json,B.json",
        help="run nothing: put together earlier --json files of the same settings (e.g. ar in one run, "
        "the speculative modes in another), print the table and write --json",
    )
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = ap.parse_args(argv)
    if a.merge:
        try:
            result = merge_results([p for p in a.merge.split(",") if p])
        except ValueError as exc:
            ap.error(f"--merge: {exc}")
        cfg = result["config"]
        _print_and_write(result, cfg, a.json)
        return 0
    mode = Mode(a.mode) if a.mode else (Mode.GREEDY if a.temperature == 0 else Mode.MATCH)
    if mode.stochastic and a.temperature <= 0:
        ap.error(f"--mode {mode.value} needs --temperature > 0")
    modes = [m for m in a.modes.split(",") if m]
    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown or not modes:
        ap.error(f"--modes: unknown {unknown or 'none given'}; choose from {','.join(ALL_MODES)}")
    tree_text = a.tree or recommended_tree(a.draft)
    split = CoreSplit.auto()
    print(split.describe(), flush=True)
    prompts = load_suite(a.humaneval, a.prompts)
    tree = ExpansionConfig.parse(tree_text)
    verifier = None
    api_key = None
    if a.url is None:
        extra: list[str] = []
        if mode.stochastic or any(m.endswith("_rrs") for m in modes):
            key_file, api_key = trusted_key_file()
            extra = ["--api-key-file", str(key_file)]
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
                modes=modes,
                progress=not a.no_progress,
                api_key=api_key,
            )
        )
    finally:
        drafter.close()
        if verifier is not None:
            verifier.stop()
    exact = mode in (Mode.GREEDY, Mode.MATCH)
    result = report(runs, by_cat, exact)
    result["config"] = {
        "humaneval": a.humaneval,
        "prompts": a.prompts,
        "tokens": a.tokens,
        "temperature": a.temperature,
        "mode": mode.value,
        "draft": a.draft,
        "drafter": a.drafter,
        "model": a.model,
        "tree": tree_text,
        "seed": a.seed,
        "modes": ",".join(modes),
        "cores": {"edge": list(split.edge), "verifier": list(split.verifier)},
    }
    _print_and_write(result, result["config"], a.json)
    return 0


def _print_and_write(result: dict[str, Any], cfg: dict[str, Any], path: str | None) -> None:
    merged = f", merged from {len(cfg['merged_from'])} files" if cfg.get("merged_from") else ""
    print_report(
        result,
        f"{cfg.get('model')} verifier, draft {cfg.get('draft')} ({cfg.get('drafter')}), {cfg.get('mode')} "
        f"T={cfg.get('temperature')}, tree {cfg.get('tree')}, {cfg.get('humaneval')} HumanEval + "
        f"{cfg.get('prompts')} Spec-Bench prompts x {cfg.get('tokens')} tokens{merged} (medians)",
    )
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2))


def trusted_key_file() -> tuple[Path, str]:
    """A fresh API-key file with one key marked trusted (the stochastic modes need one)."""
    import secrets
    import tempfile

    key = secrets.token_hex(16)
    fd, name = tempfile.mkstemp(prefix="bench-keys-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write(f"{key} trusted\n")
    return Path(name), key


def _remote_forwards(url: str) -> Callable[[], float]:
    v = Verifier("remote")
    host_port = url.split("//", 1)[1].split("/", 1)[0]
    v.port = int(host_port.rsplit(":", 1)[1])
    return v.forwards


if __name__ == "__main__":
    sys.exit(main())
