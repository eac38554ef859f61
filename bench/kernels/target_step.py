"""The cloud target runtime's verify-forward cost curve and decode tokens/s, against transformers
on the same GGUF.

`python -m bench target_step` measures two figures (docs/architecture.md §6):

- forward_ms[prefix][N]: median milliseconds of one verify forward of N new rows (row 0, the last
  committed token, plus N - 1 tree nodes, logits for every row) after `prefix` committed tokens.
  N = 1 is a plain decode step. This is the cost curve the server advertises.
- decode_tok_s: target-only greedy decoding (prompt prefill included, a fixed number of new
  tokens, no early stop) of this runtime and of transformers `generate` on the same GGUF,
  interleaved repeat by repeat so both see the same machine load; medians.
"""

from __future__ import annotations

import os

# OpenMP threads that spin at barriers stall for whole scheduler slices when the cores are shared
# (measured here: a 2-thread decode step 40 ms -> 1.2 s under a co-tenant's load). Sleeping
# waiters avoid it; libgomp reads this once, when torch loads it, so it is set before any import
# of torch. An explicit OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
from tqdm import tqdm

from bench.harness import PROMPTS as HARNESS_PROMPTS
from bench.harness import add_common_args
from bench.lib import runner
from bench.lib.runner import Result
from shared.model import Target, greedy_generate, load_target, prefill, tree_round
from shared.model.llama import ATTENTION_MODES
from shared.model_store import DEFAULT_TARGET
from shared.tree import TokenTree

PROMPTS = HARNESS_PROMPTS
FALLBACK_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def bench_tree(nodes: int, base: int, vocab: int, seed: int = 0) -> TokenTree:
    """A drafted-looking tree (each node's parent among the 4 before it) of `nodes` nodes."""
    rng = np.random.default_rng(seed + nodes)
    parents = [-1] + [int(rng.integers(max(-1, i - 4), i)) for i in range(1, nodes)]
    return TokenTree.build(rng.integers(3, vocab, nodes), parents[:nodes], base=base)


def measure_forward(
    target: Target, prefixes: Sequence[int], rows: Sequence[int], repeats: int, bar: tqdm[NoReturn]
) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Median ms of a verify forward for every (prefix, N), the (prefix, N) pairs interleaved;
    and per prefix the median over repeats of N16 / N1 (empty unless both N are measured)."""
    model, vocab = target.model, target.config.vocab_size
    kv = target.new_kv_cache(-(-(max(prefixes) + max(rows)) // 16) * len(prefixes) + 8)
    rng = np.random.default_rng(0)
    for seq, prefix in enumerate(prefixes):
        kv.add(seq)
        prefill(model, kv, seq, rng.integers(3, vocab, prefix - 1).tolist())
    work = {
        (seq, n): tree_round(seq, bench_tree(n - 1, prefix, vocab), [int(rng.integers(3, vocab))])
        for seq, prefix in enumerate(prefixes)
        for n in rows
    }
    times: dict[tuple[int, int], list[float]] = {key: [] for key in work}
    for rep in range(repeats + 1):  # the first pass warms up (weight packing, allocator)
        for (seq, n), x in work.items():
            t0 = time.perf_counter()
            model.forward_packed([x], kv)
            if target.device.type == "cuda":
                torch.cuda.synchronize(target.device)
            elapsed = (time.perf_counter() - t0) * 1e3
            kv.discard(seq)
            if rep:
                times[(seq, n)].append(elapsed)
                bar.update()
    forward = {
        str(prefix): {str(n): round(statistics.median(times[(seq, n)]), 2) for n in rows}
        for seq, prefix in enumerate(prefixes)
    }
    # N16 / N1 per repeat (the two forwards ran back to back, so a machine that slows down or
    # speeds up between repeats cancels out), then the median over repeats
    paired = {
        str(prefix): round(
            statistics.median(a / b for a, b in zip(times[(seq, 16)], times[(seq, 1)], strict=True)), 3
        )
        for seq, prefix in enumerate(prefixes)
        if 1 in rows and 16 in rows
    }
    return forward, paired


def first_prompt(target: Target) -> list[int]:
    text = FALLBACK_PROMPT
    if PROMPTS.is_file():
        text = json.loads(PROMPTS.read_text(encoding="utf-8").splitlines()[0])["turns"][0]
    if target.tokenizer.chat_template:
        text = target.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return target.tokenizer.encode(text)


def load_reference(model: str) -> Any:
    """transformers' model for the same GGUF (None when the model is not a GGUF)."""
    from shared import model_store

    path = model_store.resolve(model, "target") if model in model_store.ALIASES else Path(model)
    if path.suffix != ".gguf" or not path.is_file():
        return None
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    ref.generation_config.eos_token_id = None  # fixed-length runs, like ours
    return ref


