"""Peers side by side: HF transformers and llama.cpp, plain and with their own speculative decoding,
against ours, on the same prompts, token count, machine and model pair (greedy).

- HF transformers: `generate` alone and assisted generation (`assistant_model=` the draft), both
  models loaded from the same GGUFs in fp32, torch on every core of the process (2 here);
- llama.cpp: `llama-completion` (plain decoding) and `llama-speculative-simple` (its draft-model
  speculative decoding) with the same two GGUFs, built from the llama.cpp source vendored by the
  installed llama-cpp-python (bench.lib.llama_tools, cached outside the repository), 2 threads;
- ours: `ar`, `tree`, `tree_prespec` and `auto` (the default mode) at RTT 0, the edge on one core
  and the verifier on the other
  (`--weights quantized`: the verifier runs the target GGUF's own blocks, as llama.cpp does).

Per system and mode: ms/token (median over prompts of wall time / new tokens, prompt prefill
included), the speed-up over that system's own plain decoding, new tokens per target forward, and
whether the tokens (llama.cpp: the text) equal that system's plain decoding.

    python -m bench peers --prompts 8 --tokens 64 --json bench/out/peers.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.end_to_end.peers_report import PLAIN, Runs, rows_of
from bench.harness import (
    BenchPrompt,
    CoreSplit,
    Verifier,
    add_common_args,
    table,
)
from bench.lib import runner
from bench.lib.runner import Result, UsageError
from shared.model_store import DEFAULT_DRAFT, DEFAULT_TARGET, resolve


def chat_text(prompt: BenchPrompt, template_tokenizer: Any) -> str:
    """The text a model sees: the code prompt raw, a Spec-Bench turn in the chat template."""
    if prompt.raw:
        return prompt.text
    return str(template_tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}]))


# ---------------------------------------------------------------------------- ours


def run_ours(
    prompts: Sequence[BenchPrompt], tokens: int, model: str, draft: str, tree: str, weights: str = "fp32"
) -> list[Runs]:
    from bench.end_to_end.e2e import run_modes
    from edge_client.drafters.registry import create_drafter
    from shared.messages import Mode
    from shared.tree import ExpansionConfig

    split = CoreSplit.auto()
    print(f"[ours] {split.describe()}", flush=True)
    out: list[Runs] = []
    args = ("--weights", weights)
    with Verifier(model, cores=split.verifier, threads=len(split.verifier), args=args) as verifier:
        mask = os.sched_getaffinity(0)
        split.pin_edge()
        drafter = create_drafter("llama_cpp", draft, n_threads=1)
        try:
            runs, _ = asyncio.run(
                run_modes(
                    verifier.url,
                    drafter,
                    prompts,
                    tokens,
                    0.0,
                    Mode.GREEDY,
                    ExpansionConfig.parse(tree),
                    verifier.forwards,
                    modes=("ar", "tree", "tree_prespec", "auto"),
                )
            )
        finally:
            drafter.close()
            os.sched_setaffinity(0, mask)
    for mode, r in runs.items():
        row = Runs("treespec", mode)
        for rec in r.records:
            n = len(rec["tokens"])
            row.add(rec["ms_per_token"] * n / 1e3, n, rec["forwards"], list(rec["tokens"]))
        out.append(row)
    return out


# ---------------------------------------------------------------------------- HF transformers


def run_hf(prompts: Sequence[BenchPrompt], tokens: int, model: str, draft: str, threads: int) -> list[Runs]:
    import torch
    import transformers

    from shared.model import gguf_loader

    torch.set_num_threads(threads)
    target_path = resolve(model, "target")
    draft_path = resolve(draft, "draft")

    def load(path: Path) -> Any:
        t0 = time.perf_counter()
        m = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        ).eval()
        print(f"[hf] loaded {path.name} in {time.perf_counter() - t0:.0f} s", flush=True)
        return m

    reader = gguf_loader.open_gguf(target_path)
    tok = gguf_loader.tokenizer_from_gguf(reader, target_path)
    del reader
    eos = list(tok.eos_ids)
    ids = [tok.encode(chat_text(p, tok), add_special=True) for p in prompts]
    target = load(target_path)
    assistant = load(draft_path)
    calls = [0]
    target.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    plain, assisted = Runs("hf-transformers", "generate"), Runs("hf-transformers", "assisted")
    with torch.inference_mode():
        target.generate(torch.tensor([ids[0][:8]]), max_new_tokens=2, do_sample=False)  # warm up
        for i, prompt_ids in enumerate(ids):
            for row, kw in ((plain, {}), (assisted, {"assistant_model": assistant})):
                x = torch.tensor([prompt_ids])
                calls[0] = 0
                t0 = time.perf_counter()
                out = target.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    do_sample=False,
                    max_new_tokens=tokens,
                    eos_token_id=eos,
                    pad_token_id=eos[0],
                    **kw,
                )
                wall = time.perf_counter() - t0
                new = out[0, len(prompt_ids) :].tolist()
                row.add(wall, len(new), calls[0], new)
                per = wall * 1e3 / max(len(new), 1)
                print(
                    f"[hf] prompt {i} {row.mode}: {len(new)} tokens, {per:.0f} ms/token, "
                    f"{calls[0]} target forwards"
                )
    del target, assistant
    return [plain, assisted]


# ---------------------------------------------------------------------------- llama.cpp

_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([0-9.]+) seconds")
_ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([0-9.]+) seconds")
_ACCEPT = re.compile(r"n_accept\s*=\s*(\d+)")
_PROMPT_EVAL = re.compile(r"prompt eval time =\s*([0-9.]+) ms /\s*(\d+) tokens")
_EVAL = re.compile(r"\beval time =\s*([0-9.]+) ms /\s*(\d+) runs")


def run_llama_cpp(
    prompts: Sequence[BenchPrompt], tokens: int, model: str, draft: str, threads: int
) -> list[Runs]:
    from bench.lib.llama_tools import ensure_tools
    from shared.model import gguf_loader

    tools = ensure_tools()
    target_path = resolve(model, "target")
    draft_path = resolve(draft, "draft")
    reader = gguf_loader.open_gguf(target_path)
    tok = gguf_loader.tokenizer_from_gguf(reader, target_path)
    del reader
    # the prompt as an argument, unescaped (`-f` drops a final newline, which changes the prompt)
    common = ["-t", str(threads), "--temp", "0", "-n", str(tokens), "-nr", "-c", "4096", "--no-escape"]
    plain = Runs("llama.cpp", "plain")
    # its own defaults (a draft of at most 3 tokens), and drafts as deep as our default tree
    specs = {"speculative": [], "speculative_draft8": ["--spec-draft-n-max", "8"]}
    spec_runs = {m: Runs("llama.cpp", m) for m in specs}
    with tempfile.TemporaryDirectory() as tmp:
        for i, p in enumerate(prompts):
            pf = Path(tmp) / f"p{i}.txt"
            pf.write_text(chat_text(p, tok), encoding="utf-8")
            # plain decoding
            text = pf.read_text(encoding="utf-8")
            cmd = [str(tools["llama-completion"]), "-m", str(target_path), "-p", text, "-no-cnv",
                   "--no-display-prompt", "--no-warmup", *common]  # fmt: skip
            res = _tool(cmd)
            pe, ev = _PROMPT_EVAL.search(res.stderr), _EVAL.search(res.stderr)
            if pe is None or ev is None:
                raise RuntimeError(f"llama-completion printed no timings:\n{res.stderr[-2000:]}")
            n_new = int(ev.group(2)) + 1  # the first token comes from the prompt evaluation
            wall = (float(pe.group(1)) + float(ev.group(1))) / 1e3
            plain.add(wall, n_new, 1 + int(ev.group(2)), _completion_text(res.stdout))
            # its own draft-model speculative decoding
            for mode, extra in specs.items():
                tool = str(tools["llama-speculative-simple"])
                cmd = [tool, "-m", str(target_path), "-md", str(draft_path), "--spec-type", "draft-simple",
                       "-p", text, "-td", str(threads), *extra, *common]  # fmt: skip
                res = _tool(cmd)
                enc, dec = _ENCODED.search(res.stderr), _DECODED.search(res.stderr)
                acc = _ACCEPT.search(res.stderr)
                if enc is None or dec is None or acc is None:
                    raise RuntimeError(f"llama-speculative-simple printed no timings:\n{res.stderr[-2000:]}")
                n_new, n_accept = int(dec.group(1)), int(acc.group(1))
                wall = float(enc.group(2)) + float(dec.group(2))
                spec_runs[mode].add(wall, n_new, 1 + max(n_new - n_accept, 1), _spec_text(res.stdout, text))
                print(
                    f"[llama.cpp] prompt {i} {mode}: {spec_runs[mode].ms_per_token[-1]:.0f} ms/token against "
                    f"plain {plain.ms_per_token[-1]:.0f} ({n_accept} of {n_new} tokens from the draft)",
                    flush=True,
                )
    return [plain, *spec_runs.values()]


def _tool(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=3600)
    if res.returncode != 0:
        raise RuntimeError(f"{Path(cmd[0]).name} failed ({res.returncode}):\n{res.stderr[-3000:]}")
    return res


_END_MARK = " [end of text]"


def _completion_text(stdout: str) -> str:
    """llama-completion's generated text, without the marker it prints after an end-of-generation
    token (not model output)."""
    return stdout.strip().removesuffix(_END_MARK.strip()).rstrip()


def _spec_text(stdout: str, prompt: str) -> str:
    """llama-speculative-simple prints the prompt, then the generated text: keep the latter."""
    text = stdout.strip()
    head = prompt.strip()
    return text[len(head) :].strip() if text.startswith(head) else text


SYSTEMS = ("ours", "hf", "llama.cpp")


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--prompts",
        type=int,
        default=4,
        help="prompts: the first half HumanEval dev, the rest Spec-Bench dev",
    )
    ap.add_argument("--model", default=DEFAULT_TARGET, help="target alias or GGUF path")
    ap.add_argument("--draft", default=DEFAULT_DRAFT, help="draft alias or GGUF path")
    ap.add_argument(
        "--tree", default=None, help="our expansion config (default: the draft's recommended tree)"
    )
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="which to run, from ours,hf,llama.cpp")
    ap.add_argument("--threads", type=int, default=2, help="threads of HF transformers and llama.cpp")
    ap.add_argument(
        "--weights",
        choices=("auto", "fp32", "quantized"),
        default="auto",
        help="how our verifier runs the target GGUF (cloud-verifier serve --weights): dequantized to fp32 "
        "or from its own quantized blocks, the weights llama.cpp runs; auto (the verifier's default: "
        "quantized on a CPU) is resolved here, and the results name what ran",
    )
    add_common_args(
        ap,
        json=True,
        json_help="rows: one per system and mode",
        tokens=64,
        tokens_help="new tokens per prompt at most",
        prompt_file=True,
    )


def run(a: argparse.Namespace) -> Result:
    from bench.lib.args import suite_from_args
    from edge_client.defaults import recommended_tree

    systems = [s for s in a.systems.split(",") if s]
    if not systems or any(s not in SYSTEMS for s in systems):
        raise UsageError(f"--systems: choose from {','.join(SYSTEMS)}")
    tree = a.tree or recommended_tree(a.draft)
    prompts = suite_from_args(a.prompts // 2, a.prompts - a.prompts // 2, a.prompt_file)
    print(
        f"{len(prompts)} prompts x {a.tokens} tokens, greedy; target {a.model}, draft {a.draft}", flush=True
    )
    if a.weights == "auto":
        from shared.model.target import resolve_weights

        a.weights = resolve_weights(a.model)
    runs: list[Runs] = []
    t0 = time.perf_counter()
    if "ours" in systems:
        runs += run_ours(prompts, a.tokens, a.model, a.draft, tree, a.weights)
    if "llama.cpp" in systems:
        runs += run_llama_cpp(prompts, a.tokens, a.model, a.draft, a.threads)
    if "hf" in systems:
        runs += run_hf(prompts, a.tokens, a.model, a.draft, a.threads)
    rows = rows_of(runs, PLAIN)
    lines = [
        "",
        table(
            [
                [
                    r["system"],
                    r["mode"],
                    r["ms_per_token"],
                    r["speedup_vs_own_ar"] or "-",
                    r["tokens_per_target_forward"] or "-",
                    f"{r['identical']} ({r['identical_prompts']}/{len(r['outputs'])})",
                ]
                for r in rows
            ],
            [
                "system",
                "mode",
                "ms/token",
                "speed-up vs own plain",
                "tokens/target fwd",
                "identical to own plain",
            ],
        ),
        *_goal(rows),
        f"wall time {time.perf_counter() - t0:.0f} s",
    ]
    config = {
        "prompts": a.prompts,
        "prompt_files": [str(f) for f in a.prompt_file or []],
        "tokens": a.tokens,
        "model": a.model,
        "draft": a.draft,
        "tree": tree,
        "threads": a.threads,
        "weights": a.weights,
        "systems": systems,
    }
    return Result(rows, "\n".join(lines), config=config)


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


def _goal(rows: list[dict[str, Any]]) -> list[str]:
    """Our tree_prespec speed-up against each peer's speculative decoding (the goal's lines)."""

    def speed(system: str, mode: str) -> float | None:
        return next(
            (r["speedup_vs_own_ar"] for r in rows if r["system"] == system and r["mode"] == mode), None
        )

    ours = speed("treespec", "tree_prespec")
    lines = []
    for system, mode in (
        ("hf-transformers", "assisted"),
        ("llama.cpp", "speculative"),
        ("llama.cpp", "speculative_draft8"),
    ):
        theirs = speed(system, mode)
        if ours is not None and theirs is not None:
            ok = "met" if ours >= theirs else "not met"
            lines.append(f"goal: our tree_prespec speed-up {ours:.2f} >= {system} {mode} {theirs:.2f}: {ok}")
    return lines


if __name__ == "__main__":
    sys.exit(main())
