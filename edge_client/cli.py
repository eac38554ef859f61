"""`edge-client`: the edge SDK's command line (its flags: edge_client.cli_parser).

Whatever goes wrong for a reason the user can act on is one line on stderr, never a traceback: a
usage error exits with 2, a failure with 1, an interrupt (Ctrl-C) with 130."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TextIO

from edge_client.cli_parser import ServeOptions, build_parser
from shared.model_store.catalog import DEFAULT_DRAFT

if TYPE_CHECKING:
    from edge_client.client import GenerationResult, TreeSpec
    from edge_client.drafters.base import Drafter
    from edge_client.speculation import PrespecConfig
    from edge_client.web_edge import WebEdge


def _export_onnx(args: argparse.Namespace) -> int:
    try:
        from edge_client.onnx.export import ExportError, describe, export
    except ImportError as exc:
        print(
            f"edge-client: export-onnx needs onnx and torch ({exc}): pip install 'treespec[onnx,cloud]'",
            file=sys.stderr,
        )
        return 1
    from edge_client.onnx.export import OutFolderError

    if args.int8_method != "blocks" and not args.int8:
        print("edge-client: export-onnx: --int8-method applies to int8 exports: add --int8", file=sys.stderr)
        return 2
    try:
        manifest = export(args.draft, args.out, int8=args.int8, int8_method=args.int8_method)
    except OutFolderError as exc:
        print(f"edge-client: export-onnx: --out: {exc}", file=sys.stderr)
        return 2
    except (ExportError, OSError, ValueError) as exc:
        print(f"edge-client: export-onnx: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(describe(manifest)))
    return 0


def _web_edge(opts: ServeOptions) -> WebEdge | None:
    """The browser edge for --web-draft (edge_client.web_edge.WebEdge), None without it; exits with 2
    and the reason when it cannot be served."""
    if opts.web_draft is None:
        return None
    from edge_client.web_edge import BUNDLE, WebEdge, WebEdgeError

    bundle = Path(opts.web_bundle) if opts.web_bundle else BUNDLE
    try:
        return WebEdge(Path(opts.web_draft), opts.server, bundle)
    except WebEdgeError as exc:
        print(f"edge-client: --web-draft: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from edge_client.client import EdgeClient, EdgeConfig, TreeSpec
    from edge_client.defaults import recommended_tree
    from edge_client.serve import ServeConfig, create_app
    from edge_client.speculation import PrespecConfig
    from shared.tree import ExpansionConfig

    opts = ServeOptions.from_args(args)
    try:
        spec = TreeSpec("static", ExpansionConfig.parse(opts.tree or recommended_tree(opts.draft)))
    except ValueError as exc:
        print(f"edge-client: --tree: {exc}", file=sys.stderr)
        return 2
    try:
        config = ServeConfig(
            host=opts.host, allow_origins=opts.allow_origins, mode=opts.mode, objective=opts.objective
        )
    except ValueError as exc:
        print(f"edge-client: --allow-origin: {exc}", file=sys.stderr)
        return 2
    try:
        prespec_cfg = PrespecConfig(saguaro_c=opts.saguaro_c)
    except ValueError as exc:
        print(f"edge-client: --saguaro-c: {exc}", file=sys.stderr)
        return 2
    if opts.saguaro_c != 1 and not opts.prespec:
        print("edge-client: --saguaro-c applies to pre-speculation: drop --no-prespec", file=sys.stderr)
        return 2
    web = _web_edge(opts)
    drafters = _load_drafters(args, [opts.draft])
    if drafters is None:
        return 2
    drafter = drafters[0]
    edge = EdgeConfig(
        api_key=opts.api_key, tree=spec, prespec=prespec_cfg if opts.prespec else False, ca_file=opts.ca_file
    )

    def make() -> EdgeClient:
        return EdgeClient(opts.server, drafter, edge)

    print(
        f"edge-client: OpenAI-compatible API on http://{opts.host}:{opts.port}/v1 -> {opts.server}",
        flush=True,
    )
    if web is not None:
        print(f"edge-client: the browser edge on http://{opts.host}:{opts.port}/edge/", flush=True)
    try:
        uvicorn.run(create_app(make, config, web), host=opts.host, port=opts.port, log_level="warning")
    finally:
        drafter.close()
    return 0


def _tree_spec(args: argparse.Namespace, draft: str) -> TreeSpec:
    from edge_client.client import TreeSpec
    from edge_client.defaults import recommended_tree
    from shared.tree import ExpansionConfig

    try:
        shape = ExpansionConfig.parse(args.tree or recommended_tree(draft))
        if args.sequence:
            return TreeSpec("sequence", shape)
        if args.budget is not None:
            return TreeSpec("budget", budget=args.budget)
        return TreeSpec("static", shape)
    except ValueError as exc:
        raise ValueError(f"--tree {args.tree or recommended_tree(draft)}: {exc}") from None


async def _generate(args: argparse.Namespace) -> int:
    from edge_client.client import GenerationError
    from edge_client.defaults import draft_specs
    from edge_client.record import RecordError

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
    if args.record is not None:
        from edge_client.record import check_folder

        try:
            check_folder(args.record)
        except RecordError as exc:
            print(f"edge-client: --record: {exc}", file=sys.stderr)
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
    except RecordError as exc:  # the generation ran; its record could not be written
        _error(f"--record: {exc}", echo.streamed)
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
            objective=args.objective,
            raw=args.raw,
        ):
            echo.write(chunk)
        gen = client.last
        assert gen is not None
        if args.record is not None and client.welcome is not None:
            from edge_client.record import write_record

            w = client.welcome
            # the record names the verification the tokens came from (auto: greedy or match)
            mode = client.auto_mode(args.temperature).value if args.mode == "auto" else args.mode
            write_record(args.record, gen, w.model_id, w.vocab_fingerprint, mode, args.temperature)
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
    try:
        return _main(argv)
    except KeyboardInterrupt:  # Ctrl-C: whatever was being written is cleaned up on the way out
        print("edge-client: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if not isinstance(exc, _user_errors()):
            raise
        _error(str(exc))
        return 1


def _user_errors() -> tuple[type[Exception], ...]:
    """Failures whose message says what to do: one line, not a traceback."""
    from edge_client.onnx.export import ExportError
    from edge_client.record import RecordError
    from shared.model_store.catalog import ModelStoreError

    return (ExportError, ModelStoreError, RecordError)


def _main(argv: Sequence[str] | None) -> int:
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


__all__ = ["build_parser", "main"]


if __name__ == "__main__":
    sys.exit(main())
