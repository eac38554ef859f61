"""The verifier service end to end: sessions, batching, conditional trees, trust, limits, bad input."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import cast

import httpx
import numpy as np
import pytest
from fastapi import FastAPI

from shared.errors import ErrorCode
from shared.messages import Error, Hello, Mode, Prompt, Stale, Tree, Verdict, Welcome, encode
from shared.sparse import SparseDist, SparseRows
from shared.tree import Draws, TokenTree
from tests.cloud_verifier.service import (
    AsyncSession,
    LiveServer,
    WsSession,
    prompt_tokens,
    reference,
    run_greedy,
    run_greedy_async,
    scripted_tree,
    service,
    slow_forwards,
    tiny,
)


def _drain(sess: WsSession) -> list[int]:
    out: list[int] = []
    while True:
        v = sess.recv()
        if isinstance(v, Stale):
            continue
        assert isinstance(v, Verdict), v
        out.extend(v.tokens.tolist())
        if v.done:
            return out


def test_lifecycle_and_greedy_exactness() -> None:
    with service(measure_cost=True) as client:
        assert client.get("/healthz").json() == {"status": "alive"}
        with WsSession(client) as sess:
            w = sess.hello()
            assert isinstance(w, Welcome)
            assert w.model_id == "tiny" and w.vocab_size == 49152
            assert Mode.MSS not in w.allowed_modes  # no key file: untrusted
            assert sorted(w.verify_cost_ms) == [1, 2, 4, 8, 16, 32, 64]
            for seed in range(3):
                prompt = prompt_tokens(seed)
                out, verdicts = run_greedy(sess, prompt, 40, seed)
                assert out == reference(tuple(prompt), 40), f"seed {seed}"
                assert verdicts[0].round == 0 and verdicts[-1].done
                assert sum(len(v.tokens) for v in verdicts) == len(out)
        text = client.get("/metrics").text
        for name in (
            "specdec_num_drafts_total",
            "specdec_num_draft_tokens_total",
            "specdec_num_accepted_tokens_total",
            "specdec_num_accepted_tokens_per_pos_total",
            "specdec_tree_nodes_bucket",
            "specdec_accepted_length_bucket",
            "specdec_verify_forward_seconds_bucket",
            "specdec_round_seconds_bucket",
            "specdec_sessions",
            "specdec_kv_blocks_in_use",
            "specdec_conditional_tree_hits_total",
            "specdec_conditional_tree_stale_total",
            "specdec_conditional_trees_pending",
        ):
            assert name in text, name
        # vLLM's names for the same concepts, with its model_name label
        got = _samples(text)
        drafts = got['vllm:spec_decode_num_drafts_total{model_name="tiny"}']
        drafted = got['vllm:spec_decode_num_draft_tokens_total{model_name="tiny"}']
        accepted = got['vllm:spec_decode_num_accepted_tokens_total{model_name="tiny"}']
        assert drafts == got["specdec_num_drafts_total"] > 0
        assert 0 < accepted <= drafted == got["specdec_num_draft_tokens_total"]
        per_pos = sum(
            v for k, v in got.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_per_pos_total")
        )
        assert per_pos == accepted and 'position="0"' in text
        assert got['vllm:time_to_first_token_seconds_count{model_name="tiny"}'] == 3
        assert got['vllm:time_per_output_token_seconds_count{model_name="tiny"}'] == 3
        assert got['vllm:num_requests_running{model_name="tiny"}'] == 0
        assert 0 <= got['vllm:kv_cache_usage_perc{model_name="tiny"}'] < 1
        assert 'vllm:num_requests_waiting{model_name="tiny"}' in got


def _samples(text: str) -> dict[str, float]:
    """Prometheus text format: sample name with labels -> value."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_ar_mode_streams_one_token_per_verdict() -> None:
    with service() as client, WsSession(client) as sess:
        sess.hello()
        prompt = prompt_tokens(5)
        sess.prompt(Prompt(tokens=np.array(prompt), mode=Mode.AR, max_new_tokens=12))
        out = []
        while True:
            v = sess.recv()
            assert isinstance(v, Verdict) and len(v.tokens) == 1 and v.round == 0
            out.extend(v.tokens.tolist())
            if v.done:
                break
        assert out == reference(tuple(prompt), 12)
        assert v.reason == "length"


