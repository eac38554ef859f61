"""Trees merged from several drafters (SpecInfer Definition 3.2 at the edge): the merge itself, the
draft step, and the client against the live verifier (greedy equal to ar, seeded match equal to
seeded ar, mss / rrs output distributed as the target's, by chi-square)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import pytest
import torch

from edge_client.client import EdgeClient, PrespecConfig, TreeSpec
from edge_client.drafters.base import Drafter
from edge_client.drafters.registry import create_drafter
from edge_client.speculation import DraftConditional, Drafted, DraftPlain, DraftStep, Request
from edge_client.stats import GenerationStats
from edge_client.trees import DraftOptions, DraftResult, Sampling, draft_static
from edge_client.trees.merged import NOT_IN_WORKSPACE, merge_drafts
from shared.messages import Mode, SessionLimits
from shared.tree import ExpansionConfig, TokenTree
from tests.cloud_verifier.service import LiveServer, tiny
from tests.edge_client.fake_drafter import FakeDrafter, fake_logits
from tests.stats import chi2_pvalue

ALPHA = 1e-3


class SaltedFake(FakeDrafter):
    """A FakeDrafter with other logits (a second draft model of the same vocabulary)."""

    def _commit(self, keep: int, path: list[int], tail: list[int]) -> np.ndarray | None:
        out = super()._commit(keep, path, tail)
        return None if out is None else fake_logits([7, *self._state], self.vocab_size)

    def _evaluate(self, first: int, count: int) -> np.ndarray:
        self.evaluated_tokens += count
        rows = [fake_logits([7, *self._state, *(self._tokens[n] for n in self.path_to(i))], self.vocab_size)
                for i in range(first, first + count)]  # fmt: skip
        return np.stack(rows)


def _paths(tree: TokenTree) -> set[tuple[int, ...]]:
    return tree.paths()


@pytest.mark.parametrize("mode", ["greedy", "mss", "rrs"])
def test_merge_keeps_the_first_tree_every_path_and_every_draw(mode: str) -> None:
    m = Mode(mode)
    sampling = Sampling(1.0, 0, 1.0, 16) if m.stochastic else None
    rng = np.random.default_rng(5) if m.stochastic else None
    opts = DraftOptions(mode=m, sampling=sampling, rng=rng)
    a, b = FakeDrafter(64), SaltedFake(64)
    da = draft_static(a, [1, 2, 3], ExpansionConfig((2, 2, 1)), opts)
    db = draft_static(b, [1, 2, 3], ExpansionConfig((3, 1)), opts)
    merged = merge_drafts([da, db])
    t = merged.tree
    assert _paths(t) == _paths(da.tree) | _paths(db.tree)
    # the first drafter's nodes lead, with their indices and workspace ids
    n0 = da.tree.num_nodes
    assert t.tokens[:n0].tolist() == da.tree.tokens.tolist()
    assert t.parents[:n0].tolist() == da.tree.parents.tolist()
    assert merged.workspace_ids[:n0].tolist() == da.workspace_ids.tolist()
    assert (merged.workspace_ids[n0:] == NOT_IN_WORKSPACE).all()
    t.validate(64, 64, 8, stochastic=m.stochastic, without_replacement=mode == "rrs")
    if not m.stochastic:
        assert t.draws is None
        # identical paths are one node
        assert t.num_nodes == len(_paths(t))
        return
    assert t.draws is not None and da.tree.draws is not None and db.tree.draws is not None
    da_n, db_n = da.tree.draws.num_draws, db.tree.draws.num_draws
    # every draw kept, the first drafter's first, each with its drafter id and its own q row
    assert t.draws.num_draws == da_n + db_n
    assert t.draws.drafter.tolist() == [0] * da_n + [1] * db_n
    assert t.draws.q.num_rows == da.tree.draws.q.num_rows + db.tree.draws.q.num_rows
    drawn = t.tokens[t.draws.node].tolist()
    assert drawn[:da_n] == da.tree.tokens[da.tree.draws.node].tolist()
    assert drawn[da_n:] == db.tree.tokens[db.tree.draws.node].tolist()
    rows_b = t.draws.qrow[da_n:] - da.tree.draws.q.num_rows
    assert rows_b.tolist() == db.tree.draws.qrow.tolist()


def test_draft_step_merges_each_drafters_shape_and_refuses_bad_shapes() -> None:
    limits = SessionLimits()
    req = Request(Mode.GREEDY, TreeSpec("static", ExpansionConfig((2, 1))))
    a, b = FakeDrafter(64), SaltedFake(64)
    step = DraftStep([a, b], req, limits, [req.tree, TreeSpec("sequence", depth=4)])
    dr = step.run(DraftPlain((1, 2, 3), 0))
    assert isinstance(dr, DraftResult)
    alone_a = draft_static(FakeDrafter(64), [1, 2, 3], ExpansionConfig((2, 1)))
    chain_b = draft_static(SaltedFake(64), [1, 2, 3], ExpansionConfig((1, 1, 1, 1)))
    assert _paths(dr.tree) == _paths(alone_a.tree) | _paths(chain_b.tree)
    with pytest.raises(ValueError, match="needs a budget"):
        DraftStep([a, b], req, limits, [req.tree, TreeSpec("budget")])
    with pytest.raises(ValueError, match="one per drafter"):
        DraftStep([a, b], req, limits, [req.tree])


class BarrierFake(FakeDrafter):
    """A FakeDrafter whose evaluations wait at a barrier shared with the others: drafting in turn
    would never get past it, drafting at the same time does."""

    def __init__(self, vocab_size: int, barrier: threading.Barrier, salt: int) -> None:
        super().__init__(vocab_size)
        self.barrier, self.salt, self.threads = barrier, salt, set[int]()

    def _evaluate(self, first: int, count: int) -> np.ndarray:
        self.threads.add(threading.get_ident())
        self.barrier.wait()
        rows = [
            fake_logits(
                [self.salt, *self._state, *(self._tokens[n] for n in self.path_to(i))], self.vocab_size
            )
            for i in range(first, first + count)
        ]
        return np.stack(rows)


@pytest.mark.parametrize("mode", ["greedy", "mss"])
def test_parallel_drafters_draft_at_the_same_time_and_merge_the_same_trees(mode: str) -> None:
    """With a `parallel` pool the drafters evaluate at the same time (each waits at a barrier only
    the other can open) and the merged tree is what drafting in turn gives (greedy); with draws,
    the same seed gives the same tree. Conditional trees too, in lockstep and alone."""
    limits = SessionLimits()
    shape = TreeSpec("static", ExpansionConfig((2, 1)))
    sampling = Sampling(temperature=1.0) if mode == "mss" else None

    def req(seed: int) -> Request:
        rng = np.random.default_rng(seed) if sampling else None
        return Request(Mode(mode), shape, sampling=sampling, rng=rng)

    def step(seed: int, parallel: concurrent.futures.Executor | None) -> tuple[DraftStep, list[BarrierFake]]:
        barrier = threading.Barrier(2 if parallel else 1, timeout=10)
        ds = [BarrierFake(64, barrier, 0), BarrierFake(64, barrier, 7)]
        return DraftStep(ds, req(seed), limits, [shape, shape], parallel), ds

    actions: list[DraftPlain | DraftConditional] = [
        DraftPlain((1, 2, 3), 0),
        DraftConditional((1, 2, 3), ((1, 2, 3, 9),), (lambda: False,), lockstep=False),
    ]
    if mode == "greedy":  # lockstep is for greedy / match
        actions.append(
            DraftConditional((1, 2, 3), ((1, 2, 3, 9), (1, 2, 3, 4, 5)), (lambda: False,) * 2, True)
        )
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        par, par_ds = step(3, pool)
        again, _ = step(3, pool)
        got = [_trees(par.run(a)) for a in actions]
        assert got == [_trees(again.run(a)) for a in actions]  # reproducible for a seed
    assert len(par_ds[0].threads | par_ds[1].threads) == 2
    if mode == "greedy":
        in_turn, _ = step(3, None)
        assert got == [_trees(in_turn.run(a)) for a in actions]


def _trees(out: object) -> list[tuple[list[int], list[int]]]:
    results = out.results if isinstance(out, Drafted) else (out,)
    assert all(isinstance(r, DraftResult) for r in results)
    return [(r.tree.tokens.tolist(), r.tree.parents.tolist()) for r in results if isinstance(r, DraftResult)]


def test_a_parallel_drafter_error_waits_for_the_others() -> None:
    """A drafter that fails (its workspace full) fails the step only after every other drafter has
    finished: none is still drafting when the next step starts."""
    limits = SessionLimits()
    shape = TreeSpec("static", ExpansionConfig((2, 1)))
    done: list[float] = []

    class Slow(FakeDrafter):
        def _evaluate(self, first: int, count: int) -> np.ndarray:
            time.sleep(0.05)
            done.append(time.perf_counter())
            return super()._evaluate(first, count)

    full = FakeDrafter(64, max_nodes=4)  # room for the first tree (4 nodes), not for a second
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        st = DraftStep([full, Slow(64)], Request(Mode.GREEDY, shape), limits, [shape, shape], pool)
        st.run(DraftPlain((1, 2, 3), 0))
        before = len(done)
        out = st.run(DraftConditional((1, 2, 3), ((1, 2, 3, 50),), (lambda: False,), lockstep=False))
        returned, after = time.perf_counter(), len(done)
        assert isinstance(out, Drafted) and out.workspace_full and out.results == (None,)
        assert after > before and done[-1] <= returned  # the slow drafter had finished its tree
        time.sleep(0.2)
        assert len(done) == after  # and drafted nothing after the step returned


def test_drafters_of_another_vocabulary_are_refused() -> None:
    with pytest.raises(ValueError, match=r"drafter 1 .* another vocabulary"):
        EdgeClient("ws://127.0.0.1:1/v1/session", [FakeDrafter(64), FakeDrafter(80)])


# ---------------------------------------------------------------------------- live, tiny target
def _noisy(drafter: Drafter, seed: int, scale: float) -> Drafter:
    """The tiny torch drafter with its logits perturbed: a second draft model of tiny's vocabulary
    that proposes other trees."""
    rng = np.random.default_rng(seed)
    evaluate: Callable[[int, int], np.ndarray] = drafter._evaluate

    def noisy(first: int, count: int) -> np.ndarray:
        out = np.array(evaluate(first, count))
        return out + rng.normal(0, scale, out.shape).astype(np.float32)

    cast(Any, drafter)._evaluate = noisy
    return drafter


def _two_drafters(scale: float = 2.0) -> list[Drafter]:
    return [
        _noisy(create_drafter("torch", "tiny"), 1, scale),
        _noisy(create_drafter("torch", "tiny"), 2, scale),
    ]


async def _gen(
    url: str, drafters: list[Drafter], prompt: str | list[int], **kw: Any
) -> tuple[list[int], GenerationStats]:
    trees = kw.pop("trees", TreeSpec("static", ExpansionConfig((2, 1, 1))))
    prespec = kw.pop("prespec", False)
    parallel = kw.pop("parallel_drafters", False)
    async with EdgeClient(url, drafters, tree=trees, prespec=prespec, parallel_drafters=parallel) as c:
        async for _ in c.generate(prompt, **kw):
            pass
        assert c.last is not None
        return c.last.tokens, c.last.stats


def test_two_drafters_greedy_and_seeded_match_equal_ar() -> None:
    """Greedy (with and without pre-speculation: conditional trees merged from both drafters, in
    lockstep) and seeded match give exactly ar's tokens with two drafters of different shapes."""
    drafters = _two_drafters()
    trees = [TreeSpec("static", ExpansionConfig((2, 1, 1))), TreeSpec("static", ExpansionConfig((1, 2)))]
    p = "Once upon a time"
    with LiveServer(max_pending=6) as srv:
        ar, _ = asyncio.run(_gen(srv.ws, drafters, p, max_new_tokens=20, mode="ar"))
        for prespec in (False, PrespecConfig(fanout=2, gate=False)):
            got, st = asyncio.run(_gen(srv.ws, drafters, p, max_new_tokens=20, trees=trees, prespec=prespec))
            assert got == ar
            # the merged trees hold both drafters' paths: more nodes than either shape alone (6, 3)
            assert max(st.tree_nodes) > 6
        kw = {"max_new_tokens": 20, "temperature": 2.0, "seed": 11}
        m_ar, _ = asyncio.run(_gen(srv.ws, drafters, "Tell me a story.", mode="ar", **kw))
        m, _ = asyncio.run(_gen(srv.ws, drafters, "Tell me a story.", mode="match", trees=trees, **kw))
        assert m == m_ar


