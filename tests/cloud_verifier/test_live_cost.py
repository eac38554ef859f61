"""The live verify cost curve (cloud_verifier/live_cost.py): a start-up curve measured while the
machine was busy is corrected from the forwards the engine runs, everywhere, within three forwards
of one size; prefills only move their own region; the curve stays non-decreasing and every map a
verdict carries is one a client takes."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import threading
from pathlib import Path

import numpy as np
import pytest

from cloud_verifier.app_state import AppState
from cloud_verifier.cost import DEFAULT_NODES, cost_cache_key
from cloud_verifier.engine import Engine
from cloud_verifier.live_cost import MIN_MARGINAL_MS, PRIOR_WEIGHT, VERDICT_NODES, WINDOW, LiveCost
from cloud_verifier.step import EngineConfig, SeqStatus
from shared import model_store
from shared.messages import FEATURE_COST, Hello, Mode, Prompt, Verdict, Welcome
from shared.tree import TokenTree
from shared.verify_cost import cost_curve_error
from tests.cloud_verifier.service import WsSession, prompt_tokens, reference, scripted_tree, service, tiny

# a CPU-like curve (ms of row 0 + N nodes) and a start-up measurement taken while the machine was
# busy: everything twice as slow
TRUE = {0: 70.0, 1: 71.0, 2: 73.0, 4: 80.0, 8: 95.0, 16: 130.0, 32: 200.0, 64: 340.0}
POISONED = {n: 2 * ms for n, ms in TRUE.items() if n >= 1}


def _close(a: dict[int, float], b: dict[int, float], rel: float = 1e-3) -> bool:
    return a.keys() == b.keys() and all(abs(a[n] - b[n]) <= rel * b[n] for n in a)


def test_a_poisoned_prior_is_corrected_everywhere_within_three_forwards_of_one_size() -> None:
    """Only one-row forwards (stream steps, `ar` tokens) run, at their true cost: after the third
    the whole curve, tree sizes never seen included, is the true one (the poison was a factor)."""
    live = LiveCost(POISONED)
    want = {n: ms for n, ms in TRUE.items() if n >= 1}
    assert live.curve() == POISONED
    assert live.forward_ms(0) == POISONED[1]  # N = 0 from N = 1 until a one-row forward is seen
    seen = []
    for _ in range(3):
        live.observe(1, TRUE[0] / 1e3)
        seen.append(live.curve())
    assert seen[0] == POISONED  # the prior counts as two forwards: one forward does not move it
    half = (1 + TRUE[0] / POISONED[1]) / 2  # halfway (the ratio of the prior and the forwards)
    assert _close(seen[1], {n: half * ms for n, ms in POISONED.items()})
    assert _close(seen[2], {n: TRUE[0] / TRUE[1] * ms for n, ms in want.items()}, 2e-3)
    assert live.forward_ms(0) == TRUE[0]
    for _ in range(3):  # a tree size too: the unobserved sizes follow its ratio as well
        live.observe(9, TRUE[8] / 1e3)
    assert _close(live.curve(), want, 2e-2)  # (the prior had 0 and 1 node alike: 70 vs 71 ms)
    assert all(live.curve()[n] == want[n] for n in (8, 16, 32, 64))


def test_unobserved_buckets_take_the_ratio_of_their_nearest_observed_ones() -> None:
    live = LiveCost(POISONED)
    for _ in range(3):
        live.observe(1, 0.5 * POISONED[1] / 1e3)  # N = 0: half the prior
        live.observe(17, 0.8 * POISONED[16] / 1e3)  # N = 16: 0.8 of it
    c = live.curve()
    assert c[16] == pytest.approx(0.8 * POISONED[16], rel=1e-3)
    assert c[32] == pytest.approx(0.8 * POISONED[32], rel=1e-3)  # past the last observed: its ratio
    assert c[64] == pytest.approx(0.8 * POISONED[64], rel=1e-3)
    for n in (1, 2, 4, 8):  # between: interpolated on the log-rows scale, strictly between the two
        assert 0.5 * POISONED[n] < c[n] < 0.8 * POISONED[n]


def test_a_prefill_forward_moves_only_its_own_region() -> None:
    live = LiveCost(POISONED)
    before, before_40 = live.curve(), live.forward_ms(40)
    for _ in range(3):
        live.observe(300, 10 * live.prior_ms(299) / 1e3)  # a 300-row prefill chunk, 10x the prior
    assert live.curve() == before and live.forward_ms(40) == before_40 and live.forward_ms(0) == before[1]
    assert live.forward_ms(256) == pytest.approx(10 * live.prior_ms(256), rel=1e-3)
    assert live.forward_ms(1023) == pytest.approx(
        10 * live.prior_ms(1023), rel=1e-3
    )  # unobserved, same region
    for _ in range(3):  # tree rounds then correct the tree region, and prefills keep their own ratio
        live.observe(9, 0.5 * POISONED[8] / 1e3)
    assert live.curve()[64] == pytest.approx(0.5 * POISONED[64], rel=1e-3)
    assert live.forward_ms(256) == pytest.approx(10 * live.prior_ms(256), rel=1e-3)


def test_one_slow_forward_in_a_window_does_not_move_the_curve() -> None:
    live = LiveCost(POISONED)
    for _ in range(WINDOW - 1):
        live.observe(9, TRUE[8] / 1e3)
    steady = live.curve()
    live.observe(9, 5 * TRUE[8] / 1e3)  # a forward that shared the cores with something else
    assert live.curve() == steady
    assert steady[8] == TRUE[8]
    fresh = LiveCost(POISONED)  # settled after three forwards, one of them slow: the other two's
    for slow in (1, 5, 1):
        fresh.observe(9, slow * TRUE[8] / 1e3)
    assert fresh.curve()[8] == TRUE[8]


def test_a_change_in_the_machines_speed_is_followed_within_five_forwards() -> None:
    live = LiveCost(POISONED)
    for _ in range(WINDOW):
        live.observe(9, TRUE[8] / 1e3)
    for i in range(WINDOW // 2):
        assert live.curve()[8] == TRUE[8], i
        live.observe(9, 2 * TRUE[8] / 1e3)
    live.observe(9, 2 * TRUE[8] / 1e3)  # the fifth: most of the window
    assert live.curve()[8] == 2 * TRUE[8]


def test_the_curve_stays_non_decreasing_and_usable_under_any_observations() -> None:
    rng = random.Random(0)
    live = LiveCost(POISONED)
    for _ in range(400):
        rows = rng.choice([1, 2, 5, 9, 17, 27, 33, 65, 130, 512])
        live.observe(rows, rng.uniform(0.0005, 3.0))
        snap = live.snapshot
        assert list(snap.nodes) == sorted(snap.nodes)
        assert all(a <= b for a, b in itertools.pairwise(snap.ms))
        curve = live.curve()
        assert cost_curve_error(curve) is None and sorted(curve) == list(DEFAULT_NODES)
        assert all(curve[a] <= curve[b] for a, b in itertools.pairwise(DEFAULT_NODES))
    live.observe(0, 1.0)  # ignored: no rows, or no time
    live.observe(3, float("nan"))
    live.observe(3, 0.0)
    assert live.forwards == 400


@pytest.mark.parametrize("other_rows", [0, 1, 9, 27, 500, 10**6])
def test_verdict_maps_are_valid_cost_maps(other_rows: int) -> None:
    live = LiveCost(POISONED)
    for rows in (1, 9, 9, 9, 40):
        live.observe(rows, rows * 1e-3)
    forward, marginal = live.verdict_maps(other_rows)
    assert tuple(forward) == tuple(marginal) == VERDICT_NODES
    assert cost_curve_error(forward, allow_zero=True) is None
    assert cost_curve_error(marginal, allow_zero=True) is None
    for n in VERDICT_NODES:
        assert MIN_MARGINAL_MS <= marginal[n] <= forward[n] or other_rows == 0
        assert forward[n] == live.forward_ms(n, other_rows)
        assert marginal[n] == live.marginal_ms(n, other_rows)
    if other_rows == 0:  # alone: the round is the whole forward
        assert marginal == forward
    else:  # beside others: what its rows add to their forward
        assert forward[8] == pytest.approx(live.forward_ms(other_rows - 1) + marginal[8], abs=2e-3)


def test_verdict_maps_reach_only_as_far_as_the_curve() -> None:
    assert tuple(LiveCost({1: 1.0}).verdict_maps()[0]) == (0, 1)
    assert tuple(LiveCost({1: 2.0, 2: 3.0}).verdict_maps()[0]) == (0, 1, 2)
    flat = LiveCost({1: 1e-9})  # tinier than a client can be told: still > 0
    f, m = flat.verdict_maps(5)
    assert cost_curve_error(f, allow_zero=True) is None and cost_curve_error(m, allow_zero=True) is None
    with pytest.raises(ValueError):
        LiveCost({})
    with pytest.raises(ValueError):
        LiveCost({1: float("nan")})


def test_readers_on_other_threads_always_see_a_whole_curve() -> None:
    live = LiveCost(POISONED)
    stop = threading.Event()
    bad: list[object] = []

    def read() -> None:
        while not stop.is_set():
            c = live.curve()
            f, m = live.verdict_maps(9)
            f = {**f, **m}
            if (
                cost_curve_error(c)
                or cost_curve_error(f, allow_zero=True)
                or sorted(c) != list(DEFAULT_NODES)
            ):
                bad.append(c)

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    rng = random.Random(1)
    for _ in range(2000):
        live.observe(rng.choice([1, 9, 300, 4000]), rng.uniform(0.001, 0.5))
    stop.set()
    for t in readers:
        t.join()
    assert not bad
    assert PRIOR_WEIGHT < WINDOW


# ------------------------------------------------------------------------------ the engine
def test_the_engine_expects_each_other_generation_to_feed_its_last_round_again() -> None:
    """Engine.other_rows (a verdict's maps are priced beside them): two generations with trees
    of 8 and 4 nodes after a packed step; each expects the other's row 0 + nodes; an idle session
    adds nothing, a prefill chunk counts as another chunk, and without batching nothing is shared."""

    async def main() -> None:
        t = tiny()
        e = Engine(t, t.new_kv_cache(256, 16), EngineConfig(gather_ms=0, prefill_chunk=16))
        e.live_cost = LiveCost(POISONED)
        seqs = []
        for seed, nodes in ((1, 8), (2, 4)):
            s = e.open(lambda r: None)
            toks = np.asarray(prompt_tokens(seed, 1), dtype=np.int32)
            tree = TokenTree.chain(list(range(100, 100 + nodes)), base=1)
            e.start(s, Prompt(toks, Mode.GREEDY, max_new_tokens=20, tree=tree), toks)
            seqs.append(s)
        idle = e.open(lambda r: None)
        long = e.open(lambda r: None)
        toks = np.asarray(prompt_tokens(3, 100), dtype=np.int32)
        e.start(long, Prompt(toks, Mode.GREEDY, max_new_tokens=4), toks)
        plan = e.runner.plan()
        e._note_rows(plan)
        e.runner.finish(e.runner.execute(plan), 0.01)
        a, b = seqs
        assert (a.status, b.status) == (SeqStatus.WAITING, SeqStatus.WAITING)
        assert long.status is SeqStatus.READY  # a prefill chunk ran: another follows
        assert e.other_rows(a.sid) == 5 + 16 and e.other_rows(b.sid) == 9 + 16
        assert e.other_rows(idle.sid) == 9 + 5 + 16
        forward, marginal = e.live_cost.verdict_maps(e.other_rows(a.sid))
        assert forward[8] == e.live_cost.forward_ms(8 + 21) and marginal[0] < forward[0]
        e.config = EngineConfig(batching=False)
        assert e.other_rows(a.sid) == 0

    asyncio.run(main())


# ------------------------------------------------------------------------------ the service
@pytest.fixture
def poisoned_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[int, float]:
    """A start-up curve in the cost cache (read back, not measured) that says every forward of
    `tiny` takes 5 s."""
    target = tiny()
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    target.model.prepare(False, False)  # as the service prepares a target handed to it
    path = model_store.cache_dir() / "cost" / f"{cost_cache_key(target, 0, DEFAULT_NODES, 64)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    curve = {n: 5000.0 + n for n in DEFAULT_NODES}
    path.write_text(json.dumps({"verify_cost_ms": {str(n): ms for n, ms in curve.items()}}))
    return curve


def _hello(sess: WsSession) -> Welcome:
    sess.ws.send_bytes(
        sess.proto.hello(Hello(vocab_fingerprint=tiny().vocab_fingerprint, features=(FEATURE_COST,)))
    )
    msg = sess.recv()
    assert isinstance(msg, Welcome), msg
    sess.welcome = msg
    return msg


def test_a_later_welcome_advertises_the_curve_refreshed_by_the_forwards_run(
    poisoned_cache: dict[int, float],
) -> None:
    """The first session is welcomed with the poisoned start-up curve; after its generation (a
    prefill and a dozen tree rounds of 8 nodes) a second session's welcome advertises what the
    forwards took, the engine's cost_ms and /metrics hold the same curve, and every verdict
    carries valid forward_ms / marginal_ms maps."""
    with service(measure_cost=True) as client:
        with WsSession(client) as first:
            assert _hello(first).verify_cost_ms == poisoned_cache
            prompt = prompt_tokens(3)
            rng = random.Random(3)
            ref = prompt + reference(tuple(prompt), 40)
            first.prompt(
                Prompt(tokens=np.array(prompt), max_new_tokens=40, tree=scripted_tree(rng, prompt, ref, 8))
            )
            verdicts: list[Verdict] = []
            while not (verdicts and verdicts[-1].done):
                msg = first.recv()
                assert isinstance(msg, Verdict), msg
                verdicts.append(msg)
                if not msg.done:
                    first.tree(scripted_tree(rng, list(first.proto.committed), ref, 8))
            for v in verdicts:
                assert v.forward_ms is not None and v.marginal_ms is not None
                assert tuple(v.forward_ms) == VERDICT_NODES
                assert cost_curve_error(v.forward_ms, allow_zero=True) is None
                assert cost_curve_error(v.marginal_ms, allow_zero=True) is None
            assert len(verdicts) >= 4
            last = verdicts[-1].forward_ms
            assert last is not None and max(last.values()) < 1000  # refreshed by the time it was sent
        state: AppState = client.app.state.verifier  # type: ignore[attr-defined]
        engine = state.engine
        assert engine is not None and engine.live_cost is not None
        with WsSession(client) as second:
            refreshed = _hello(second).verify_cost_ms
        assert sorted(refreshed) == list(DEFAULT_NODES)
        assert cost_curve_error(refreshed) is None
        assert max(refreshed.values()) < 1000  # tiny's forwards take a few ms, not 5 s
        assert engine.cost_ms == engine.live_cost.curve()
        assert engine.live_cost.forwards >= len(verdicts)
        text = client.get("/metrics").text
        assert f'cloud_verifier_verify_cost_ms{{nodes="8"}} {engine.cost_ms[8]}' in text