def measure_decode(
    target: Target, reference: Any, prompt: list[int], new_tokens: int, repeats: int, bar: tqdm[NoReturn]
) -> dict[str, float | None]:
    """Median tokens/s of greedy decoding, ours and transformers' interleaved repeat by repeat."""
    kv = target.new_kv_cache(-(-(len(prompt) + new_tokens) // 16) + 1)
    ours: list[float] = []
    theirs: list[float] = []
    ids = torch.tensor([prompt])
    for rep in range(repeats + 1):
        t0 = time.perf_counter()
        out = greedy_generate(target.model, kv, prompt, new_tokens, eos_ids=())
        t_ours = time.perf_counter() - t0
        assert len(out) == new_tokens
        if rep:
            ours.append(new_tokens / t_ours)
            bar.update()
        if reference is not None:
            t0 = time.perf_counter()
            with torch.no_grad():
                gen = reference.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    do_sample=False,
                    max_new_tokens=new_tokens,
                    pad_token_id=0,
                )
            t_ref = time.perf_counter() - t0
            assert gen.shape[1] - len(prompt) == new_tokens
            if rep:
                theirs.append(new_tokens / t_ref)
                bar.update()
    return {
        "ours": round(statistics.median(ours), 2),
        "transformers": round(statistics.median(theirs), 2) if theirs else None,
    }


def render_table(result: dict[str, Any]) -> str:
    """The figures as the printed tables: the forward ms by N and prefix, then decode tokens/s."""
    fwd = result["forward_ms"]
    prefixes = list(fwd)
    rows = list(fwd[prefixes[0]])
    lines = [f"\nverify forward, median ms ({result['model']}, {result['threads']} threads, "
             f"attention {result['attention']} ({result.get('attention_kernel', '?')}), "
             f"gemm {result['gemm']}, weights {result.get('weights', 'fp32')}, "
             f"peak RSS {result.get('max_rss_mb', '?')} MB)"]  # fmt: skip
    lines.append("  N rows " + "".join(f"{'prefix ' + p:>14}" for p in prefixes))
    for n in rows:
        lines.append(f"  {n:>6} " + "".join(f"{fwd[p][n]:>14.2f}" for p in prefixes))
    if "1" in rows and "16" in rows:
        lines.append("  16 / 1 " + "".join(f"{fwd[p]['16'] / fwd[p]['1']:>14.2f}" for p in prefixes))
        paired = result.get("ratio_16_1_paired") or {}
        if paired:
            lines.append("  paired " + "".join(f"{paired[p]:>14.2f}" for p in prefixes))
            lines.append("  (paired: median over repeats of N16 / N1 measured back to back)")
    dec = result["decode_tok_s"]
    lines.append(
        f"\ndecode tokens/s ({result['decode_tokens']} new tokens, prompt {result['prompt_tokens']} tokens)"
    )
    lines.append(f"  ours          {dec['ours']:>8.2f}")
    if dec["transformers"] is not None:
        lines.append(f"  transformers  {dec['transformers']:>8.2f}")
        lines.append(f"  ratio         {result['ratio_vs_transformers']:>8.3f}")
    return "\n".join(lines)


def _max_rss_mb() -> float:
    """This process's peak resident memory so far (MB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build_parser() -> argparse.ArgumentParser:
    return runner.build_parser(__name__)


def add_args(p: argparse.ArgumentParser) -> None:
    p.epilog = (
        "OpenMP waiters sleep (OMP_WAIT_POLICY=PASSIVE) unless the environment says otherwise: "
        "on shared cores spinning waiters stall for whole scheduler slices; on a quiet dedicated "
        "machine OMP_WAIT_POLICY=ACTIVE is ~20% faster at 2 threads."
    )
    p.add_argument("--model", default=DEFAULT_TARGET, help="target alias or path (.gguf / safetensors dir)")
    add_common_args(
        p, json=True, json_help="rows: one per prefix and N (the forward ms), decode_tok_s", no_progress=True
    )
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per figure (medians are reported)")
    p.add_argument("--prefixes", default="128,1024", help="committed prefix lengths, comma-separated")
    p.add_argument("--rows", default="1,4,8,16,32,64", help="N: rows per forward (row 0 + N-1 nodes)")
    p.add_argument("--decode-tokens", type=int, default=64, help="new tokens per decode run")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers reference")
    p.add_argument(
        "--attention",
        default="model",
        choices=list(ATTENTION_MODES),
        help="'model': the weights' dtype, on a CPU in float32 through the batch-invariant kernel; "
        "'sdpa': the weights' dtype through scaled_dot_product_attention; 'float64': SDPA in float64",
    )
    p.add_argument("--gemm", default="auto", choices=["auto", "onednn", "torch"], help="projection kernels")
    p.add_argument(
        "--weights",
        default="fp32",
        choices=["fp32", "quantized"],
        help="'fp32': the GGUF dequantized (the --gemm kernels); 'quantized': its blocks multiplied by "
        "treespec_kernels.quant_matmul (--gemm does not apply)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument(
        "--quick", action="store_true", help="smoke test: 2 repeats, prefix 128, N in 1,16, 8 decode tokens"
    )


def run(args: argparse.Namespace) -> Result:
    if args.quick:
        args.repeats, args.prefixes, args.rows, args.decode_tokens = 2, "128", "1,16", 8
    if args.threads:
        torch.set_num_threads(args.threads)
    prefixes = [int(x) for x in args.prefixes.split(",") if x]
    rows = [int(x) for x in args.rows.split(",") if x]
    target = load_target(args.model, weights=args.weights)
    if args.weights == "fp32":
        target.model.set_gemm(args.gemm)
        target.model.prepare(release=True)  # one copy of the weights, as the service holds them
    target.model.set_attention(args.attention)
    reference = None if args.no_transformers else load_reference(args.model)
    prompt = first_prompt(target)
    total = args.repeats * (len(prefixes) * len(rows) + (2 if reference is not None else 1))
    with tqdm(total=total, desc="measuring", unit="run", disable=args.no_progress) as bar:
        forward, paired = measure_forward(target, prefixes, rows, args.repeats, bar)
        decode = measure_decode(target, reference, prompt, args.decode_tokens, args.repeats, bar)
    from shared.model.llama import choose_gemm

    result: dict[str, Any] = {
        "forward_ms": forward,
        "ratio_16_1_paired": paired,
        "decode_tok_s": decode,
        "ratio_vs_transformers": (
            round(decode["ours"] / decode["transformers"], 3)
            if decode["ours"] and decode["transformers"]
            else None
        ),
        "model": target.model_id,
        "forward_rows": "N = rows of one forward: row 0 + (N - 1) tree nodes, logits for all",
        "decode_tokens": args.decode_tokens,
        "prompt_tokens": len(prompt),
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "attention": target.model.attention_mode,
        "attention_kernel": target.model.attention_kernel,
        "gemm": choose_gemm(args.gemm, target.device, target.dtype)
        if args.weights == "fp32"
        else "quant_matmul",
        "weights": target.model.weights,
        "max_rss_mb": round(_max_rss_mb(), 1),
        "device": str(target.device),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }
    points = [
        {"prefix": int(p), "rows": int(n), "ms": ms} for p, by_n in forward.items() for n, ms in by_n.items()
    ]
    return Result(points, render_table(result), extra=result)


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    sys.exit(main())