def test_parallel_drafters_through_the_verifier() -> None:
    """Drafting at the same time changes no token: greedy with and without pre-speculation equals
    ar; mss and rrs trees drawn at the same time pass the verifier's checks (a bad draw would be an
    error frame and fail the generation; the noisy drafters make a seed's output vary, so their
    reproducibility is tested on the draft step above)."""
    drafters = _two_drafters()
    trees = [TreeSpec("static", ExpansionConfig((2, 1, 1))), TreeSpec("static", ExpansionConfig((1, 2)))]
    p = "Once upon a time"
    with LiveServer(max_pending=6, trust_anonymous=True) as srv:
        ar, _ = asyncio.run(_gen(srv.ws, drafters, p, max_new_tokens=20, mode="ar"))
        for prespec in (False, PrespecConfig(fanout=2, gate=False)):
            kw: dict[str, Any] = {"trees": trees, "prespec": prespec, "parallel_drafters": True}
            got, st = asyncio.run(_gen(srv.ws, drafters, p, max_new_tokens=20, **kw))
            assert got == ar and max(st.tree_nodes) > 6
        for mode in ("mss", "rrs"):
            kw = {"trees": trees, "parallel_drafters": True, "mode": mode, "temperature": 1.0, "seed": 5}
            toks, st = asyncio.run(_gen(srv.ws, drafters, p, max_new_tokens=12, **kw))
            assert (len(toks) == 12 or toks[-1] == 2) and st.rounds > 0  # no draw was refused


