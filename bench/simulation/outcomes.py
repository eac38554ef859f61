"""The prediction ceiling of pre-speculation, without timing: how often is a round's actual outcome
(accepted length, bonus) among the N outcomes an allocation policy would pre-speculate for, N = 1..30
(--max-n), greedy and sampled, overall and by accepted length?

For each position of a generation the target drives (greedy, or sampled at T with the keyed
sampler and a fixed seed per prompt, as seeded `match` verification samples), the draft drafts the
main tree shape below the committed sequence (its leaves evaluated, so the all-accepted outcome's
bonus can be predicted), and the tree is verified against the target's own continuation: the
accepted path is the longest root path whose tokens are the target's next tokens and the bonus is
the target's token after it. That is exactly the verdict of greedy or seeded `match` verification
(the target's token at a position does not depend on the tree). The outcome model
(edge_client.speculation.outcomes, learning its acceptance online as the edge does, from each
verdict after its prediction) ranks the candidate outcomes (accepted path, bonus), and each
policy's list for a budget of N is checked for the actual one:

- probability: the N most likely (node, bonus) pairs under the calibrated outcome model
  (PrespecConfig.allocation "top");
- geometric: Saguaro's capped geometric fan-out across accepted lengths (allocation "geometric");
- uniform: the same number of bonus guesses F at every accepted length 0..K (Saguaro's top-F
  cache per position; N not divisible by K + 1: the extra guesses go to the likelier lengths).

Drafting at T > 0 is coupled (the edge's default in match: the draft's token at the keyed
uniform leads each node), and its outcome model is the coupled one, as EdgeClient uses
(--no-couple: neither). Coupled, the summary also has `after_mismatch`: at the positions where the
target's token is not the coupled one, the share whose token is among the first F candidates
after it, F = 1..8, by the landing model (the order coupled trees use, trees.sampling.Coupling.rank)
and by the draft's most likely tokens (the order before it), teacher-forced on the same positions.

    python -m bench outcomes --model smollm2-135m --draft smollm2-135m-q4 --prompts 4 --humaneval 2 \\
        --tokens 64 --json bench/out/outcomes.json --plot bench/out/outcomes.png
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bench.harness import BenchPrompt, add_common_args, save_figure, suite_from_args, table
from bench.lib import runner
from bench.lib.args import add_model_args
from bench.lib.runner import Result, UsageError
from edge_client.drafters.base import Drafter
from edge_client.drafters.registry import backend_choices
from edge_client.speculation.config import PrespecConfig
from edge_client.speculation.estimates import ChoiceModel, Learned
from edge_client.speculation.outcomes import Outcome, outcome_probabilities, predict_outcomes
from edge_client.trees import Coupling, DraftOptions, DraftResult, draft_static
from edge_client.trees.sampling import Landing, LandingRow, top_logp
from shared.messages import Mode
from shared.model_store import DEFAULT_DRAFT, DEFAULT_TARGET
from shared.tree import ExpansionConfig, TokenTree

if TYPE_CHECKING:  # torch loads in main, after the arguments are checked
    from shared.model import Target
    from shared.model.tokenizer import TargetTokenizer

POLICIES = ("probability", "geometric", "uniform")
MISMATCH_F = 8  # after_mismatch: candidates after the coupled token checked
NESTED = ("probability", "uniform")  # a budget of N + 1 adds one outcome to the list for N
SHOWN_N = (1, 2, 3, 4, 6, 8, 12, 16, 20, 27, 30)


# --------------------------------------------------------------------------- one position
def actual_outcome(tree: TokenTree, seq: Sequence[int], at: int) -> tuple[list[int], tuple[int, ...]] | None:
    """The verdict of `tree` drafted below seq[:at] when the target's tokens are seq[at:]: the
    accepted nodes (root to leaf) and the outcome's cond (their tokens, then the bonus); None when
    seq ends before the bonus."""
    node = -1
    path: list[int] = []
    while True:
        i = at + len(path)
        if i >= len(seq):
            return None
        nxt = [int(c) for c in tree.children_of(node) if int(tree.tokens[c]) == seq[i]]
        if not nxt:
            return path, tuple(int(t) for t in seq[at : i + 1])
        node = nxt[0]
        path.append(node)


def uniform_outcomes(dr: DraftResult, budget: int, model: ChoiceModel) -> list[Outcome]:
    """Top-F bonus guesses at every accepted length: guesses go round-robin over the accepted
    lengths, likelier lengths first in each round, each length's own candidates most likely
    first; the list for N + 1 is the list for N and one more (nested)."""
    if budget <= 0:
        return []
    nodes, toks, probs = outcome_probabilities(dr, model)
    if probs.size == 0:
        return []
    tree = dr.tree
    depth = np.asarray([0 if j < 0 else int(tree.depth[j]) for j in nodes], dtype=np.int64)
    order = np.argsort(-probs, kind="stable")
    per: dict[int, list[int]] = {}
    for i in order.tolist():
        per.setdefault(int(depth[i]), []).append(i)
    lengths = sorted(per, key=lambda k: -float(probs[depth == k].sum()))
    chosen: list[int] = []
    taken = dict.fromkeys(lengths, 0)
    while len(chosen) < budget and any(taken[k] < len(per[k]) for k in lengths):
        for k in lengths:
            if len(chosen) < budget and taken[k] < len(per[k]):
                chosen.append(per[k][taken[k]])
                taken[k] += 1
    out = []
    for i in chosen:
        j = nodes[i]
        path = tree.path_tokens(j) if j >= 0 else []
        out.append(Outcome(j, int(toks[i]), float(probs[i]), int(depth[i]), (*path, int(toks[i]))))
    return out


def policy_lists(
    dr: DraftResult, model: ChoiceModel, max_n: int, r: float = PrespecConfig().r
) -> dict[str, Callable[[int], list[Outcome]]]:
    """Each policy's outcome list for a budget of n."""
    return {
        "probability": lambda n: predict_outcomes(dr, n, r, "top", model),
        "geometric": lambda n: predict_outcomes(dr, n, r, "geometric", model),
        "uniform": lambda n: uniform_outcomes(dr, n, model),
    }


