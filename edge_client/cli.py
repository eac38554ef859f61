"""`edge-client`: the edge SDK's command line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def _generate_parser(sub: argparse._SubParsersAction) -> None:
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
        "--draft",
        default="smollm2-135m-q4",
        help="draft model: alias smollm2-135m-q4 or smollm2-135m-q4-l8, or a path to a GGUF file",
    )
    p.add_argument(
        "--drafter",
        default="llama_cpp",
        choices=["llama_cpp", "torch"],
        help="draft backend: llama.cpp (GGUF) or the torch reference",
    )
    shape = p.add_mutually_exclusive_group()
    shape.add_argument(
        "--tree",
        default=None,
        metavar="K1,K2,...",
        help="static expansion tree <k1..km> (default 1,1,3,1,1,1,1,1)",
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
        choices=["greedy", "match", "mss", "rrs", "ar"],
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
        "--json",
        action="store_true",
        help="print exactly one JSON object (text, prompt_tokens, tokens, stats) instead of streaming",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edge-client",
        description="Edge client of the tree-speculative inference system.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        print("edge-client generate: not yet available (the edge client is being built)", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    sys.exit(main())
