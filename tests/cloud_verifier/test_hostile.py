"""Hostile clients against a live verifier: each bad input fails alone, and a concurrent honest
session's output stays exactly the target's (issue 18, items 4 and 5)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from cloud_verifier import engine as engine_module
from shared.errors import ErrorCode
from shared.messages import Error, Mode, Prompt, Tree, Verdict, Welcome
from tests.cloud_verifier.service import (
    AsyncSession,
    LiveServer,
    prompt_tokens,
    reference,
    run_greedy_async,
    scripted_tree,
    tiny,
)

# temperatures inside the protocol's range at which logits / T overflows (float32, and float64 too)
TINY_TEMPERATURES = (1e-300, 1e-45, 1e-38, 5e-324)


async def _generate(
    url: str,
    prompt: list[int],
    n: int,
    mode: Mode,
    temperature: float,
    top_p: float,
    seed: int,
    guess: list[int] | None = None,
) -> tuple[list[int], Error | None]:
    """One generation driven to its end (ar: token by token; match: trees scripted from `guess`,
    by default the target's greedy continuation)."""
    s = await AsyncSession.open(url)
    assert isinstance(await s.recv(), Welcome)
    rng = random.Random(seed)
    ref = prompt + (guess if guess is not None else reference(tuple(prompt), n))
    first = scripted_tree(rng, prompt, ref, 6) if mode is not Mode.AR else None
    p = Prompt(prompt, mode, temperature, 0, top_p, seed, n, tree=first)
    await s.ws.send(s.proto.prompt(p))
    out: list[int] = []
    try:
        while True:
            msg = await s.recv()
            if isinstance(msg, Error):
                return out, msg
            if not isinstance(msg, Verdict):
                continue
            out.extend(msg.tokens.tolist())
            if msg.done:
                return out, None
            if mode is not Mode.AR:
                s.round += 1
                tree = scripted_tree(rng, list(s.proto.committed), ref, 6)
                await s.ws.send(s.proto.tree(Tree(s.round, tree)))
    finally:
        await s.close()


def test_tiny_temperatures_sample_the_argmax_and_hurt_nobody() -> None:
    """The probe's attack: prompts at temperatures whose logits / T overflow (with and without top-p,
    in ar and match) used to turn the logits into NaN, fail the engine step and end every concurrent
    session with INTERNAL. Now each such generation is the greedy one (the T -> 0 limit) and the
    honest sessions sharing its steps are exactly the target's."""
    honest_prompts = [prompt_tokens(100 + i, 16) for i in range(3)]
    attacks = [
        (Mode.AR, 1e-300, 0.5),
        (Mode.MATCH, 1e-45, 0.9),
        (Mode.AR, 1e-38, 1.0),
        (Mode.MATCH, 5e-324, 1.0),
    ]
    with LiveServer() as srv:

        async def honest(prompt: list[int], seed: int) -> list[int]:
            s = await AsyncSession.open(srv.ws)
            assert isinstance(await s.recv(), Welcome)
            out = await run_greedy_async(s, prompt, 40, seed=seed, nodes=4)
            await s.close()
            return out

        async def main() -> tuple[list[list[int]], list[tuple[list[int], Error | None]]]:
            good = [asyncio.create_task(honest(p, i)) for i, p in enumerate(honest_prompts)]
            bad = [
                asyncio.create_task(_generate(srv.ws, prompt_tokens(200 + i), 24, m, t, tp, seed=i))
                for i, (m, t, tp) in enumerate(attacks)
            ]
            return [await g for g in good], [await b for b in bad]

        good, bad = asyncio.run(main())
        for p, out in zip(honest_prompts, good, strict=True):
            assert out == reference(tuple(p), 40)
        for i, (out, err) in enumerate(bad):
            assert err is None, (attacks[i], err)
            assert out == reference(tuple(prompt_tokens(200 + i)), 24), attacks[i]
        assert httpx.get(srv.http + "/readyz").status_code == 200


@pytest.fixture
def poisoned(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """A verifier bug that only one session's input triggers: verification raises for sessions
    seeded POISON, and the packed forward raises whenever a session feeds the token POISON."""
    poison = {"seed": 666, "token": 4242, "forward_failures": 0}
    real_verify = engine_module.verify_tree

    def verify_tree(algorithm: str, tree: Any, logits: Any, params: Any, **kw: Any) -> Any:
        if kw.get("seed") == poison["seed"]:
            raise RuntimeError("injected verification failure")
        return real_verify(algorithm, tree, logits, params, **kw)

    model = tiny().model
    real_forward = model.forward_packed

    def forward_packed(inputs: Any, kv: Any) -> Any:
        if any(int(poison["token"]) in inp.tokens.tolist() for inp in inputs):
            poison["forward_failures"] += 1
            raise RuntimeError("injected forward failure")
        return real_forward(inputs, kv)

    monkeypatch.setattr(engine_module, "verify_tree", verify_tree)
    monkeypatch.setattr(model, "forward_packed", forward_packed)
    yield poison


def test_a_failing_round_fails_alone(poisoned: dict[str, int]) -> None:
    """A round whose verification or forward raises ends only its own session (INTERNAL, with the
    round); the honest sessions packed into the same steps finish with the target's exact tokens,
    and the engine stays ready."""
    honest_prompts = [prompt_tokens(300 + i, 16) for i in range(3)]
    with LiveServer() as srv:

        async def honest(prompt: list[int], seed: int) -> list[int]:
            s = await AsyncSession.open(srv.ws)
            assert isinstance(await s.recv(), Welcome)
            out = await run_greedy_async(s, prompt, 40, seed=seed, nodes=4)
            await s.close()
            return out

        async def attacker(prompt: list[int], seed: int) -> tuple[list[int], Error | None]:
            await asyncio.sleep(0.05)  # join while the honest sessions are mid-generation
            return await _generate(srv.ws, prompt, 24, Mode.MATCH, 0.8, 1.0, seed, guess=[5] * 24)

        async def main() -> tuple[list[list[int]], list[tuple[list[int], Error | None]]]:
            good = [asyncio.create_task(honest(p, i)) for i, p in enumerate(honest_prompts)]
            bad = [
                asyncio.create_task(attacker(prompt_tokens(400), poisoned["seed"])),
                asyncio.create_task(attacker([*prompt_tokens(401, 8), poisoned["token"]], 7)),
            ]
            return [await g for g in good], [await b for b in bad]

        good, bad = asyncio.run(main())
        for p, out in zip(honest_prompts, good, strict=True):
            assert out == reference(tuple(p), 40)
        for out, err in bad:
            assert out == [] and err is not None
            assert err.code == ErrorCode.INTERNAL and err.round == 0, err
        assert poisoned["forward_failures"] >= 1
        assert httpx.get(srv.http + "/readyz").status_code == 200


def _closed_with(sess: AsyncSession) -> Any:
    """Wait for the server to close the connection; returns its close frame (code, reason)."""

    async def wait() -> Any:
        try:
            while True:
                await asyncio.wait_for(sess.ws.recv(), 10)
        except Exception as exc:  # ConnectionClosed
            return getattr(exc, "rcvd", None)

    return wait()


def test_idle_timeout_closes_a_session_that_went_silent_mid_generation() -> None:
    """hello + a greedy prompt, then silence: the verdict goes out, no tree comes back, and the
    session is closed (1001) after the idle timeout instead of holding its slot and KV forever."""
    with LiveServer(idle_timeout_s=0.5) as srv:

        async def main() -> Any:
            s = await AsyncSession.open(srv.ws)
            assert isinstance(await s.recv(), Welcome)
            await s.ws.send(s.proto.prompt(Prompt(prompt_tokens(1), Mode.GREEDY, max_new_tokens=100)))
            assert isinstance(await s.recv(), Verdict)
            return await _closed_with(s)

        rcvd = asyncio.run(main())
        assert rcvd is not None and rcvd.code == 1001 and "idle" in rcvd.reason
        _wait_idle(srv)


def test_an_ar_stream_is_not_idle() -> None:
    """A client that only reads (mode ar sends nothing after the prompt) is never idle while the
    engine works for it."""
    with LiveServer(idle_timeout_s=0.2) as srv:

        async def main() -> list[int]:
            s = await AsyncSession.open(srv.ws)
            assert isinstance(await s.recv(), Welcome)
            await s.ws.send(s.proto.prompt(Prompt(prompt_tokens(2), Mode.AR, max_new_tokens=60)))
            out: list[int] = []
            while True:
                v = await s.recv()
                assert isinstance(v, Verdict)
                out.extend(v.tokens.tolist())
                await asyncio.sleep(0.01)  # a slow reader: the stream outlasts the idle timeout
                if v.done:
                    await s.close()
                    return out

        assert asyncio.run(main()) == reference(tuple(prompt_tokens(2)), 60)


def test_silent_connections_take_no_session_slot() -> None:
    """64 WebSockets that never say hello: an honest client still gets a session, and the silent
    ones are closed (1008) at the hello deadline."""
    with LiveServer(max_sessions=2, max_handshakes=80, hello_timeout_s=1.0) as srv:

        async def main() -> tuple[list[int], list[Any]]:
            from websockets.asyncio.client import connect

            silent = [await connect(srv.ws) for _ in range(64)]
            s = await AsyncSession.open(srv.ws)
            assert isinstance(await s.recv(), Welcome)
            out = await run_greedy_async(s, prompt_tokens(3), 20, seed=1, nodes=4)
            await s.close()
            closes = []
            for ws in silent:
                try:
                    await asyncio.wait_for(ws.recv(), 10)
                except Exception as exc:
                    closes.append(getattr(exc, "rcvd", None))
            return out, closes

        out, closes = asyncio.run(main())
        assert out == reference(tuple(prompt_tokens(3)), 20)
        assert all(c is not None and c.code == 1008 and "hello" in c.reason for c in closes), closes[:3]


def test_kv_full_answers_a_prompt_once() -> None:
    """A prompt that does not fit the KV pool gets one BUSY error (round 0) and no verdict after
    it; the session stays usable for a prompt that fits."""
    with LiveServer(kv_blocks=8, block_size=16) as srv:

        async def main() -> tuple[Any, list[int]]:
            s = await AsyncSession.open(srv.ws)
            assert isinstance(await s.recv(), Welcome)
            await s.ws.send(s.proto.prompt(Prompt(prompt_tokens(4, 200), Mode.GREEDY, max_new_tokens=8)))
            err = await s.recv()
            out = await run_greedy_async(s, prompt_tokens(5, 10), 20, seed=2, nodes=4)
            await s.close()
            return err, out

        err, out = asyncio.run(main())
        assert isinstance(err, Error) and err.code == ErrorCode.BUSY and err.round == 0 and not err.fatal
        assert out == reference(tuple(prompt_tokens(5, 10)), 20)


def _wait_idle(srv: LiveServer) -> None:
    import time

    deadline = time.monotonic() + 5
    while srv.engine.seqs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not srv.engine.seqs and srv.engine.kv.blocks_in_use == 0


def _draw_tree(base: int, parents: list[int], draws_at: list[int], rows: list[list[int]]) -> Any:
    """A stochastic tree: node i (parent parents[i], token rows[qrow][0]) made by the draws whose
    node is i (draws_at lists each draw's node); one q row per parent, spread uniformly over its ids
    (the weights sum to 2^16)."""
    import numpy as np

    from shared.sparse import Q_TOTAL, SparseDist, SparseRows
    from shared.tree import Draws, TokenTree

    dists = []
    for ids in rows:
        w = np.full(len(ids), Q_TOTAL // len(ids), dtype=np.int64)
        w[: Q_TOTAL - int(w.sum())] += 1
        dists.append(SparseDist.from_weights(sorted(ids), w.tolist()))
    q = SparseRows.from_rows(dists)
    row_of_parent = {p: r for r, p in enumerate(dict.fromkeys(parents))}
    node = np.asarray(draws_at, dtype=np.int32)
    qrow = np.asarray([row_of_parent[parents[i]] for i in draws_at], dtype=np.int32)
    tokens = [sorted(rows[row_of_parent[p]])[k] for k, p in _rank(parents)]  # k-th child: k-th id
    d = Draws(node, np.zeros(node.size, np.int32), qrow, q)
    return TokenTree.build(tokens, parents, base=base, draws=d)


def _rank(parents: list[int]) -> list[tuple[int, int]]:
    seen: dict[int, int] = {}
    out = []
    for p in parents:
        out.append((seen.get(p, 0), p))
        seen[p] = seen.get(p, 0) + 1
    return out


@pytest.mark.parametrize("mode", [Mode.MSS, Mode.RRS])
def test_the_work_of_a_stochastic_tree_is_bounded(mode: Mode) -> None:
    """Draws per tree, draws at one parent, q ids in all and in one row: each at its limit is
    verified, one past it is refused (LIMIT_EXCEEDED naming the field, non-fatal) before any work;
    the probe's 50,000-draw tree (which made the verifier try to allocate ~162 GB) is one of them.
    The limits are advertised in welcome.limits."""
    from shared.messages import Tree, encode
    from shared.tree import DrawLimits
    from tests.cloud_verifier.service import WsSession, service

    lim = DrawLimits()
    wide = list(range(10, 10 + lim.max_row_draws))
    cases: list[tuple[str, list[int], list[int], list[list[int]], str | None]] = [
        # name, parents, draw nodes, q rows (one per distinct parent), the field refused (None: ok)
        ("row draws at the limit", [-1] * len(wide), list(range(len(wide))), [wide], None),
        ("one row draw over", [-1] * (len(wide) + 1), list(range(len(wide) + 1)), [[*wide, 99]], "node"),
        ("q row at the limit", [-1], [0], [list(range(5, 5 + lim.max_q_row))], None),
        ("q row one over", [-1], [0], [list(range(5, 6 + lim.max_q_row))], "q_ptr"),
        (
            "q ids one over",
            list(range(-1, 4)),
            list(range(5)),
            [list(range(5, 5 + lim.max_q_row))] * 4 + [list(range(5, 6 + lim.max_q_ids - 4 * lim.max_q_row))],
            "q_ids",
        ),
        ("50,000 draws at one node", [-1], [0] * 50_000, [[7]], "node"),
    ]
    with service(trust_anonymous=True, max_nodes=64, max_depth=16) as client, WsSession(client) as sess:
        welcome = sess.hello()
        assert isinstance(welcome, Welcome)
        assert welcome.limits.draws == lim
        sess.prompt(Prompt(prompt_tokens(6), mode, 1.0, 0, 1.0, 3, 400))
        assert isinstance(sess.recv(), Verdict)
        for name, parents, draws_at, rows, fld in cases:
            if mode is Mode.RRS and len(set(draws_at)) != len(draws_at):
                continue  # rrs draws at one node repeat a token: refused for another reason
            tree = _draw_tree(len(sess.proto.committed), parents, draws_at, rows)
            if fld is None:
                sess.tree(tree)
                msg = sess.recv()
                assert isinstance(msg, Verdict), (name, msg)
            else:  # past the client protocol, which would send it, straight onto the socket
                r = sess.proto.last_round + 1
                sess.send_raw(encode(Tree(r, tree)))
                sess.proto.last_round = r
                msg = sess.recv()
                assert isinstance(msg, Error), (name, msg)
                assert msg.code == ErrorCode.LIMIT_EXCEEDED and msg.field == f"tree.draws.{fld}", (name, msg)
                assert not msg.fatal
        assert client.get("/readyz").status_code == 200


def test_a_client_that_never_reads_is_held_back() -> None:
    """An ar stream whose client never reads: the server pauses the stream once OUTBOX_HIGH replies
    wait unread (it used to queue every token: 201k frames in 35 s), and finishes it exactly when the
    client reads again."""
    from cloud_verifier.session import OUTBOX_HIGH

    with LiveServer() as srv:

        async def main() -> tuple[int, list[int]]:
            from websockets.asyncio.client import connect

            # a tiny client-side buffer, so the server's socket fills quickly
            s = AsyncSession(await connect(srv.ws, max_size=None, max_queue=1))
            await s.ws.send(s.proto.hello(_hello()))
            assert isinstance(await s.recv(), Welcome)
            await s.ws.send(s.proto.prompt(Prompt(prompt_tokens(8), Mode.AR, max_new_tokens=400)))
            await asyncio.sleep(3.0)  # not reading
            (sess,) = srv.state.sessions
            backlog = sess.outbox.qsize()
            out: list[int] = []
            while True:
                v = await s.recv()
                assert isinstance(v, Verdict)
                out.extend(v.tokens.tolist())
                if v.done:
                    break
            await s.close()
            return backlog, out

        backlog, out = asyncio.run(main())
        assert backlog <= OUTBOX_HIGH + 1
        assert out == reference(tuple(prompt_tokens(8)), 400)
        _wait_idle(srv)


def _hello() -> Any:
    from shared.messages import Hello

    return Hello(vocab_fingerprint=tiny().vocab_fingerprint)


def test_a_frame_flood_slows_only_its_sender() -> None:
    """Eight connections push small frames as fast as they can for 3 s (each an error reply's worth of
    work): /healthz keeps answering fast and an honest generation stays exact, because each
    connection is read at most frames_per_s."""
    import time

    with LiveServer(frames_per_s=200.0, max_sessions=16) as srv:

        async def flood(stop: float) -> int:
            s = await AsyncSession.open(srv.ws)
            assert isinstance(await s.recv(), Welcome)
            junk = b"\x81\xa4type\xa6cancel"  # a cancel with no generation: BAD_ORDER each time
            sent = 0
            try:
                while time.monotonic() < stop:
                    await s.ws.send(junk)
                    sent += 1
                    if sent % 50 == 0:
                        await asyncio.sleep(0)
            except Exception:
                pass  # closed by the server (also fine: it is its own connection)
            await s.close()
            return sent

        async def probe(stop: float) -> list[float]:
            lat = []
            async with httpx.AsyncClient() as h:
                while time.monotonic() < stop:
                    t0 = time.perf_counter()
                    assert (await h.get(srv.http + "/healthz", timeout=5)).status_code == 200
                    lat.append(time.perf_counter() - t0)
                    await asyncio.sleep(0.05)
            return lat

        async def honest() -> list[int]:
            s = await AsyncSession.open(srv.ws)
            assert isinstance(await s.recv(), Welcome)
            out = await run_greedy_async(s, prompt_tokens(9), 30, seed=3, nodes=4)
            await s.close()
            return out

        async def main() -> tuple[list[int], list[float], list[int]]:
            stop = time.monotonic() + 3.0
            floods = [asyncio.create_task(flood(stop)) for _ in range(8)]
            lat = asyncio.create_task(probe(stop))
            out = await honest()
            return out, await lat, [await f for f in floods]

        out, lat, sent = asyncio.run(main())
        assert out == reference(tuple(prompt_tokens(9)), 30)
        lat.sort()
        assert lat[len(lat) // 2] < 0.25 and lat[-1] < 2.0, lat
        assert sum(sent) > 8 * 200 * 3  # they did flood (more than the server would read)


def test_origin_check() -> None:
    """A browser page (it sends Origin) may connect only from --allowed-origins; clients that send
    no Origin (every non-browser client) are unaffected."""
    from websockets.asyncio.client import connect

    with LiveServer(allowed_origins="https://app.example") as srv:

        async def main() -> tuple[Any, bool]:
            try:
                ws = await connect(srv.ws, origin="https://evil.example")  # type: ignore[arg-type]
                await asyncio.wait_for(ws.recv(), 5)
                refused = None
            except Exception as exc:
                refused = exc
            ok = await connect(srv.ws, origin="https://app.example")  # type: ignore[arg-type]
            await ok.send(AsyncSession(ok).proto.hello(_hello()))
            good = msgpack_type(await ok.recv()) == "welcome"
            await ok.close()
            return refused, good

        refused, good = asyncio.run(main())
        assert refused is not None and good


def msgpack_type(frame: Any) -> str:
    import msgpack

    return str(msgpack.unpackb(frame)["type"])


def test_http_abuse_slow_headers_huge_headers_and_a_bad_body() -> None:
    """Request headers that never finish are cut at the header deadline (they were held forever),
    1 MiB of headers is refused, and the session endpoint and /readyz keep serving meanwhile."""
    import socket
    import time

    with LiveServer(header_timeout_s=0.5) as srv:
        port = srv.port
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        t0 = time.monotonic()
        slow.settimeout(5)
        assert slow.recv(100) == b""  # closed by the server
        assert time.monotonic() - t0 < 3
        idle = socket.create_connection(("127.0.0.1", port))  # opens and says nothing at all
        idle.settimeout(5)
        assert idle.recv(100) == b""
        big = socket.create_connection(("127.0.0.1", port))
        big.settimeout(5)
        try:
            big.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
        except OSError:
            pass  # the server may close before all of it is written
        reply = b""
        try:
            reply = big.recv(200)
        except OSError:
            pass
        assert not reply.startswith(b"HTTP/1.1 200"), reply
        for s in (slow, idle, big):
            s.close()
        assert httpx.get(srv.http + "/readyz").status_code == 200
        r = httpx.post(
            srv.http + "/v1/completions", content=b"[1, 2", headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_a_deeply_nested_frame_is_closed_with_a_reason() -> None:
    """msgpack's nesting error has no message; the close reason still says what was wrong."""
    with LiveServer() as srv:

        async def main() -> Any:
            s = await AsyncSession.open(srv.ws)
            assert isinstance(await s.recv(), Welcome)
            await s.ws.send(b"\x91" * 5000 + b"\xc0")
            return await _closed_with(s)

        rcvd = asyncio.run(main())
        assert rcvd is not None and rcvd.code == 1007 and "nested too deeply" in rcvd.reason, rcvd


def test_readyz_fails_fast_when_a_step_stalls(monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward that hangs (here: sleeps 12 s) turns /readyz to 503 within ~5 s, and back to 200
    once the step is over."""
    import time

    model = tiny().model
    real = model.forward_packed
    hang = {"on": False}

    def forward_packed(inputs: Any, kv: Any) -> Any:
        if hang["on"]:
            hang["on"] = False
            time.sleep(12)
        return real(inputs, kv)

    monkeypatch.setattr(model, "forward_packed", forward_packed)
    with LiveServer() as srv:

        async def main() -> tuple[float, list[int]]:
            s = await AsyncSession.open(srv.ws)
            assert isinstance(await s.recv(), Welcome)
            hang["on"] = True
            t0 = time.monotonic()
            await s.ws.send(s.proto.prompt(Prompt(prompt_tokens(12), Mode.AR, max_new_tokens=3)))
            async with httpx.AsyncClient() as h:
                while (await h.get(srv.http + "/readyz")).status_code == 200:
                    assert time.monotonic() - t0 < 10, "still ready while the step hangs"
                    await asyncio.sleep(0.1)
            took = time.monotonic() - t0
            out: list[int] = []
            while True:
                v = await s.recv()
                assert isinstance(v, Verdict)
                out.extend(v.tokens.tolist())
                if v.done:
                    break
            await s.close()
            return took, out

        took, out = asyncio.run(main())
        assert took < 7.0
        assert out == reference(tuple(prompt_tokens(12)), 3)
        assert httpx.get(srv.http + "/readyz").status_code == 200