def test_continue_adds_a_turn_to_the_cached_context() -> None:
    with service() as client, WsSession(client) as sess:
        sess.hello()
        p1 = prompt_tokens(7)
        out1, _ = run_greedy(sess, p1, 10, 1)
        engine = cast(FastAPI, client.app).state.verifier.engine
        cached = engine.kv.cached_len(sess.proto.welcome_msg and int(sess.proto.welcome_msg.session_id))
        assert cached == len(p1) + len(out1) - 1  # everything but the last token stays cached
        turn = prompt_tokens(8, 5)
        sess.prompt(Prompt(tokens=np.array(turn), mode=Mode.AR, max_new_tokens=6, continue_=True))
        out2 = _drain(sess)
        full = p1 + out1 + turn
        assert out2 == reference(tuple(full), 6)
        assert sess.proto.committed == full + out2


def test_stop_ids_end_the_generation_on_the_server() -> None:
    prompt = prompt_tokens(11)
    ref = reference(tuple(prompt), 30)
    stop = ref[3]
    first = ref.index(stop)
    with service() as client, WsSession(client) as sess:
        sess.hello()
        rng = random.Random(0)
        sess.prompt(Prompt(tokens=np.array(prompt), mode=Mode.GREEDY, max_new_tokens=30, stop_ids=(stop,)))
        out = []
        while True:
            v = sess.recv()
            assert isinstance(v, Verdict)
            out.extend(v.tokens.tolist())
            if v.done:
                break
            sess.tree(scripted_tree(rng, list(sess.proto.committed), prompt + ref, 8))
        assert out == ref[: first + 1] and v.reason == "stop"


def test_conditional_tree_hit_needs_no_client_message(monkeypatch: pytest.MonkeyPatch) -> None:
    # the verifier takes 100 ms a forward (a sleep): `tiny` alone verifies round 1 in ~3 ms, and on a
    # loaded machine that was before the conditional tree's frame was read (a fresh-clone run saw
    # next_round None once); the tree must be pending while round 1 is in flight
    slow_forwards(monkeypatch, 0.1)
    prompt = prompt_tokens(21)
    ref = prompt + reference(tuple(prompt), 40)
    with service() as client, WsSession(client) as sess:
        sess.hello()
        sess.prompt(Prompt(tokens=np.array(prompt), mode=Mode.GREEDY, max_new_tokens=40))
        v0 = sess.recv()
        assert isinstance(v0, Verdict)
        L = len(sess.proto.committed)
        # round 1: the next 3 reference tokens, then a wrong one: accepts 3, bonus = ref[L + 3]
        chain = [*ref[L : L + 3], (ref[L + 3] + 1) % 49152]
        r1 = sess.tree(TokenTree.chain(chain, base=L))
        outcome = ref[L : L + 4]
        # while round 1 is in flight: a conditional tree for the right outcome and one for a wrong one
        hit = TokenTree.chain(ref[L + 4 : L + 7], base=L, cond=outcome)
        miss = TokenTree.chain(ref[L + 4 : L + 7], base=L, cond=[*ref[L : L + 2], 7])
        r2 = sess.tree(hit)
        r3 = sess.tree(miss)
        msgs = [sess.recv(), sess.recv()]
        stale = [m for m in msgs if isinstance(m, Stale)]
        v1 = next(m for m in msgs if isinstance(m, Verdict))
        assert stale and stale[0].round == r3
        assert v1.round == r1 and v1.tokens.tolist() == outcome and v1.next_round == r2
        # no message from the client in between: the hit tree's verdict just arrives
        v2 = sess.recv()
        assert isinstance(v2, Verdict) and v2.round == r2
        assert v2.tokens.tolist() == ref[L + 4 : L + 8]
        sess.ws.send_bytes(sess.proto.cancel())
        _drain(sess)
        metrics = client.get("/metrics").text
        assert "specdec_conditional_tree_hits_total 1.0" in metrics
        assert "specdec_conditional_tree_stale_total 1.0" in metrics


