"""The device path of verification: sync-free walks give the early-stopping
walk's verdicts bit for bit, read nothing back per node or per draw, and an engine step reads every
verdict with one copy. On a CPU the syncs are counted as calls that would wait for a GPU; on a GPU
(`cuda` marker) torch's sync debug mode turns any of them into an error."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from cloud_verifier.sampling import (
    SamplingParams,
    _radix_threshold,
    _radix_threshold_dense,
    sample_next,
    sample_next_async,
    top_p_threshold,
)
from cloud_verifier.verify import (
    MODES,
    Algorithm,
    TreeBatch,
    read_verdicts,
    unpack_verdict,
    verify_batch,
    verify_tree,
    verify_tree_async,
)
from shared import TokenTree, merge
from tests.cloud_verifier.test_verify import bigram, stochastic_tree, tree_logits

CUDA = pytest.param("cuda", marks=pytest.mark.cuda)
PARAMS = [
    SamplingParams(),
    SamplingParams(0.9, top_p=0.95),
    SamplingParams(1.0, top_k=8),
    SamplingParams(0.7, top_k=12, top_p=0.8),
    SamplingParams(1.3),
]
# what waits for a GPU: reading a value back, or an op whose output size depends on values
_READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero"}


class SyncCounter(TorchFunctionMode):
    """Counts tensor calls that would synchronise with a GPU (on any device)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _READS:
            self.calls.append(name)
        elif name == "__getitem__" and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in _flat(args[1:])
        ):
            self.calls.append("bool-mask index")
        elif name == "to" and any(str(a) == "cpu" for a in [*args[1:], *kwargs.values()]):
            self.calls.append("to cpu")
        return func(*args, **kwargs)


def _flat(xs: Any) -> Iterator[Any]:
    for x in xs:
        if isinstance(x, tuple | list):
            yield from _flat(x)
        else:
            yield x


@contextmanager
def no_gpu_sync(device: str) -> Iterator[None]:
    """On a GPU: any synchronising call inside is an error."""
    if device != "cuda":
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def trees_for(mode: Algorithm, rng: np.random.Generator, draft: np.ndarray, count: int) -> list[TokenTree]:
    """Merged trees of two drafters, several shapes (stochastic for mss / rrs)."""
    shapes = [((2, 1), (2,)), ((1, 1, 3),), ((3,),), ((2, 2), (1, 1, 1)), ((1,),), ((4, 2, 1, 1), (1, 1))]
    wr = mode != "mss" and mode != "naive"
    out = []
    for i in range(count):
        root = int(rng.integers(draft.shape[0]))
        parts = [stochastic_tree(rng, draft, ks, root, wr, d) for d, ks in enumerate(shapes[i % len(shapes)])]
        tree = merge(parts)
        if mode not in ("mss", "rrs"):
            tree = TokenTree.build(tree.tokens, tree.parents, tree.base, tree.cond)
        out.append(tree)
    return out


