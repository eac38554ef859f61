"""Every runnable benchmark by name: its module, its kind and a one-line summary.

`python -m bench` prints this table and `python -m bench NAME [args]` runs the module's `main`.
The table is plain data: listing it imports no benchmark (most import torch). A new benchmark is a
module in its kind's folder (FOLDER) with `add_args(parser)` and `run(args) -> Result`, whose `main`
is bench.lib.runner's, and a row here; `tests/bench/test_registry.py` checks every row's module
exists and answers `--help`.
"""

from __future__ import annotations

from typing import NamedTuple


class Entry(NamedTuple):
    """One runnable module of bench/: `python -m bench NAME` runs `bench.<module>.main`."""

    name: str
    module: str
    kind: str
    summary: str


# the kinds, in the order the listing prints them
KINDS = (
    "end-to-end and network",
    "serving and load",
    "kernels and forwards",
    "simulation",
    "training",
    "robustness",
    "exactness proofs",
    "developer tools",
)
E2E, SERVING, KERNELS, SIMULATION, TRAINING, ROBUSTNESS, EXACTNESS, TOOLS = KINDS

# each kind's folder under bench/
FOLDER = {
    E2E: "end_to_end",
    SERVING: "serving",
    KERNELS: "kernels",
    SIMULATION: "simulation",
    TRAINING: "training",
    ROBUSTNESS: "robustness",
    EXACTNESS: "exactness",
    TOOLS: "tools",
}

_ROWS: tuple[tuple[str, str, str], ...] = (
    ("e2e", E2E, "ms/token, tau and forwards of ar, sequence, tree and budget, checked against ar"),
    ("network", E2E, "every mode at emulated round trips, with and without pre-speculation"),
    ("peers", E2E, "ours against llama.cpp and HF transformers, plain and speculative, on one pair"),
    ("merged", E2E, "one drafter against several merged, at equal total tree size"),
    ("draft_parallel", E2E, "one merged round drafted in turn against in parallel"),
    ("prefill_share", E2E, "a long prefill beside a running generation: does chunking keep decoding going"),
    ("js_edge", E2E, "the TypeScript edge in Node and Chromium against the Python edge"),
    ("lookup_tau", E2E, "tokens per round of the TypeScript client's prompt-lookup drafter"),
    ("colocation", E2E, "what the edge's drafting costs a verifier on the same machine (as in the demo)"),
    ("load", SERVING, "N concurrent edge sessions against the verifier, batched vs unbatched"),
    ("load_cost", SERVING, "the cloud's busy ms per token, edge sessions against cloud-only ar"),
    ("serve", SERVING, "open-loop serving over the OpenAI API and the session WebSocket (vLLM's metrics)"),
    (
        "verifier_memory",
        SERVING,
        "the verifier's resident memory with a target loaded as the service loads it",
    ),
    ("cost_curve", SERVING, "the live verify cost curve converging from a poisoned start-up curve"),
    ("fleet", SERVING, "the fleet on Ray Serve: the proxy's cost a round, resumes landing, 1 vs 2 replicas"),
    ("fleet_autoscale", SERVING, "the fleet autoscaling up under a rising request rate and back down"),
    ("target_step", KERNELS, "the target's verify cost curve by rows and prefix, decode tokens/s"),
    ("quant_matmul", KERNELS, "the quantized-block projections against the float32 path, by rows"),
    (
        "roofline",
        KERNELS,
        "the quantized projections and whole forward against the bandwidth and compute roofs",
    ),
    (
        "prefill",
        KERNELS,
        "prompt tokens/s of the quantized target against llama.cpp's, same file and threads",
    ),
    (
        "tree_attention",
        KERNELS,
        "the Triton tree-attention kernel against SDPA and the torch reference (GPU)",
    ),
    (
        "gpu_forward",
        KERNELS,
        "ms per verify forward by rows and decode tokens/s of the 1.5B's shape on a GPU",
    ),
    ("gpu_check", KERNELS, "the whole prepared GPU check (scripts/gpu_check.sh)"),
    ("parallel", KERNELS, "ms per verify forward at tensor parallelism N against one process"),
    ("offload", KERNELS, "a target larger than memory: forwards and every mode at resident fractions"),
    ("drafter_cost", KERNELS, "the drafter's ms per evaluation by rows, with the verifier idle and busy"),
    ("onnx_drafter", KERNELS, "draft speed on one thread: onnx fp32 / int8 against llama.cpp Q4"),
    ("simulate", SIMULATION, "recorded rounds replayed under other costs, machines and policies"),
    (
        "outcomes",
        SIMULATION,
        "the ceiling of pre-speculation: how often the covered outcomes hold the actual one",
    ),
    ("train_step", TRAINING, "ms per draft-training step, float32 against bf16 autocast"),
    ("speculators", TRAINING, "trained drafts against their base: top-k coverage, McNemar's test"),
    ("chaos", ROBUSTNESS, "kill the verifier at random moments; check every output against a clean run"),
    ("soak", ROBUSTNESS, "many clients for minutes, some cancelling or dropping: KV and memory afterwards"),
    ("fuzz", ROBUSTNESS, "hostile frames against a live verifier: crashes and over-limit frames accepted"),
    ("verify_exactness", EXACTNESS, "chi-square proofs that every verification algorithm is exact"),
    ("agreement", EXACTNESS, "how often the target's token is among the draft's top-k, teacher-forced"),
    ("weights_agreement", EXACTNESS, "how often the quantized target's greedy output equals the fp32 one's"),
    ("round_files", TOOLS, "which of the project's files run during one round (a tracer)"),
    ("netproxy", TOOLS, "a TCP delay proxy: a real network hop between edge client and verifier"),
)

BENCHMARKS: dict[str, Entry] = {
    name: Entry(name, f"bench.{FOLDER[kind]}.{name}", kind, summary) for name, kind, summary in _ROWS
}

# product entry points: runnable the same way, listed apart from the benchmarks
ENTRY_POINTS: dict[str, Entry] = {
    "demo": Entry(
        "demo",
        "treespec_demo.demo",
        "entry point",
        "`make demo`: the verifier and the edge client on the real pair",
    ),
}

RUNNABLE: dict[str, Entry] = {**BENCHMARKS, **ENTRY_POINTS}


def listing() -> str:
    """The text `python -m bench` prints: the benchmarks by kind, then the entry points."""
    width = max(len(n) for n in RUNNABLE)
    lines = ["usage: python -m bench NAME [args]   (python -m bench NAME --help for its options)", ""]
    for kind in KINDS:
        lines.append(f"{kind}:")
        lines += [f"  {e.name:<{width}}  {e.summary}" for e in BENCHMARKS.values() if e.kind == kind]
    lines.append("")
    lines.append("not a benchmark:")
    lines += [f"  {e.name:<{width}}  {e.summary}" for e in ENTRY_POINTS.values()]
    return "\n".join(lines)


def lookup(name: str) -> Entry:
    """The entry NAME; a KeyError naming the choices when there is none."""
    try:
        return RUNNABLE[name]
    except KeyError:
        choices = ", ".join(sorted(RUNNABLE))
        raise KeyError(f"no benchmark named {name!r}; choose one of: {choices}") from None
