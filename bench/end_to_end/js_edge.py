"""The TypeScript edge (in Node, and in a Chromium tab) against the Python edge, with the same ONNX
export, on the same verifier: tau, ms/token and drafting ms a round, at each RTT.

Every edge drafts with the same export (`edge-client export-onnx`, here made on first use) and the
same static tree, greedy, one prompt at a time against one `cloud-verifier serve` (edge and
verifier on disjoint cores), directly (RTT 0) or through the TCP delay proxy (bench.tools.netproxy) at
each `--rtt-ms`. Per edge and RTT: tau, ms/token, the median ms of drafting a round's tree on the
critical path, and whether the output equals the Python edge's (all must be the target's greedy
output). Node, npm and a built clients/typescript are needed (`npm ci && npm run build` there);
the `chromium` edge also needs Debian's chromium and the browser bundle (`make web`): the page of
`edge-client serve --web-draft` (onnxruntime-web, WASM, one thread) in headless Chromium pinned
to the edge's core, each prompt one visit with the model read from the browser's cache; its rows
add the page's load time and the time to the first token from the page's navigation: with the page's
default (`first_token_s`: it connects and starts with the target's own tokens while the draft model
loads, measured in a second, short visit per prompt whose tokens must begin the first visit's) and
waiting for the model (`first_token_loaded_s`, the visit whose tau and ms/token the row reports, so
that its trees are the other edges').

    python -m bench js_edge --prompts 4 --humaneval 4 --tokens 64 --rtt-ms 0,50 --edges ts,py,chromium
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from tqdm import tqdm

from bench.harness import (
    REPO,
    CoreSplit,
    Verifier,
    add_common_args,
    nonnegative_ints,
    served,
    table,
    write_result,
)
from bench.lib import runner
from bench.lib.args import add_model_args
from bench.lib.procs import Proxy
from bench.lib.runner import Result, UsageError

TS = REPO / "clients" / "typescript"
FIRST_TOKEN_VISIT = 8  # tokens of the visit that times the page's default start (before the model loads)
EDGES = {
    "ts": "typescript (onnxruntime-node)",
    "ts_prespec": "typescript (onnxruntime-node), pre-speculating",
    "py": "python (onnxruntime)",
    "py_prespec": "python (onnxruntime), pre-speculating",
    "chromium": "typescript (chromium, onnxruntime-web wasm)",
    "chromium_prespec": "typescript (chromium, onnxruntime-web wasm), pre-speculating",
}


def run_edge(edge: str, url: str, export: Path, prompt: str, raw: bool, tokens: int, tree: str,
             pin: Callable[[], None]) -> dict[str, Any]:  # fmt: skip
    """One generation by the `ts` or `py` edge's CLI (`*_prespec`: with --prespec); its tokens and figures."""
    base, prespec = edge.removesuffix("_prespec"), edge.endswith("_prespec")
    if base == "ts":
        cmd = ["node", str(TS / "dist" / "src" / "cli.js"), "generate", "--server", url]
        cmd += ["--draft", str(export), "--tree", tree, "--max-new-tokens", str(tokens), "--json"]
    else:
        cmd = [sys.executable, "-m", "edge_client", "generate", "--server", url, "--drafter", "onnx"]
        cmd += [
            "--draft",
            str(export),
            "--tree",
            tree,
            "--max-tokens",
            str(tokens),
            "--threads",
            "1",
            "--json",
        ]
    if prespec:
        cmd.append("--prespec")
    cmd += ["--raw", prompt] if raw else [prompt]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, preexec_fn=pin, cwd=REPO)
    if r.returncode != 0:
        raise RuntimeError(f"{edge} edge failed ({r.returncode}): {r.stderr[-2000:]}")
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    st = doc["stats"]
    if base == "ts":
        return {
            "tokens": doc["tokens"],
            "tau": st["tau"],
            "ms_per_token": st["msPerToken"],
            "draft_ms": st["draftMs"],
            "hit_rate": st["hitRate"] if prespec else None,
        }
    return {
        "tokens": doc["tokens"],
        "tau": st["tau"],
        "ms_per_token": st["ms_per_token"],
        "draft_ms": st["draft_ms"],
        "hit_rate": st.get("hit_rate") if prespec else None,
    }