def _first_token_probs(prompt: list[int], temperature: float, top_k: int) -> np.ndarray:
    from cloud_verifier.sampling import SamplingParams, target_probs
    from shared.model import prefill

    target = tiny()
    kv = target.new_kv_cache(len(prompt) // 16 + 8, 16)
    kv.add(0)
    with torch.inference_mode():
        logits = prefill(target.model, kv, 0, prompt)
    p = target_probs(logits.unsqueeze(0), SamplingParams(temperature=temperature, top_k=top_k))[0]
    return p.double().numpy()


@pytest.mark.slow
@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("mode", ["mss", "rrs"])
def test_two_drafters_sample_the_targets_distribution(mode: str, parallel: bool) -> None:
    """Chi-square through the real client and verifier: the first token of many seeded mss / rrs
    generations with two noisy drafters (their q far from p, so rejections and residual updates
    against both drafters' q rows at the root happen) is distributed as the target's; drafting in
    turn and at the same time (each drafter's draws from its own spawned generator)."""
    drafters = _two_drafters(scale=3.0)
    tok = drafters[0].tokenizer
    prompt = tok.encode("Once upon a time", add_special=False)
    top_k, temp, n = 6, 1.0, 600
    trees = [TreeSpec("static", ExpansionConfig((3, 1))), TreeSpec("static", ExpansionConfig((2, 2)))]
    firsts: list[int] = []

    async def run_all(url: str) -> None:
        async with EdgeClient(url, drafters, tree=trees, parallel_drafters=parallel) as c:
            for seed in range(n):
                async for _ in c.generate(
                    prompt, max_new_tokens=1, mode=mode, temperature=temp, top_k=top_k, seed=seed
                ):
                    pass
                assert c.last is not None
                firsts.append(c.last.tokens[0])

    with LiveServer(trust_anonymous=True) as srv:
        asyncio.run(run_all(srv.ws))
    p = _first_token_probs(prompt, temp, top_k)
    support = np.flatnonzero(p > 0)
    counts = np.bincount(firsts, minlength=p.size)
    assert counts[p == 0].sum() == 0
    assert chi2_pvalue(counts[support], p[support]) > ALPHA
    # the test has power: a sampler off by as much as a drafter's noise is caught
    wrong = np.roll(p[support], 1)
    assert chi2_pvalue(counts[support], wrong) < ALPHA


def test_cli_draft_shapes() -> None:
    from edge_client.defaults import draft_specs, parse_draft

    assert parse_draft("smollm2-135m-q4") == ("smollm2-135m-q4", None)
    assert parse_draft("a.gguf@budget=8") == ("a.gguf", TreeSpec("budget", budget=8))
    assert parse_draft("a.gguf@sequence=4") == ("a.gguf", TreeSpec("sequence", depth=4))
    assert parse_draft("x@2,1") == ("x", TreeSpec("static", ExpansionConfig((2, 1))))
    for bad in ("x@budget=0", "x@budget=n", "x@2,a", "x@"):
        with pytest.raises(ValueError, match="--draft"):
            parse_draft(bad)
    first = TreeSpec("static", ExpansionConfig((2, 1)))
    models, specs = draft_specs(["a.gguf", "b.gguf@budget=6", "smollm2-135m-q4"], lambda m: first)
    assert models == ["a.gguf", "b.gguf", "smollm2-135m-q4"]
    assert specs == [
        first,
        TreeSpec("budget", budget=6),
        TreeSpec("static", ExpansionConfig((1, 1, 3, 1, 1))),
    ]
    with pytest.raises(ValueError, match="shape the first draft"):
        draft_specs(["a@2"], lambda m: first)


def test_an_export_folder_gets_its_source_drafts_recommended_tree(tmp_path: Any) -> None:
    import json

    from edge_client.defaults import FALLBACK_TREE, RECOMMENDED_TREES, recommended_tree

    (tmp_path / "manifest.json").write_text(json.dumps({"source": "qwen2.5-coder-0.5b-q4"}))
    assert recommended_tree(tmp_path) == RECOMMENDED_TREES["qwen2.5-coder-0.5b-q4"] != FALLBACK_TREE
    assert recommended_tree(str(tmp_path)) == RECOMMENDED_TREES["qwen2.5-coder-0.5b-q4"]
    (tmp_path / "manifest.json").write_text("not json")
    assert recommended_tree(tmp_path) == FALLBACK_TREE
    assert recommended_tree(tmp_path / "missing") == FALLBACK_TREE
