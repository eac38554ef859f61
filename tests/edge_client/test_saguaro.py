"""Saguaro sampling (trees.sampling.Saguaro, PrespecConfig.saguaro_c, `--saguaro-c`): the q rows of
mss / rrs trees with the pre-speculated candidates' weights scaled by C, drawn from and shipped.

Exactness against the target alone, with the harness: tests/cloud_verifier/test_saguaro_exactness.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.speculation import PrespecConfig
from edge_client.trees import DraftOptions, Saguaro, Sampling, draft_static
from shared.sparse import Q_TOTAL, SparseDist
from shared.tree import ExpansionConfig
from tests.edge_client.fake_drafter import FakeDrafter, fake_logits
from tests.stats import chi2_pvalue

V = 64
S = [3, 14, 15, 9, 26, 5]
ALPHA = 1e-6
SAMPLING = Sampling(temperature=1.1, top_k=30, wire_top_k=16)


def _expected_weights(q: SparseDist, scaled: np.ndarray, c: float) -> np.ndarray:
    """The exact (unquantized) weights of q with the tokens at positions `scaled` times c."""
    w = q.weights.astype(np.float64)
    w[scaled] *= c
    out: np.ndarray = w / w.sum() * Q_TOTAL
    return out


# ------------------------------------------------------------------------------------ the row
@pytest.mark.parametrize("c", [0.5, 0.25])
@pytest.mark.parametrize("draws", [1, 2, 3])
def test_shipped_row_sums_to_one_and_scales_the_candidates_by_c(c: float, draws: int) -> None:
    q = SAMPLING.q_row(fake_logits(S, V))
    sg = Saguaro(c, fanout=3)
    row = Sampling(SAMPLING.temperature, SAMPLING.top_k, 1.0, SAMPLING.wire_top_k, sg).shipped_row(q, draws)
    assert len(q) == 16
    assert int(row.weights.sum()) == Q_TOTAL and bool((row.weights >= 1).all())
    assert row.ids.tolist() == q.ids.tolist()  # the same tokens: only their weights move
    # the candidates: the fanout + draws heaviest tokens of q
    at = sg.candidates(q, draws)
    heaviest = np.argsort(-q.weights, kind="stable")[: 3 + draws]
    assert sorted(at.tolist()) == sorted(heaviest.tolist()) and at.size == 3 + draws
    rest = np.setdiff1d(np.arange(len(q)), at)
    # relative weight: the candidates' share against the rest is c times what it was in q
    share_q = q.weights[at].sum() / q.weights[rest].sum()
    share = row.weights[at].sum() / row.weights[rest].sum()
    assert share == pytest.approx(c * share_q, rel=2e-3)
    # token by token: the renormalised scaled row, up to the last unit of quantization
    assert np.abs(row.weights - _expected_weights(q, at, c)).max() < 1.0
    # within each group the ratios of q are kept (here a candidate and a non-candidate pair)
    i, j = int(at[0]), int(rest[0])
    assert row.weights[i] / row.weights[j] == pytest.approx(c * q.weights[i] / q.weights[j], rel=0.02)


def test_c_one_or_a_row_of_candidates_only_is_left_as_it_is() -> None:
    q = SAMPLING.q_row(fake_logits(S, V))
    assert Saguaro(1.0).apply(q, 1) is q
    short = SparseDist.from_weights([2, 5, 9], [30000, 20000, 15536])
    assert Saguaro(0.25, fanout=3).apply(short, 1) is short  # 4 candidates > 3 tokens
    assert SAMPLING.shipped_row(q, 2) is q  # no Saguaro: the row is q


@pytest.mark.parametrize("c", [0.0, -0.5, 1.5, float("nan")])
def test_c_outside_0_1_is_refused(c: float) -> None:
    with pytest.raises(ValueError, match="0 < c <= 1"):
        Saguaro(c)
    with pytest.raises(ValueError, match="saguaro_c"):
        PrespecConfig(saguaro_c=c)


def test_prespec_config_gives_saguaro_with_its_fanout() -> None:
    assert PrespecConfig().saguaro_c == 1.0 and PrespecConfig().saguaro is None  # off by default
    assert PrespecConfig(saguaro_c=0.5, fanout=2).saguaro == Saguaro(0.5, 2)


# ------------------------------------------------------------------------------------ the trees
@pytest.mark.parametrize("mode", ["mss", "rrs"])
def test_trees_ship_the_scaled_rows_and_keep_the_drafts_own_q(mode: str) -> None:
    """Every row a tree carries is its node's q row scaled for that node's number of draws;
    alternatives and node probabilities stay the draft's own q (the outcome model reads them)."""
    d = FakeDrafter(V)
    cfg = ExpansionConfig((3, 2, 1))
    sg = Saguaro(0.25, fanout=2)
    sampling = Sampling(1.1, 30, 1.0, 16, sg)
    rng = np.random.default_rng(3)
    for _ in range(10):
        r = draft_static(d, S, cfg, DraftOptions(mode=mode, sampling=sampling, rng=rng, eval_leaves=True))
        t = r.tree
        draws = t.draws
        assert draws is not None
        t.validate(V, 64, 16, stochastic=True, without_replacement=(mode == "rrs"))
        for parent in [-1, *range(t.num_nodes)]:
            at = t.draws_at(parent)
            depth = int(t.depth[parent]) if parent >= 0 else 0
            prefix = S + (t.path_tokens(parent) if parent >= 0 else [])
            q = sampling.q_row(fake_logits(prefix, V))
            order = np.argsort(-q.weights, kind="stable")[: r.alt_tokens.shape[1]]
            assert r.alt_tokens[parent + 1].tolist() == q.ids[order].tolist()  # leaves too (eval_leaves)
            if depth == cfg.depth:
                assert not at
                continue
            k = cfg.ks[depth]
            want = sg.apply(q, k)
            assert want.weights.tolist() != q.weights.tolist()
            for dr in at:
                row = draws.q.row(int(draws.qrow[dr]))
                assert row.ids.tolist() == want.ids.tolist() and row.weights.tolist() == want.weights.tolist()
                node = int(draws.node[dr])
                assert r.node_prob[node] == pytest.approx(q.prob(int(t.tokens[node])), rel=1e-6)