class ChromiumEdge:
    """The browser edge's page (edge-client serve --web-draft) in a headless Chromium on the edge's
    core; a warm-up visit puts the model in the browser's cache, so measured visits read it there."""

    def __init__(self, export: Path, verifier_url: str, pin: Callable[[], None]) -> None:
        self.export, self.verifier_url, self.pin = export, verifier_url, pin
        self.visits = 0

    def __enter__(self) -> ChromiumEdge:
        from bench.end_to_end.browser import Browser
        from edge_client.serve import create_app
        from edge_client.web_edge import WebEdge

        self._stack = contextlib.ExitStack()
        app = create_app(_no_api, web=WebEdge(self.export, self.verifier_url))
        port = self._stack.enter_context(served(app))
        self.page = f"http://127.0.0.1:{port}/edge/"
        self.browser = self._stack.enter_context(Browser(pin=self.pin))
        self.run(self.verifier_url, "Hello", True, 4, "1")  # the model into the browser's cache
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def screenshot(self, path: Path) -> None:
        """The page as the last visit left it (a PNG)."""
        self.browser.screenshot(path)

    def run(
        self, url: str, prompt: str, raw: bool, tokens: int, tree: str, prespec: bool = False,
        background: bool = False,
    ) -> dict[str, Any]:  # fmt: skip
        """One visit: the prompt generated in the tab (pre-speculating or not; drafting from the first
        round, or starting while the model loads); its tokens and figures."""
        self.visits += 1
        q = urlencode({"server": url, "prompt": prompt, "raw": "1" if raw else "0", "max": tokens,
                       "tree": tree, "mode": "greedy", "autorun": "1", "prespec": int(prespec),
                       "background": int(background), "visit": self.visits})  # fmt: skip
        target = f"{self.page}?{q}"
        b = self.browser
        b.open(target)
        b.wait_for(f"location.href === {json.dumps(target)} && window.treespec && window.treespec.done", 900)
        st = json.loads(b.eval("JSON.stringify(window.treespec)"))
        if st["error"]:
            raise RuntimeError(f"the browser edge failed: {st['error']}")
        return {
            "tokens": st["tokens"],
            "tau": st["stats"]["tau"],
            "ms_per_token": st["stats"]["msPerToken"],
            "draft_ms": st["stats"]["draftMs"],
            "hit_rate": st["stats"]["hitRate"] if prespec else None,
            "first_token_s": st["firstTokenPageMs"] / 1e3,
            "load_s": st["loadMs"] / 1e3,
            "cloud_rounds": st["stats"]["cloudRounds"],
        }

    def visits_of(
        self, url: str, prompt: str, raw: bool, tokens: int, tree: str, prespec: bool
    ) -> dict[str, Any]:
        """The timed visit (drafting from the first round), then a short one with the page's default
        (starting while the model loads): its first token's time, and its tokens checked against the
        first visit's."""
        main = self.run(url, prompt, raw, tokens, tree, prespec)
        quick = self.run(url, prompt, raw, min(tokens, FIRST_TOKEN_VISIT), tree, prespec, background=True)
        if quick["tokens"] != main["tokens"][: len(quick["tokens"])]:
            raise RuntimeError(f"starting before the model loaded gave other tokens: {quick['tokens']}")
        main["first_token_loaded_s"] = main["first_token_s"]
        main["first_token_s"] = quick["first_token_s"]
        main["cloud_rounds"] = quick["cloud_rounds"]
        return main


def _no_api() -> Any:
    raise RuntimeError("bench.end_to_end.js_edge uses the page only")


def _row(edge: str, rtt: int, runs: list[dict[str, Any]], same: list[bool]) -> dict[str, Any]:
    row = {
        "edge": EDGES[edge],
        "rtt_ms": rtt,
        "tau": round(statistics.mean(r["tau"] for r in runs), 3),
        "ms_per_token": round(statistics.median(r["ms_per_token"] for r in runs), 2),
        "draft_ms_per_round": round(statistics.median(r["draft_ms"] for r in runs), 2),
        "identical_outputs": f"{sum(same)}/{len(same)}",
    }
    hits = [r["hit_rate"] for r in runs if r.get("hit_rate") is not None]
    row["hit_rate"] = round(statistics.mean(hits), 3) if hits else None
    if edge.startswith("chromium"):
        for k in ("first_token_s", "first_token_loaded_s"):
            row[k] = round(statistics.median(r[k] for r in runs), 3)
        row["cloud_rounds_first_visit"] = round(statistics.mean(r["cloud_rounds"] for r in runs), 2)
        row["load_s"] = round(statistics.median(r["load_s"] for r in runs), 3)
    return row


def add_args(ap: argparse.ArgumentParser) -> None:
    add_model_args(
        ap,
        model="smollm2-135m",
        model_help="the verifier's target",
        draft="smollm2-135m-q4",
        draft_help="the draft exported to ONNX (alias or GGUF)",
    )
    ap.add_argument("--int8", action="store_true", help="the int8 export (8-bit blocks) instead of fp32")
    ap.add_argument("--humaneval", type=int, default=4, help="HumanEval dev prompts (raw)")
    ap.add_argument("--prompts", type=int, default=4, help="Spec-Bench dev prompts (chat)")
    ap.add_argument(
        "--rtt-ms", type=nonnegative_ints, default=[0, 50], help="round trips (0: direct; else via the proxy)"
    )
    ap.add_argument("--tree", default="1,1,3,1,1,1,1,1", help="the static expansion tree every edge drafts")
    ap.add_argument(
        "--edges",
        default="ts,py",
        help="comma-separated edges: ts (Node), py (Python), chromium (the browser page in headless "
        "Chromium; needs chromium and `make web`), each also as NAME_prespec (pre-speculating); the "
        "outputs are compared with py's where it runs",
    )
    ap.add_argument(
        "--screenshot",
        default=None,
        metavar="PNG",
        help="with a chromium edge: the page after the last visit",
    )
    add_common_args(ap, json=True, json_help="rows: one per edge and RTT", tokens=64,
                    tokens_help="new tokens per prompt", prompt_file=True, no_progress=True)  # fmt: skip