def test_disconnect_frees_kv() -> None:
    with service() as client:
        engine = cast(FastAPI, client.app).state.verifier.engine
        base_blocks = engine.kv.blocks_in_use
        with WsSession(client) as sess:
            sess.hello()
            run_greedy(sess, prompt_tokens(3, 40), 20, 3)
            assert engine.kv.blocks_in_use > base_blocks
        deadline = time.monotonic() + 5
        while engine.kv.blocks_in_use > base_blocks and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.kv.blocks_in_use == base_blocks
        assert not engine.seqs
        assert client.get("/readyz").status_code == 200


def _q_tree(base: int, tokens: list[int], weights: list[int]) -> TokenTree:
    q = SparseRows.from_rows(
        [
            SparseDist.from_weights(
                sorted(set(tokens)) if len(set(tokens)) == len(weights) else tokens, weights
            )
        ]
    )
    n = len(tokens)
    draws = Draws(np.arange(n, dtype=np.int32), np.zeros(n, np.int32), np.zeros(n, np.int32), q)
    return TokenTree.build(tokens, [-1] * n, base=base, draws=draws)


def test_trust_policy_with_a_key_file(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# comment\nk-trusted trusted\nk-plain\n")
    with service(api_key_file=str(keys)) as client:
        with WsSession(client) as sess:  # no key at all
            e = sess.hello()
            assert isinstance(e, Error) and e.code is ErrorCode.UNAUTHORIZED and e.fatal
        with WsSession(client, api_key="nope") as sess:
            e = sess.hello()
            assert isinstance(e, Error) and e.code is ErrorCode.UNAUTHORIZED
        with WsSession(client, api_key="k-plain") as sess:
            w = sess.hello()
            assert isinstance(w, Welcome) and Mode.MSS not in w.allowed_modes
            sess.send_raw(encode(Prompt(tokens=np.array(prompt_tokens(1)), mode=Mode.MSS, temperature=1.0)))
            e = sess.recv()
            assert isinstance(e, Error) and e.code is ErrorCode.MODE_NOT_ALLOWED and e.field == "mode"
        # the bearer token in the handshake works as well as hello.api_key
        with WsSession(client, headers={"Authorization": "Bearer k-trusted"}) as sess:
            w = sess.hello()
            assert isinstance(w, Welcome) and {Mode.MSS, Mode.RRS} <= set(w.allowed_modes)
            p = prompt_tokens(2)
            q_tree = _q_tree(len(p), [5, 9], [40000, 25536])
            sess.prompt(
                Prompt(tokens=np.array(p), mode=Mode.MSS, temperature=1.0, max_new_tokens=6, tree=q_tree)
            )
            v = sess.recv()
            assert isinstance(v, Verdict) and v.round == 0
            while not v.done:
                sess.tree(_q_tree(len(sess.proto.committed), [3, 4, 11], [20000, 20000, 25536]))
                v = sess.recv()
                assert isinstance(v, Verdict)
            assert len(sess.proto.committed) == len(p) + 6
            # malformed distributions: each an error naming the field, the session goes on
            sess.prompt(Prompt(tokens=np.array(p), mode=Mode.MSS, temperature=1.0, max_new_tokens=6))
            assert isinstance(sess.recv(), Verdict)
            L = len(sess.proto.committed)
            one = SparseRows(np.array([0, 1]), np.array([3], np.int32), np.array([65536], np.int64))
            zero_mass = TokenTree.build(
                [5],
                [-1],
                base=L,
                draws=Draws(np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32), one),
            )
            bad_sum = SparseRows(
                np.array([0, 2]), np.array([3, 5], np.int32), np.array([30000, 30000], np.int64)
            )
            short = TokenTree.build(
                [5],
                [-1],
                base=L,
                draws=Draws(np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32), bad_sum),
            )
            for bad, fld in ((zero_mass, "tree.draws.qrow"), (short, "tree.draws.q_weights")):
                sess.send_raw(encode(Tree(sess.proto.last_round + 1, bad)))
                sess.proto.last_round += 1
                e = sess.recv()
                assert isinstance(e, Error) and e.code is ErrorCode.BAD_DISTRIBUTION and e.field == fld, e
                assert not e.fatal
            # negative weights cannot be written: a weight travels as u16 (weight - 1)
            last: Verdict | None = None
            while last is None or not last.done:
                sess.tree(_q_tree(len(sess.proto.committed), [3, 4, 11], [20000, 20000, 25536]))
                got = sess.recv()
                assert isinstance(got, Verdict)
                last = got


