"""End to end on one machine: target-only AR vs sequence vs tree speculation on HumanEval and Spec-Bench
dev prompts, verifier and edge pinned to disjoint cores (docs/architecture.md §6).

Starts the verifier in its own process on its own cores, drafts with llama.cpp on the other
cores (one thread), and runs every mode on the same Spec-Bench prompts, interleaved prompt by
prompt so that drift in the machine's speed hits every mode alike.

    python -m bench.end_to_end.e2e --prompts 20 --tokens 128 --draft smollm2-135m-q4 --json bench/out/e2e.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.end_to_end.e2e_results import ModeRuns, merge_results, render_report, report
from bench.harness import BenchPrompt, CoreSplit, Verifier, add_common_args
from bench.lib import runner
from bench.lib.args import add_model_args, suite_from_args
from bench.lib.runner import Result, UsageError
from bench.lib.shaper import LinkShape
from edge_client.client import EdgeClient, GenerationResult, PrespecConfig, TreeSpec
from edge_client.defaults import recommended_tree
from edge_client.drafters.registry import backend_choices, create_drafter
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
    objective: str | None = None  # the SDK's mode auto with this objective (it picks its own trees)

    def generate_args(self, spec_mode: Mode) -> dict[str, Any]:
        """The mode (and objective) its generations ask EdgeClient.generate for."""
        if self.objective is not None:
            return {"mode": "auto", "objective": self.objective}
        return {"mode": Mode.AR if self.ar else (self.mode or spec_mode)}


FRUGAL_MIN_GAIN = 0.1


def variants(names: Sequence[str], tree: ExpansionConfig, saguaro_c: float = 1.0) -> dict[str, Variant]:
    """The named variants; `saguaro_c` != 1 turns on Saguaro sampling (PrespecConfig.saguaro_c, mss
    and rrs only) in every pre-speculating one."""
    table = _variants(tree)
    out = {n: table[n] for n in names}
    if saguaro_c != 1.0:
        for n, v in out.items():
            if v.prespec:
                cfg = v.prespec if isinstance(v.prespec, PrespecConfig) else PrespecConfig()
                out[n] = dataclasses.replace(v, prespec=dataclasses.replace(cfg, saguaro_c=saguaro_c))
    return out


def _variants(tree: ExpansionConfig) -> dict[str, Variant]:
    return {
        "ar": Variant(ar=True),
        # the SDK's default: each round streams or speculates, planned for the user's latency or
        # for the verifier's cost (edge_client.speculation.auto)
        "auto": Variant(objective="latency"),
        "auto_cost": Variant(objective="cost"),
        "sequence": Variant(tree=TreeSpec("sequence", tree)),
        "tree": Variant(tree=TreeSpec("static", tree)),
        "tree_prespec": Variant(tree=TreeSpec("static", tree), prespec=True),
        # pre-speculation without the cost gate: every predicted outcome up to the fan-out
        "tree_prespec_ungated": Variant(tree=TreeSpec("static", tree), prespec=PrespecConfig(gate=False)),
        # pre-speculation holding back trees expected to save < 0.1 ms per ms of drafting (min_gain)
        "tree_prespec_frugal": Variant(
            tree=TreeSpec("static", tree), prespec=PrespecConfig(min_gain=FRUGAL_MIN_GAIN)
        ),
        # the outcomes pre-speculated: the likeliest alone, or as many at every accepted length
        "tree_prespec_top": Variant(tree=TreeSpec("static", tree), prespec=PrespecConfig(allocation="top")),
        "tree_prespec_uniform": Variant(
            tree=TreeSpec("static", tree), prespec=PrespecConfig(allocation="uniform")
        ),
        "sequence_prespec": Variant(tree=TreeSpec("sequence", tree), prespec=True),
        # conditional trees drafted one at a time instead of in lockstep batches
        "tree_prespec_single": Variant(tree=TreeSpec("static", tree), prespec=PrespecConfig(batch=1)),
        "sequence_prespec_single": Variant(tree=TreeSpec("sequence", tree), prespec=PrespecConfig(batch=1)),
        # the outcome cache on (default off): the likeliest outcome alone, then chains planned to the verdict
        "tree_prespec_cache": Variant(tree=TreeSpec("static", tree), prespec=PrespecConfig(cache=True)),
        # the miss path: always the configured tree, or always the best chain (default: priced, auto)
        "tree_prespec_fulltree": Variant(tree=TreeSpec("static", tree), prespec=PrespecConfig(backup="tree")),
        "tree_prespec_chain": Variant(tree=TreeSpec("static", tree), prespec=PrespecConfig(backup="chain")),
        "budget": Variant(tree=TreeSpec("budget")),
        "budget_prespec": Variant(tree=TreeSpec("budget"), prespec=True),
        # budget trees pre-speculated one at a time instead of in lockstep batches, or with
        # the outcome cache (the likeliest outcome's budget tree, then chains planned to the verdict)
        "budget_prespec_single": Variant(tree=TreeSpec("budget"), prespec=PrespecConfig(batch=1)),
        "budget_prespec_cache": Variant(tree=TreeSpec("budget"), prespec=PrespecConfig(cache=True)),
        # SpecInfer's multi-step speculative sampling (children drawn with replacement) and recursive
        # rejection sampling (without): a trusted key; sampled rows only
        "tree_mss": Variant(tree=TreeSpec("static", tree), mode=Mode.MSS),
        "tree_prespec_mss": Variant(tree=TreeSpec("static", tree), prespec=True, mode=Mode.MSS),
        "tree_rrs": Variant(tree=TreeSpec("static", tree), mode=Mode.RRS),
        "tree_prespec_rrs": Variant(tree=TreeSpec("static", tree), prespec=True, mode=Mode.RRS),
        "tree_prespec_rrs_single": Variant(
            tree=TreeSpec("static", tree), prespec=PrespecConfig(batch=1), mode=Mode.RRS
        ),
    }


ALL_MODES = tuple(_variants(ExpansionConfig()))
# modes with a stochastic verification of their own (mss / rrs): a trusted key, sampled rows only
STOCHASTIC_MODES = tuple(
    name for name, v in _variants(ExpansionConfig()).items() if v.mode is not None and v.mode.stochastic
)


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
    trace: bool = False,
    on_generation: Callable[[str, int, GenerationResult], None] | None = None,
    saguaro_c: float = 1.0,
    transports: Callable[[str], Callable[[], Awaitable[Any]]] | None = None,
) -> tuple[dict[str, ModeRuns], dict[str, list[float]]]:
    """Each prompt in each mode (interleaved prompt by prompt); per-mode runs and the tree mode's
    tau per category. One session per mode, all through the same link. `couple`: coupled
    sample-and-match drafting (EdgeClient's `couple`); `trace`: record each generation's rounds
    (EdgeClient's `trace`); `on_generation(mode, prompt index, result)` after each generation;
    `transports(mode)`: the mode's EdgeClient transport factory (e.g. bench.lib.replay.Recorders)."""
    runs = {m: ModeRuns() for m in modes}
    by_cat: dict[str, list[float]] = {}
    vs = variants(modes, tree, saguaro_c)
    clients = {
        m: EdgeClient(
            url,
            drafter,
            tree=v.tree,
            prespec=v.prespec,
            link=link,
            api_key=api_key,
            couple=couple,
            trace=trace,
            transport=transports(m) if transports is not None else None,
        )
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
                    **v.generate_args(spec_mode),
                ):
                    if on_chunk is not None:
                        on_chunk(m, i, chunk)
                gen: GenerationResult | None = client.last
                assert gen is not None
                runs[m].add(gen, forwards() - f0, p)
                if on_generation is not None:
                    on_generation(m, i, gen)
                if m == "tree":
                    by_cat.setdefault(p.category, []).append(gen.stats.tau)
                bar.update(1)
        bar.close()
    finally:
        for c in clients.values():
            await c.close()
    return runs, by_cat


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--humaneval", type=int, default=20, help="HumanEval dev prompts (the code prompt, raw)")
    ap.add_argument(
        "--prompts", type=int, default=20, help="Spec-Bench dev prompts (round-robin over categories)"
    )
    add_common_args(
        ap,
        json=True,
        json_help="rows: each mode's summary; records: every generation's (what --merge reads)",
        seed=0,
        seed_help="sampling seed of the first prompt (then +1 each)",
        tokens=128,
        prompt_file=True,
        no_progress=True,
    )
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    ap.add_argument(
        "--mode",
        default=None,
        choices=["greedy", "match", "mss", "rrs"],
        help="speculative verification mode (default: greedy at temperature 0, match above)",
    )
    add_model_args(ap, model=DEFAULT_TARGET, draft=DEFAULT_DRAFT)
    ap.add_argument(
        "--drafter",
        default="auto",
        choices=backend_choices(),
        help="draft backend (auto: llama.cpp or the ONNX int8 export, whichever is faster on this machine, "
        "measured once and cached; onnx: --draft may also be an `edge-client export-onnx` folder)",
    )
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
    ap.add_argument(
        "--merge",
        default=None,
        metavar="A.json,B.json",
        help="run nothing: put together earlier --json files of the same settings (e.g. ar in one run, "
        "the speculative modes in another), print the table and write --json",
    )


def run(a: argparse.Namespace) -> Result:
    if a.merge:
        try:
            merged = merge_results([p for p in a.merge.split(",") if p])
        except ValueError as exc:
            raise UsageError(f"--merge: {exc}") from exc
        return _result(merged)
    mode = Mode(a.mode) if a.mode else (Mode.GREEDY if a.temperature == 0 else Mode.MATCH)
    if mode.stochastic and a.temperature <= 0:
        raise UsageError(f"--mode {mode.value} needs --temperature > 0")
    modes = [m for m in a.modes.split(",") if m]
    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown or not modes:
        raise UsageError(f"--modes: unknown {unknown or 'none given'}; choose from {','.join(ALL_MODES)}")
    tree_text = a.tree or recommended_tree(a.draft)
    split = CoreSplit.auto()
    print(split.describe(), flush=True)
    prompts = suite_from_args(a.humaneval, a.prompts, a.prompt_file)
    tree = ExpansionConfig.parse(tree_text)
    verifier = None
    api_key = None
    if a.url is None:
        extra: list[str] = []
        if mode.stochastic or any(m in STOCHASTIC_MODES for m in modes):
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
    drafter_name = drafter.name
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
        "prompt_files": [str(f) for f in a.prompt_file or []],
        "tokens": a.tokens,
        "temperature": a.temperature,
        "mode": mode.value,
        "draft": a.draft,
        "drafter": drafter_name,  # the backend that drafted (auto resolved)
        "model": a.model,
        "tree": tree_text,
        "seed": a.seed,
        "modes": ",".join(modes),
        "cores": {"edge": list(split.edge), "verifier": list(split.verifier)},
    }
    return _result(result)


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


def _result(result: dict[str, Any]) -> Result:
    """The report as the runner's Result: a row per mode, the config and the other keys beside."""
    cfg = result["config"]
    merged = f", merged from {len(cfg['merged_from'])} files" if cfg.get("merged_from") else ""
    text = render_report(
        result,
        f"{cfg.get('model')} verifier, draft {cfg.get('draft')} ({cfg.get('drafter')}), {cfg.get('mode')} "
        f"T={cfg.get('temperature')}, tree {cfg.get('tree')}, {cfg.get('humaneval')} HumanEval + "
        f"{cfg.get('prompts')} Spec-Bench prompts x {cfg.get('tokens')} tokens{merged} (medians)",
    )
    rows = [{"mode": m, **s} for m, s in result["modes"].items()]
    return Result(rows, text, config=cfg, extra={k: v for k, v in result.items() if k != "config"})


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