@dataclass(frozen=True)
class Position:
    """One position's verdict and, per policy, whether its outcome is in the list for N = 1..max_n."""

    temperature: float
    prompt: int
    at: int
    k: int  # tree tokens accepted
    hits: dict[str, tuple[bool, ...]]

    def as_dict(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "prompt": self.prompt,
            "at": self.at,
            "k": self.k,
            "hits": {p: "".join("1" if h else "0" for h in hs) for p, hs in self.hits.items()},
        }


def walk_positions(
    drafter: Drafter,
    prompt: Sequence[int],
    output: Sequence[int],
    positions: int,
    tree: ExpansionConfig,
    model: ChoiceModel,
    max_n: int,
    temperature: float = 0.0,
    seed: int = 0,
    prompt_index: int = 0,
    couple: bool = True,
    policies: Sequence[str] = POLICIES,
    on_position: Callable[[], object] | None = None,
) -> list[Position]:
    """Positions 0..positions-1 of `output` (the target's continuation of `prompt`): draft, verify
    against the target's tokens, check every policy's lists, then let the outcome model learn
    from the verdict (as the edge does after each verdict)."""
    seq = [*prompt, *output]
    if temperature > 0:
        coupling = Coupling(seed, temperature) if couple else None
        opts = DraftOptions(mode=Mode.MATCH, coupling=coupling, eval_leaves=True)
    else:
        opts = DraftOptions(mode=Mode.GREEDY, eval_leaves=True)
    out: list[Position] = []
    for i in range(min(positions, len(output))):
        at = len(prompt) + i
        dr = draft_static(drafter, seq[:at], tree, opts)
        verdict = actual_outcome(dr.tree, seq, at)
        if verdict is None:
            break
        accepted, cond = verdict
        lists = policy_lists(dr, model, max_n)
        hits: dict[str, tuple[bool, ...]] = {}
        for p in policies:
            if p in NESTED:  # the list for N is the first N of the longest
                ranked = [o.cond for o in lists[p](max_n)]
                rank = ranked.index(cond) if cond in ranked else max_n
                hits[p] = tuple(n > rank for n in range(1, max_n + 1))
            else:
                hits[p] = tuple(any(o.cond == cond for o in lists[p](n)) for n in range(1, max_n + 1))
        out.append(Position(temperature, prompt_index, i, len(accepted), hits))
        model.observe(dr, accepted, list(cond))
        if on_position is not None:
            on_position()
    return out