def test_max_sessions_answers_try_again_later() -> None:
    with service(max_sessions=2) as client, WsSession(client) as a, WsSession(client) as b:
        a.hello()
        b.hello()
        with WsSession(client) as c:  # a slot is taken at hello (a silent connection holds none)
            c.ws.send_bytes(c.proto.hello(Hello(vocab_fingerprint=tiny().vocab_fingerprint)))
            msg = c.recv_raw()
            assert msg["type"] == "websocket.close" and msg["code"] == 1013


def test_idle_session_is_closed() -> None:
    with service(idle_timeout_s=0.3) as client, WsSession(client) as sess:
        sess.hello()
        msg = sess.recv_raw()
        assert msg["type"] == "websocket.close" and msg["code"] == 1001


# ------------------------------------------------------------------------------ live uvicorn


def test_16_concurrent_sessions_equal_16_serial_runs() -> None:
    prompts = [prompt_tokens(100 + i, 8 + i) for i in range(16)]

    async def one(url: str, i: int) -> list[int]:
        s = await AsyncSession.open(url)
        assert isinstance(await s.recv(), Welcome)
        out = await run_greedy_async(s, prompts[i], 24, seed=i)
        await s.close()
        return out

    with LiveServer(max_sessions=32) as srv:

        async def serial() -> list[list[int]]:
            return [await one(srv.ws, i) for i in range(16)]

        async def concurrent() -> list[list[int]]:
            return list(await asyncio.gather(*(one(srv.ws, i) for i in range(16))))

        serial_out = asyncio.run(serial())
        steps_before = srv.engine.steps
        concurrent_out = asyncio.run(concurrent())
        assert concurrent_out == serial_out
        assert serial_out == [reference(tuple(p), 24) for p in prompts]
        # batching really happened: far fewer engine steps than the serial run's rounds
        assert srv.engine.steps - steps_before < sum(len(o) for o in concurrent_out)
        assert "specdec_engine_step_sessions_bucket" in httpx.get(srv.http + "/metrics").text


def test_readyz_reports_loading_and_a_dead_engine() -> None:
    from dataclasses import replace

    from fastapi.testclient import TestClient

    from cloud_verifier.server import create_app
    from tests.cloud_verifier.service import BASE

    app = create_app(replace(BASE, model="tiny"))  # loads the model itself, in the background
    with TestClient(app) as client:
        r = client.get("/readyz")
        assert r.status_code == 503 and "loading" in r.json()["detail"]
        assert client.get("/healthz").status_code == 200  # alive while loading
        deadline = time.monotonic() + 120
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        engine = app.state.verifier.engine
        assert client.portal is not None
        client.portal.call(engine.stop)  # the engine loop is gone
        r = client.get("/readyz")
        assert r.status_code == 503 and "engine" in r.json()["detail"]
