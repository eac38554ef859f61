"""bench.simulation.outcomes: the verdict of a tree against the target's own tokens, the policies' outcome
lists, and the hit rate against N (non-decreasing for the nested policies, and equal to the share of
positions whose outcome is in the list), on the fake drafter and on the small pair."""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from bench.simulation.outcomes import (
    NESTED,
    POLICIES,
    actual_outcome,
    hit_rates,
    main,
    summarise,
    uniform_outcomes,
    walk_positions,
)
from edge_client.speculation.estimates import ChoiceModel
from edge_client.speculation.outcomes import outcome_probabilities, predict_outcomes
from edge_client.trees import DraftOptions, draft_static
from shared.tree import ExpansionConfig, TokenTree
from tests.edge_client.fake_drafter import FakeDrafter, fake_logits

VOCAB = 64
TREE = ExpansionConfig((2, 1, 1, 1))


def target_tokens(prompt: list[int], n: int, agree: float, seed: int = 0) -> list[int]:
    """A stand-in target: the fake draft's top token with probability `agree`, else its runner-up
    or a token from the draft's tail (so every accepted length and some unpredictable bonuses occur)."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    for _ in range(n):
        order = np.argsort(-fake_logits([*prompt, *out], VOCAB))
        u = rng.random()
        out.append(
            int(order[0] if u < agree else order[1] if u < agree + 0.15 else order[rng.integers(2, 20)])
        )
    return out


def test_actual_outcome_walks_the_tree_along_the_targets_tokens() -> None:
    tree = TokenTree.from_sequences([[5, 6, 7], [5, 8], [9]], base=3)
    seq = [1, 2, 3, 5, 6, 4, 0]
    accepted, cond = actual_outcome(tree, seq, 3) or ([], ())
    assert [int(tree.tokens[i]) for i in accepted] == [5, 6] and cond == (5, 6, 4)
    assert actual_outcome(tree, [1, 2, 3, 9, 9], 3) == ([tree.children_of(-1)[1]], (9, 9))
    assert actual_outcome(tree, [1, 2, 3, 4], 3) == ([], (4,))  # nothing accepted, bonus 4
    assert actual_outcome(tree, [1, 2, 3, 5, 6, 7], 3) is None  # the sequence ends before the bonus


def test_uniform_lists_are_nested_and_spread_over_accepted_lengths() -> None:
    d = FakeDrafter(VOCAB)
    dr = draft_static(d, [3, 4, 5], TREE, DraftOptions(eval_leaves=True))
    model = ChoiceModel()
    full = uniform_outcomes(dr, 40, model)
    for n in range(1, 41):
        assert uniform_outcomes(dr, n, model) == full[:n]
    nodes, _, _ = outcome_probabilities(dr, model)
    lengths = {0 if j < 0 else int(dr.tree.depth[j]) for j in nodes}
    first = full[: len(lengths)]
    assert {o.depth for o in first} == lengths  # one guess per accepted length before any second


def test_hit_rate_is_the_share_of_positions_covered_and_grows_with_n() -> None:
    prompt = [7, 8, 9, 10]
    output = target_tokens(prompt, 60, agree=0.75)
    model = ChoiceModel()
    twin = copy.deepcopy(model)
    got = walk_positions(FakeDrafter(VOCAB), prompt, output, 50, TREE, model, 12)
    assert len(got) == 50 and {p.k for p in got} != {0}
    # recompute every position independently: the deepest tree node whose path is the target's
    # next tokens, and each policy's list at each N from the outcome model as it stood then
    d = FakeDrafter(VOCAB)
    seq = [*prompt, *output]
    covered = {p: np.zeros(12) for p in POLICIES}
    for i, pos in enumerate(got):
        at = len(prompt) + i
        dr = draft_static(d, seq[:at], TREE, DraftOptions(eval_leaves=True))
        tree = dr.tree
        on_path = [
            j for j in range(tree.num_nodes) if tree.path_tokens(j) == seq[at : at + int(tree.depth[j])]
        ]
        k = max([int(tree.depth[j]) for j in on_path] or [0])
        assert pos.k == k
        cond = tuple(seq[at : at + k + 1])
        for n in range(1, 13):
            lists = {
                "probability": predict_outcomes(dr, n, 1.0, "top", twin),
                "geometric": predict_outcomes(dr, n, 1.0, "geometric", twin),
                "uniform": uniform_outcomes(dr, n, twin),
            }
            for p in POLICIES:
                covered[p][n - 1] += any(o.cond == cond for o in lists[p])
        twin.observe(dr, sorted(on_path, key=lambda j: int(tree.depth[j])), list(cond))
    for p in POLICIES:
        rates = hit_rates(got, p, 12)
        assert rates == pytest.approx(list(covered[p] / len(got)))
        if p in NESTED:
            assert all(b >= a for a, b in itertools.pairwise(rates))
        assert 0 < rates[-1] <= 1 and rates[-1] >= rates[0]
    summary = summarise(got, POLICIES, 12)["0"]
    assert summary["positions"] == 50
    assert sum(summary["k_share"].values()) == pytest.approx(1.0)
    by_k = summary["policies"]["probability"]["by_k"]
    share = summary["k_share"]
    # the overall rate is the by-k rates weighted by the share of positions at each k
    for n in (1, 5, 12):
        assert sum(share[k] * by_k[k][n - 1] for k in by_k) == pytest.approx(
            summary["policies"]["probability"]["hit_rate"][n - 1], abs=1e-3
        )


def test_help_names_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    for flag in ("--model", "--draft", "--drafter", "--prompts", "--humaneval", "--tokens", "--temperatures"):
        assert flag in text
    assert "--max-n" in text and "--json" in text and "--plot" in text and "--prompt-file" in text


@pytest.mark.slow
def test_a_tiny_run_on_the_small_pair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "o.json", tmp_path / "o.png"
    args = [
        "--model",
        "smollm2-135m",
        "--draft",
        "smollm2-135m-q4",
        "--drafter",
        "llama_cpp",
        "--threads",
        "1",
    ]
    args += ["--prompts", "1", "--humaneval", "1"]
    args += ["--tokens", "16", "--max-n", "10", "--json", str(out), "--plot", str(png), "--no-progress"]
    assert main(args) == 0
    assert "N=10" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert set(doc["summary"]) == {"0", "0.7"}
    for temp, s in doc["summary"].items():
        positions = [p for p in doc["positions"] if f"{p['temperature']:g}" == temp]
        assert s["positions"] == len(positions) == 32
        for pol in POLICIES:
            rates = s["policies"][pol]["hit_rate"]
            assert len(rates) == 10
            covered = [
                sum(p["hits"][pol][n - 1] == "1" for p in positions) / len(positions) for n in range(1, 11)
            ]
            assert rates == pytest.approx(covered, abs=1e-4)
            if pol in NESTED:
                assert all(b >= a for a, b in itertools.pairwise(rates))
    assert png.stat().st_size > 10_000