# --------------------------------------------------------------------------- after a mismatch
def mismatch_ranks(
    drafter: Drafter,
    prompt: Sequence[int],
    output: Sequence[int],
    coupling: Coupling,
    max_f: int,
    learn: Callable[[LandingRow, int], None] | None = None,
) -> list[tuple[int, int]]:
    """At every position of `output` (the target's keyed samples after `prompt`, teacher-forced)
    where the target's token is not the draft's coupled one: its rank among the candidates after
    the coupled token, (by the landing model, by the draft's most likely tokens), 0-based, max_f
    where it is not among the first max_f. The landing model learns from each mismatch after its
    ranking (`learn`, default coupling.landing.observe), as the edge learns from verdicts."""
    learn = learn or coupling.landing.observe
    first = drafter.sync(list(prompt))
    rows = [first]
    if len(output) > 1:
        rows.extend(drafter.extend([-1, *range(len(output) - 2)], list(output[:-1])))
    out: list[tuple[int, int]] = []
    for i, (logits, tok) in enumerate(zip(rows, output, strict=True)):
        r = coupling.rank(logits, max_f + 1, len(prompt) + i)
        c = int(r.ids[0])
        if tok == c:
            continue
        by_landing = [int(t) for t in r.ids[1:]]
        top, _ = top_logp(logits, max_f + 1)
        by_draft = [int(t) for t in top if int(t) != c][:max_f]
        rank = (
            by_landing.index(tok) if tok in by_landing else max_f,
            by_draft.index(tok) if tok in by_draft else max_f,
        )
        out.append(rank)
        learn(r.row, int(tok))
    return out


def top_f_rates(ranks: Sequence[tuple[int, int]], max_f: int) -> dict[str, list[float]]:
    """Share of mismatches whose target token is among the first F candidates, F = 1..max_f."""
    arr = np.asarray(ranks, dtype=np.int64).reshape(-1, 2)
    if arr.shape[0] == 0:
        return {"landing": [0.0] * max_f, "draft": [0.0] * max_f}
    return {
        name: [round(float((arr[:, col] < f).mean()), 4) for f in range(1, max_f + 1)]
        for col, name in enumerate(("landing", "draft"))
    }


# --------------------------------------------------------------------------- summaries
def hit_rates(positions: Sequence[Position], policy: str, max_n: int) -> list[float]:
    """Share of positions whose outcome is in the policy's list, for N = 1..max_n."""
    if not positions:
        return [0.0] * max_n
    arr = np.asarray([p.hits[policy] for p in positions], dtype=np.float64)
    return [float(x) for x in arr.mean(axis=0)]


def summarise(positions: Sequence[Position], policies: Sequence[str], max_n: int) -> dict[str, Any]:
    """Per temperature: positions, the share at each accepted length k, and per policy the hit
    rate against N overall and by k."""
    out: dict[str, Any] = {}
    for temp in sorted({p.temperature for p in positions}):
        at_t = [p for p in positions if p.temperature == temp]
        ks = sorted({p.k for p in at_t})
        out[f"{temp:g}"] = {
            "positions": len(at_t),
            "k_share": {str(k): round(sum(p.k == k for p in at_t) / len(at_t), 4) for k in ks},
            "policies": {
                pol: {
                    "hit_rate": [round(x, 4) for x in hit_rates(at_t, pol, max_n)],
                    "by_k": {
                        str(k): [round(x, 4) for x in hit_rates([p for p in at_t if p.k == k], pol, max_n)]
                        for k in ks
                    },
                }
                for pol in policies
            },
        }
    return out


def report(summary: dict[str, Any], max_n: int) -> str:
    shown = sorted({n for n in SHOWN_N if n <= max_n} | {max_n})
    lines = []
    for temp, s in summary.items():
        what = "greedy" if temp == "0" else f"match, T {temp}"
        lines.append(
            f"\n{what}: share of positions whose outcome is in the policy's N outcomes ({s['positions']})"
        )
        rows = [[pol, *(f"{v['hit_rate'][n - 1]:.3f}" for n in shown)] for pol, v in s["policies"].items()]
        lines.append(table(rows, ["policy", *(f"N={n}" for n in shown)]))
        first = next(iter(s["policies"]))
        lines.append(f"by accepted length k ({first}):")
        by_k = s["policies"][first]["by_k"]
        rows = [[k, s["k_share"][k], *(f"{by_k[k][n - 1]:.3f}" for n in shown)] for k in by_k]
        lines.append(table(rows, ["k", "share", *(f"N={n}" for n in shown)]))
    return "\n".join(lines)


def result_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON's rows: per temperature and policy, the hit rate against N = 1..max-n."""
    return [
        {"temperature": temp, "policy": pol, "positions": s["positions"], "hit_rate": v["hit_rate"]}
        for temp, s in summary.items()
        for pol, v in s["policies"].items()
    ]