def _check(edges: list[str]) -> None:
    """The edges named and what they need (else a UsageError)."""
    from bench.end_to_end.browser import chromium
    from edge_client.web_edge import BUNDLE, BUNDLE_FILES

    bad = [e for e in edges if e not in EDGES]
    if bad or not edges:
        raise UsageError(f"--edges: {','.join(bad) or 'none'}: choose from {','.join(EDGES)}")
    if shutil.which("node") is None or not (TS / "dist" / "src" / "cli.js").exists():
        raise UsageError(
            "needs Node 20 and the built TypeScript client: cd clients/typescript && npm ci && npm run build"
        )
    browser = any(e.startswith("chromium") for e in edges)
    if browser and chromium() is None:
        raise UsageError("--edges chromium needs Debian's chromium (apt-get install chromium)")
    if browser and not all((BUNDLE / f).is_file() for f in BUNDLE_FILES):
        raise UsageError("--edges chromium needs the browser bundle: make web")


def _measure(
    edges: list[str], prompts: Sequence[Any], url: str, export: Path, a: argparse.Namespace,
    page: ChromiumEdge | None, pin: Callable[[], None], bar: tqdm[Any],
) -> dict[str, list[dict[str, Any]]]:  # fmt: skip
    """Every prompt through every edge at one verifier URL (direct or through the proxy)."""
    per: dict[str, list[dict[str, Any]]] = {e: [] for e in edges}
    for p in prompts:
        for edge in edges:
            if edge.startswith("chromium"):
                assert page is not None
                prespec = edge.endswith("_prespec")
                per[edge].append(page.visits_of(url, p.text, p.raw, a.tokens, a.tree, prespec))
            else:
                per[edge].append(run_edge(edge, url, export, p.text, p.raw, a.tokens, a.tree, pin))
            bar.update()
    return per


def run(a: argparse.Namespace) -> Result:
    from bench.lib.args import suite_from_args
    from edge_client.onnx.export import ensure_export

    edges = [e.strip() for e in a.edges.split(",") if e.strip()]
    _check(edges)
    export = ensure_export(a.draft, int8=a.int8, progress=not a.no_progress)
    prompts = suite_from_args(a.humaneval, a.prompts, a.prompt_file)
    split = CoreSplit.auto()
    print(split.describe(), file=sys.stderr)
    rows: list[dict[str, Any]] = []
    browser = any(e.startswith("chromium") for e in edges)
    origins = ("--allowed-origins", "*") if browser else ()
    with (
        Verifier(a.model, cores=split.verifier, echo=not a.no_progress, args=origins).start() as ver,
        contextlib.ExitStack() as outer,
    ):
        page = None
        if browser:
            page = outer.enter_context(ChromiumEdge(export, ver.url, split.pin_edge))
        bar = tqdm(total=len(a.rtt_ms) * len(prompts) * len(edges), desc="js_edge", file=sys.stderr,
                   disable=a.no_progress)  # fmt: skip
        for rtt in a.rtt_ms:
            with contextlib.ExitStack() as stack:
                url = ver.url
                if rtt:
                    url = stack.enter_context(Proxy(ver.port, rtt, 0.0, 0.0, split.edge)).url
                per = _measure(edges, prompts, url, export, a, page, split.pin_edge, bar)
            ref = per.get("py", per[edges[0]])
            for edge, runs in per.items():
                same = [r["tokens"] == q["tokens"] for r, q in zip(runs, ref, strict=True)]
                rows.append(_row(edge, rtt, runs, same))
            write_result(a.json, a, rows, False, export=str(export))
        bar.close()
        if page is not None and a.screenshot:
            page.screenshot(Path(a.screenshot))
    heads = [
        "edge",
        "rtt ms",
        "tau",
        "ms/token",
        "draft ms/round",
        "hit rate",
        "same output",
        "first token s",
        "after load s",
    ]
    keys = ["edge", "rtt_ms", "tau", "ms_per_token", "draft_ms_per_round", "hit_rate", "identical_outputs"]
    keys += ["first_token_s", "first_token_loaded_s"]
    return Result(
        rows, table([[r.get(k, "-") for k in keys] for r in rows], heads), extra={"export": str(export)}
    )


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    sys.exit(main())