def _gen(device: str, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("mode", MODES)
def test_sync_free_verdicts_equal_the_early_stopping_walk(mode: Algorithm, device: str) -> None:
    """verify_tree_async + one read == verify_tree (which reads back at every depth and draw), for
    every mode and several sampling parameters, with the same generator state; one copy for all."""
    vocab = 40
    target, draft = bigram(vocab, 11)
    rng = np.random.default_rng(11)
    trees = trees_for(mode, rng, draft, 12)
    for pi, params in enumerate(PARAMS):
        want, pending = [], []
        for i, tree in enumerate(trees):
            logits = tree_logits(target, int(tree.cond[0]), tree).to(device)
            seed = 100 * pi + i
            want.append(verify_tree(mode, tree, logits, params, seed=seed, generator=_gen(device, seed)))
            with no_gpu_sync(device):
                pending.append(
                    verify_tree_async(mode, tree, logits, params, seed=seed, generator=_gen(device, seed))
                )
        got = [unpack_verdict(v, t) for v, t in zip(read_verdicts(pending), trees, strict=True)]
        if device == "cpu" or mode in ("greedy", "match"):
            assert got == want, (mode, params)
        for res, tree in zip(got, trees, strict=True):
            path = tree.path(res.accepted_nodes[-1]) if res.accepted_nodes else []
            assert res.accepted_nodes == path
            assert res.tokens[:-1] == [int(tree.tokens[i]) for i in path] and 0 <= res.bonus < vocab


def _count(fn: Any) -> int:
    with SyncCounter() as c:
        fn()
    return len(c.calls)


@pytest.mark.parametrize("mode", MODES)
def test_no_read_back_per_node_or_draw(mode: Algorithm) -> None:
    """Counted on a CPU: the sync-free walk makes no read-back whatever the tree's depth and draws
    (chains of depth 1..8, rows of 1..6 draws); the early-stopping walk's count grows with depth
    (so the counter sees them); reading a step's verdicts is one call however many trees."""
    vocab = 40
    target, draft = bigram(vocab, 3)
    rng = np.random.default_rng(3)
    wr = mode != "mss" and mode != "naive"
    params = SamplingParams(0.9, top_p=0.9) if mode != "greedy" else SamplingParams()
    eager, pending = [], []
    for ks in [(1,), (1, 1, 1), (1,) * 8, (6,), (3, 2, 2), (2,) * 5]:
        tree = stochastic_tree(rng, draft, ks, 1, wr)
        if mode not in ("mss", "rrs"):
            tree = TokenTree.build(tree.tokens, tree.parents, tree.base, tree.cond)
        # a target that equals the draft's favourite: long accepted walks
        logits = tree_logits(target, 1, tree)
        rows = torch.cat((torch.tensor([1]), torch.from_numpy(tree.tokens)))
        logits = torch.from_numpy(draft[rows.numpy()]).float() * 4
        batch = TreeBatch.from_tree(tree)
        assert _count(lambda b=batch, x=logits: verify_batch(mode, b, x[None], params, sync_free=True)) == 0
        out: list[torch.Tensor] = []
        assert _count(lambda t=tree, x=logits, o=out: o.append(verify_tree_async(mode, t, x, params))) == 0
        pending += out
        eager.append(_count(lambda t=tree, x=logits: verify_tree(mode, t, x, params)))
    assert max(eager) >= 3, eager
    with SyncCounter() as c:
        read_verdicts(pending)
    assert c.calls == ["tolist"]


def test_sync_counter_sees_every_kind_of_read_back() -> None:
    x = torch.arange(6)
    for fn in (
        lambda: x[0].item(),
        lambda: x.tolist(),
        lambda: bool(x[0]),
        lambda: int(x[1]),
        lambda: x.nonzero(),
        lambda: x[x > 2],
        lambda: x.to("cpu"),
        lambda: x.cpu(),
    ):
        assert _count(fn) == 1
    assert _count(lambda: (x * 2).argmax()) == 0


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_dense_radix_threshold_is_the_radix_threshold(device: str) -> None:
    """The nonzero-free top-p threshold equals the radix select bit for bit (and the sorted
    reference), on peaked, flat and tied rows."""
    gen = torch.Generator().manual_seed(4)
    for scale in (0.05, 1.0, 4.0, 12.0):
        probs = torch.softmax(torch.randn(24, 3000, generator=gen) * scale, -1)
        probs[3] = torch.softmax(torch.randint(0, 3, (3000,), generator=gen).float(), -1)  # ties
        probs = probs.to(device)
        for top_p in (0.2, 0.5, 0.9, 0.999):
            dense = _radix_threshold_dense(probs, top_p)
            assert torch.equal(dense, _radix_threshold(probs, top_p)), (scale, top_p)
            both = top_p_threshold(probs, top_p, sync_free=True)
            assert torch.equal(both, top_p_threshold(probs, top_p, sync_free=False))
            with SyncCounter() as c:
                top_p_threshold(probs, top_p, sync_free=True)
            assert c.calls == []


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_sample_next_async_is_sample_next(device: str) -> None:
    gen = torch.Generator().manual_seed(8)
    for params in PARAMS:
        for pos in range(20):
            logits = (torch.randn(500, generator=gen) * 3).to(device)
            with no_gpu_sync(device):
                got = sample_next_async(logits, params, seed=5, position=pos)
            assert got.shape == (1,) and int(got) == sample_next(logits, params, 5, pos)


def test_unpack_verdict_refuses_a_wrong_length() -> None:
    tree = TokenTree.build([4, 5], [-1, 0], base=3, cond=[1])
    with pytest.raises(ValueError, match="depth-2 tree has 5 values"):
        unpack_verdict([0, 1, 4, 5], tree)
    assert unpack_verdict([0, -1, 4, 9, -1], tree).tokens == [4, 9]


def _engine_step_outcomes(sync_free: bool, counter: SyncCounter | None = None) -> list[Any]:
    """One engine step of the tiny target over greedy, match, mss and ar sessions (trees of
    several depths), with the forward's logits fixed, so that only verification runs."""
    import asyncio

    from cloud_verifier.engine import Engine
    from shared.messages import Mode, Prompt
    from tests.cloud_verifier.service import prompt_tokens, tiny

    async def main() -> list[Any]:
        t = tiny()
        e = Engine(t, t.new_kv_cache(64, 16))
        e.sync_free = sync_free
        rng = np.random.default_rng(2)
        sessions = []
        for i, (mode, ks) in enumerate(
            [(Mode.GREEDY, (1, 1, 1)), (Mode.MATCH, (2, 2, 1)), (Mode.MSS, (3, 1)), (Mode.MATCH, None)]
        ):
            toks = np.asarray(prompt_tokens(i, 1), dtype=np.int32)
            tree = None
            if ks is not None:
                q = rng.normal(size=(t.config.vocab_size, 64))
                small = stochastic_tree(rng, q, ks, int(toks[-1]), False)
                tree = TokenTree.build(small.tokens, small.parents, 1, [int(toks[-1])], draws=small.draws)
                if mode is not Mode.MSS:
                    tree = TokenTree.build(tree.tokens, tree.parents, 1, tree.cond)
            s = e.open(lambda r: None)
            prompt = Prompt(toks, mode, max_new_tokens=8, temperature=0.9, seed=7 + i, tree=tree)
            e.start(s, prompt, toks)
            sessions.append(s)
        plan = e.runner.plan()
        gen = torch.Generator().manual_seed(0)
        fixed = [torch.randn(len(p.pre) + _n(p), t.config.vocab_size, generator=gen) * 3 for p in plan]
        cast(Any, e.target.model).forward_packed = lambda inputs, kv: [x.clone() for x in fixed]
        e.kv.reserve([(p.seq.sid, len(p.pre) + _n(p)) for p in plan])
        if counter is None:
            out = e.runner.execute(plan).outcomes
        else:
            with counter:
                out = e.runner.execute(plan).outcomes
        del e.target.model.forward_packed
        return [
            (o.planned.seq.sid, o.result and o.result.tokens, o.result and o.result.accepted_nodes, o.error)
            for o in out
        ]

    return asyncio.run(main())


def _n(p: Any) -> int:
    return p.job.tree.num_nodes if p.job.tree is not None else 0


def test_an_engine_step_reads_its_verdicts_with_one_copy() -> None:
    """The engine's device path (forced on a CPU) gives the host path's rounds, and reads every
    session's verdict back with one call, whatever the number of sessions, nodes and draws."""
    counter = SyncCounter()
    got = _engine_step_outcomes(True, counter)
    assert got == _engine_step_outcomes(False)
    assert all(err is None and tokens for _, tokens, _, err in got)
    assert counter.calls == ["tolist"]