def plot(summary: dict[str, Any], max_n: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = list(summary)
    fig, axes = plt.subplots(2, len(temps), figsize=(6 * len(temps), 8), squeeze=False)
    ns = list(range(1, max_n + 1))
    for col, temp in enumerate(temps):
        s = summary[temp]
        title = "greedy" if temp == "0" else f"match, T={temp}"
        ax = axes[0][col]
        for pol, v in s["policies"].items():
            ax.plot(ns, v["hit_rate"], marker=".", label=pol)
        ax.set_title(f"{title}: hit rate vs outcomes pre-speculated")
        ax.set_xlabel("N (outcomes per round)")
        ax.set_ylabel("share of positions whose outcome is covered")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend()
        ax = axes[1][col]
        first = next(iter(s["policies"]))
        for k, rates in s["policies"][first]["by_k"].items():
            ax.plot(ns, rates, label=f"k={k} ({s['k_share'][k]:.0%})")
        ax.set_title(f"{title}: by accepted length ({first})")
        ax.set_xlabel("N (outcomes per round)")
        ax.set_ylabel("hit rate")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path, dpi=120)


# --------------------------------------------------------------------------- the bench
def add_args(ap: argparse.ArgumentParser) -> None:
    add_model_args(
        ap,
        model=DEFAULT_TARGET,
        model_help="target alias or path (runs in this process)",
        draft=DEFAULT_DRAFT,
        draft_help="draft alias or GGUF path (one thread)",
    )
    ap.add_argument(
        "--drafter",
        default="auto",
        choices=backend_choices(),
        help="draft backend, as bench.network picks it (auto: llama.cpp or the ONNX int8 export, whichever "
        "is faster here; the backends' quantizations draft slightly different trees)",
    )
    ap.add_argument(
        "--prompts", type=int, default=4, help="Spec-Bench dev prompts (round-robin over categories)"
    )
    ap.add_argument("--humaneval", type=int, default=4, help="HumanEval dev prompts (the code prompt, raw)")
    add_common_args(
        ap,
        json=True,
        json_help="rows: hit rate against N per temperature and policy; summary; positions",
        tokens=64,
        tokens_help="positions per prompt (target tokens walked)",
        prompt_file=True,
        no_progress=True,
    )
    ap.add_argument(
        "--temperatures",
        default="0,0.7",
        help="comma-separated target temperatures: 0 greedy, else sampled with the keyed sampler (seed = the "
        "prompt's index, as bench.end_to_end.network seeds it) and drafted coupled unless --no-couple",
    )
    ap.add_argument("--max-n", type=int, default=30, help="largest number of outcomes per round to check")
    ap.add_argument(
        "--tree",
        default=None,
        help="the main tree's expansion config, e.g. 2,1,1,1 (default: the draft's recommended tree)",
    )
    ap.add_argument(
        "--no-couple",
        action="store_true",
        help="at T > 0 draft without the keyed uniforms (the draft's most likely tokens lead each node) and "
        "predict with the uncoupled outcome model (the draft's distribution at T)",
    )
    ap.add_argument(
        "--threads", type=int, default=0, help="torch threads for the target (0: torch's default)"
    )
    ap.add_argument("--plot", type=Path, default=None, metavar="PATH", help="draw hit rate vs N to this PNG")


def parse_temperatures(text: str) -> list[float]:
    """--temperatures: comma-separated numbers, at least one, none below 0 (else a usage error)."""
    try:
        temps = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"--temperatures takes comma-separated numbers, got {text!r}") from None
    if not temps or any(t < 0 for t in temps):
        raise UsageError("--temperatures: give 0 or more values of 0 or more")
    return temps


def encode_prompts(tok: TargetTokenizer, prompts: Sequence[BenchPrompt]) -> list[list[int]]:
    """Each prompt's token ids: a raw prompt as it is, else as one user turn of the chat template."""
    encoded = []
    for p in prompts:
        if p.raw:
            encoded.append(tok.encode(p.text, add_special=True))
        else:
            encoded.append(
                tok.encode(tok.apply_chat_template([{"role": "user", "content": p.text}]), add_special=False)
            )
    return encoded