def _first_draws(sampling: Sampling, trees: int, seed: int) -> np.ndarray:
    d = FakeDrafter(V)
    rng = np.random.default_rng(seed)
    counts = np.zeros(V)
    for _ in range(trees):
        t = draft_static(
            d, S, ExpansionConfig((1,)), DraftOptions(mode="mss", sampling=sampling, rng=rng)
        ).tree
        counts[int(t.tokens[0])] += 1
    return counts


def test_draws_follow_the_shipped_row_not_q() -> None:
    """χ²: with Saguaro sampling the edge draws from the row it ships; the same counts against the
    unscaled q are rejected (the check has the power to tell them apart)."""
    sampling = Sampling(1.1, 30, 1.0, 16, Saguaro(0.25))
    q = sampling.q_row(fake_logits(S, V))
    counts = _first_draws(sampling, 8000, seed=21)
    assert chi2_pvalue(counts, sampling.shipped_row(q, 1).dense(V)) > ALPHA
    assert chi2_pvalue(counts, q.dense(V)) < ALPHA


# ------------------------------------------------------------------------------------ the CLI
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prespec", "--mode", "mss", "--temperature", "0.7", "--saguaro-c", "0"], "> 0 and <= 1"),
        (["--prespec", "--mode", "rrs", "--temperature", "0.7", "--saguaro-c", "1.5"], "> 0 and <= 1"),
        (["--prespec", "--mode", "mss", "--temperature", "0.7", "--saguaro-c", "nan"], "not a finite number"),
        (["--mode", "mss", "--temperature", "0.7", "--saguaro-c", "0.5"], "add --prespec"),
        (["--prespec", "--saguaro-c", "0.5"], "--mode mss or --mode rrs"),
    ],
)
def test_edge_refuses_a_bad_saguaro_c_before_connecting(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # port 9 on localhost has no verifier: a refusal that came after connecting would fail differently
    rc = _edge_rc(["generate", "--server", "ws://127.0.0.1:9/v1/session", "--draft", "tiny", *flags, "hi"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "--saguaro-c" in err and message in err


def _edge_rc(argv: list[str]) -> int:
    """edge-client's exit status for argv (argparse's usage errors exit with 2 while parsing)."""
    from edge_client.cli import main

    try:
        return main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


def test_serve_refuses_a_bad_saguaro_c(capsys: pytest.CaptureFixture[str]) -> None:
    assert _edge_rc(["serve", "--saguaro-c", "2"]) == 2
    assert "argument --saguaro-c: 2 is out of range" in capsys.readouterr().err
    assert _edge_rc(["serve", "--no-prespec", "--saguaro-c", "0.5"]) == 2
    assert "drop --no-prespec" in capsys.readouterr().err


def test_help_explains_saguaro_c() -> None:
    from edge_client.cli import build_parser

    parser = build_parser()
    for command in ("generate", "serve"):
        args = parser.parse_args([command, "--saguaro-c", "0.5", *(["hi"] if command == "generate" else [])])
        assert args.saguaro_c == 0.5
    assert parser.parse_args(["generate", "hi"]).saguaro_c == 1.0  # off unless asked for


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["mss", "rrs"])
def test_a_prespeculating_client_drafts_with_saguaro_and_the_verifier_takes_its_trees(mode: str) -> None:
    """EdgeClient(prespec=PrespecConfig(saguaro_c=0.5)) drafts its mss / rrs trees from the scaled
    rows (its request's sampling carries Saguaro(0.5, fanout)) and the verifier accepts every tree
    it sends, conditional ones included."""
    import asyncio

    from bench.lib.shaper import LinkShape
    from edge_client.client import EdgeClient
    from edge_client.drafters.registry import create_drafter
    from edge_client.speculation import TreeSpec
    from shared.messages import Mode
    from tests.cloud_verifier.service import LiveServer

    drafter = create_drafter("torch", "tiny")
    cfg = PrespecConfig(fanout=3, gate=False, saguaro_c=0.5)
    with LiveServer(trust_anonymous=True, max_pending=6) as srv:

        async def go() -> tuple[Sampling | None, int, int, int]:
            async with EdgeClient(
                srv.ws, drafter, prespec=cfg, link=LinkShape.rtt(1000.0), tree=TreeSpec()
            ) as c:
                sampling = c._request(Mode(mode), 1.0, 0, 1.0, 2, TreeSpec()).sampling
                async for _ in c.generate(
                    "Once upon a time", max_new_tokens=24, mode=mode, temperature=1.0, seed=2
                ):
                    pass
                assert c.last is not None
                st = c.last.stats
                return sampling, len(c.last.tokens), st.prespec_sent, st.prespec_refused

        sampling, n, sent, refused = asyncio.run(go())
    assert sampling is not None and sampling.saguaro == Saguaro(0.5, 3)
    assert n == 24 and sent > 0 and refused == 0