def walk_prompts(
    target: Target,
    drafter: Drafter,
    encoded: Sequence[list[int]],
    temps: Sequence[float],
    tree: ExpansionConfig,
    tokens: int,
    max_n: int,
    couple: bool,
    on_position: Callable[[int], object],
) -> tuple[list[Position], dict[str, list[tuple[int, int]]]]:
    """Every prompt at every temperature: the target's continuation, its first `tokens` positions
    walked (walk_positions, one outcome model per temperature across prompts) and, coupled at
    T > 0, the ranks after a mismatch (per temperature, "{T:g}"). `on_position(n)`: n more
    positions done (a prompt whose continuation ends early counts its rest at once)."""
    from bench.exactness.agreement import target_output

    positions: list[Position] = []
    after_mismatch: dict[str, list[tuple[int, int]]] = {}
    for temp in temps:
        learned = Learned()  # one edge client's outcome model per temperature, across prompts
        model = learned.choice_model(temp, coupled=temp > 0 and couple)
        landing = Landing()  # the ranks' own learner (the outcome model's learns from the trees)
        for i, ids in enumerate(encoded):
            seq = target_output(target, ids, tokens + tree.depth + 1, temp, seed=i)
            if temp > 0 and couple:
                coupling = Coupling(i, temp, landing=landing)
                ranks = mismatch_ranks(drafter, ids, seq[:tokens], coupling, MISMATCH_F)
                after_mismatch.setdefault(f"{temp:g}", []).extend(ranks)
            got = walk_positions(
                drafter, ids, seq, tokens, tree, model, max_n, temp, seed=i, prompt_index=i, couple=couple,
                on_position=lambda: on_position(1),
            )  # fmt: skip
            positions.extend(got)
            on_position(tokens - len(got))
    return positions, after_mismatch


def after_mismatch_tables(summary: dict[str, Any]) -> list[str]:
    """Per coupled temperature, the share of mismatches whose target token is among the first F."""
    out = []
    for key, at_t in summary.items():
        am = at_t.get("after_mismatch")
        if am:
            n = am["mismatches"]
            rows = [[order, *(f"{x:.3f}" for x in am[order])] for order in ("landing", "draft")]
            out.append(f"\nmatch, T {key}: after a mismatch ({n}), the target's token among the first F")
            out.append(table(rows, ["order", *(f"F={f}" for f in range(1, MISMATCH_F + 1))]))
    return out


def run(a: argparse.Namespace) -> Result:
    if a.max_n < 1 or a.tokens < 1:
        raise UsageError("--max-n and --tokens must be at least 1")
    temps = parse_temperatures(a.temperatures)
    prompts = suite_from_args(a.humaneval, a.prompts, a.prompt_file)

    import torch
    from tqdm import tqdm

    from edge_client.defaults import recommended_tree
    from edge_client.drafters.registry import create_drafter
    from shared.model import load_target

    if a.threads:
        torch.set_num_threads(a.threads)
    tree_text = a.tree or recommended_tree(a.draft)
    tree = ExpansionConfig.parse(tree_text)
    target = load_target(a.model, progress=not a.no_progress)
    target.model.prepare(release=True)
    encoded = encode_prompts(target.tokenizer, prompts)
    longest = max(len(e) for e in encoded) + a.tokens + tree.depth + 2
    drafter = create_drafter(a.drafter, a.draft, n_threads=1, max_nodes=max(256, 4 * tree.num_nodes))
    if longest > drafter.max_context:
        raise UsageError(f"a prompt of {longest} tokens with its positions does not fit the draft's context")
    bar = tqdm(
        total=len(prompts) * len(temps) * a.tokens, desc="positions", disable=a.no_progress, file=sys.stderr
    )
    try:
        positions, after_mismatch = walk_prompts(
            target, drafter, encoded, temps, tree, a.tokens, a.max_n, not a.no_couple, bar.update
        )
    finally:
        bar.close()
        drafter.close()
    summary = summarise(positions, POLICIES, a.max_n)
    for key, ranks in after_mismatch.items():
        if key in summary:
            summary[key]["after_mismatch"] = {"mismatches": len(ranks), **top_f_rates(ranks, MISMATCH_F)}
    heading = (
        f"{a.model} / {a.draft} ({drafter.name}), tree {tree_text}, "
        f"{len(prompts)} prompts x {a.tokens} positions"
    )
    cfg = {k: v for k, v in vars(a).items() if k != "prompt_file"}
    cfg["prompt_files"] = [str(f) for f in a.prompt_file or []]
    cfg["tree"] = tree_text
    cfg["drafter_backend"] = drafter.name  # what auto chose
    return Result(
        result_rows(summary),
        "\n".join([heading, report(summary, a.max_n), *after_mismatch_tables(summary)]),
        extra={"summary": summary, "positions": [p.as_dict() for p in positions]},
        config=cfg,
        plot=lambda path: plot(summary, a.max_n, path),
    )


def main(argv: Sequence[str] | None = None) -> int:
    return runner.main(__name__, argv)


if __name__ == "__main__":
    sys.exit(main())
