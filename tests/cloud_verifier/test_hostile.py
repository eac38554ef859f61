"""Hostile clients against a live verifier: each bad input fails alone, and a concurrent honest
session's output stays exactly the target's."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest

from cloud_verifier import step as step_module
from cloud_verifier import verify as verify_module
from cloud_verifier.verify import Algorithm
from shared.errors import ErrorCode
from shared.messages import Error, Mode, Prompt, Tree, Verdict, Welcome, encode
from shared.tree import TokenTree
from tests.cloud_verifier.service import (
    AsyncSession,
    LiveServer,
    collect_verdicts,
    prompt_tokens,
    reference,
    run_greedy_async,
    scripted_tree,
    tiny,
)
from tests.cloud_verifier.test_server import _q_tree

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
    p = Prompt(np.array(prompt), mode, temperature, 0, top_p, seed, n, tree=first)
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


async def _honest(url: str, prompt: list[int], n: int, seed: int) -> list[int]:
    """An honest greedy session beside the attacks (scripted trees); its tokens."""
    s = await AsyncSession.open(url)
    assert isinstance(await s.recv(), Welcome)
    out = await run_greedy_async(s, prompt, n, seed=seed, nodes=4)
    await s.close()
    return out


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

        async def main() -> tuple[list[list[int]], list[tuple[list[int], Error | None]]]:
            good = [asyncio.create_task(_honest(srv.ws, p, 40, i)) for i, p in enumerate(honest_prompts)]
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
    real_verify = verify_module.verify_tree

    def verify_tree(algorithm: Algorithm, tree: Any, logits: Any, params: Any, **kw: Any) -> Any:
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

    monkeypatch.setattr(step_module, "verify_tree", verify_tree)
    monkeypatch.setattr(model, "forward_packed", forward_packed)
    yield poison


def test_a_failing_round_fails_alone(poisoned: dict[str, int]) -> None:
    """A round whose verification or forward raises ends only its own session (INTERNAL, with the
    round); the honest sessions packed into the same steps finish with the target's exact tokens,
    and the engine stays ready."""
    honest_prompts = [prompt_tokens(300 + i, 16) for i in range(3)]
    with LiveServer() as srv:

        async def attacker(prompt: list[int], seed: int) -> tuple[list[int], Error | None]:
            await asyncio.sleep(0.05)  # join while the honest sessions are mid-generation
            return await _generate(srv.ws, prompt, 24, Mode.MATCH, 0.8, 1.0, seed, guess=[5] * 24)

        async def main() -> tuple[list[list[int]], list[tuple[list[int], Error | None]]]:
            good = [asyncio.create_task(_honest(srv.ws, p, 40, i)) for i, p in enumerate(honest_prompts)]
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
            await s.ws.send(
                s.proto.prompt(Prompt(np.array(prompt_tokens(1)), Mode.GREEDY, max_new_tokens=100))
            )
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
            await s.ws.send(s.proto.prompt(Prompt(np.array(prompt_tokens(2)), Mode.AR, max_new_tokens=60)))
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
            await s.ws.send(
                s.proto.prompt(Prompt(np.array(prompt_tokens(4, 200)), Mode.GREEDY, max_new_tokens=8))
            )
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
        sess.prompt(Prompt(np.array(prompt_tokens(6)), mode, 1.0, 0, 1.0, 3, 400))
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
            await s.ws.send(s.proto.prompt(Prompt(np.array(prompt_tokens(8)), Mode.AR, max_new_tokens=400)))
            await asyncio.sleep(3.0)  # not reading
            (sess,) = srv.state.sessions
            backlog = sess.outbox.qsize()
            out = await collect_verdicts(s)
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

        async def main() -> tuple[list[int], list[float], list[int]]:
            stop = time.monotonic() + 3.0
            floods = [asyncio.create_task(flood(stop)) for _ in range(8)]
            lat = asyncio.create_task(probe(stop))
            out = await _honest(srv.ws, prompt_tokens(9), 30, 3)
            return out, await lat, [await f for f in floods]

        out, lat, sent = asyncio.run(main())
        assert out == reference(tuple(prompt_tokens(9)), 30)
        lat.sort()
        assert lat[len(lat) // 2] < 0.5 and lat[-1] < 4.0, lat  # it was 1-2.8 s, and timeouts at 5 s
        assert sum(sent) > 8 * 200 * 3  # they did flood (more than the server would read)


def test_origin_check() -> None:
    """A browser page (it sends Origin) may connect only from --allowed-origins; clients that send
    no Origin (every non-browser client) are unaffected."""
    from websockets.asyncio.client import connect
    from websockets.typing import Origin

    with LiveServer(allowed_origins="https://app.example") as srv:

        async def main() -> tuple[Any, bool]:
            try:
                ws = await connect(srv.ws, origin=Origin("https://evil.example"))
                await asyncio.wait_for(ws.recv(), 5)
                refused = None
            except Exception as exc:
                refused = exc
            ok = await connect(srv.ws, origin=Origin("https://app.example"))
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
            await s.ws.send(s.proto.prompt(Prompt(np.array(prompt_tokens(12)), Mode.AR, max_new_tokens=3)))
            async with httpx.AsyncClient() as h:
                while (await h.get(srv.http + "/readyz")).status_code == 200:
                    assert time.monotonic() - t0 < 10, "still ready while the step hangs"
                    await asyncio.sleep(0.1)
            took = time.monotonic() - t0
            out = await collect_verdicts(s)
            await s.close()
            return took, out

        took, out = asyncio.run(main())
        assert took < 7.0
        assert out == reference(tuple(prompt_tokens(12)), 3)
        assert httpx.get(srv.http + "/readyz").status_code == 200


# ---------------------------------------------------------------- one frame of bad input per class
# (name, needs_prompt: False / True / "pending" / None for a foreign vocabulary, frame builder,
#  code, field, close code)
HostileCase = tuple[
    str, bool | str | None, Callable[[int], bytes] | None, ErrorCode | None, str | None, int | None
]

BAD_CASES: list[HostileCase] = [
    # (name, needs_prompt, frame builder (committed length -> bytes), code, field, close code or None)
    ("bad msgpack", False, lambda L: b"\xc1\x00", ErrorCode.BAD_FRAME, "frame", 1007),
    (
        "wrong types",
        False,
        lambda L: msgpack.packb({"type": "prompt", "tokens": [1, 2], "mode": "greedy"}),
        ErrorCode.BAD_MESSAGE,
        "tokens",
        1007,
    ),
    (
        "unknown type",
        False,
        lambda L: msgpack.packb({"type": "launch"}),
        ErrorCode.UNKNOWN_TYPE,
        "type",
        1007,
    ),
    (
        "tree before prompt",
        False,
        lambda L: encode(Tree(1, TokenTree.chain([1], base=1))),
        ErrorCode.BAD_ORDER,
        "type",
        None,
    ),
    (
        "mode not allowed",
        False,
        lambda L: encode(Prompt(tokens=np.array([1, 2]), mode=Mode.RRS, temperature=1.0)),
        ErrorCode.MODE_NOT_ALLOWED,
        "mode",
        None,
    ),
    (
        "prompt over max context",
        False,
        lambda L: encode(Prompt(tokens=np.array([5] * 600))),
        ErrorCode.CONTEXT_FULL,
        "tokens",
        None,
    ),
    (
        "id out of range",
        True,
        lambda L: encode(Tree(1, TokenTree.chain([49152], base=L))),
        ErrorCode.OUT_OF_RANGE,
        "tree.tokens",
        None,
    ),
    (
        "parent not earlier",
        True,
        lambda L: encode(Tree(1, TokenTree.build([1, 2], [-1, 1], base=L))),
        ErrorCode.BAD_TREE,
        "tree.parents",
        None,
    ),
    (
        "too many nodes",
        True,
        lambda L: encode(Tree(1, TokenTree.build(list(range(65)), [-1] * 65, base=L))),
        ErrorCode.LIMIT_EXCEEDED,
        "tree.tokens",
        None,
    ),
    (
        "draws in a deterministic mode",
        True,
        lambda L: encode(Tree(1, _q_tree(L, [5], [65536]))),
        ErrorCode.BAD_TREE,
        "tree.draws",
        None,
    ),
    (
        "round out of order",
        "pending",
        lambda L: encode(Tree(3, TokenTree.chain([1], base=L, cond=[9]))),
        ErrorCode.BAD_ORDER,
        "round",
        None,
    ),
    (
        "message over the limit",
        False,
        lambda L: encode(Prompt(tokens=np.array([1] * 20000))),
        None,
        None,
        1009,
    ),
    ("text frame", False, None, ErrorCode.BAD_FRAME, "frame", 1007),
    ("vocabulary mismatch", None, None, ErrorCode.VOCAB_MISMATCH, "vocab_fingerprint", 1008),
]


def _prompt_frame(**over: Any) -> bytes:
    """A valid prompt frame with some fields replaced (None: removed)."""
    d = msgpack.unpackb(encode(Prompt(tokens=np.array([1, 2, 3]), max_new_tokens=50)))
    for k, v in over.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    return bytes(msgpack.packb(d, use_bin_type=True))


def _tree_frame(L: int, **over: Any) -> bytes:
    d = msgpack.unpackb(encode(Tree(1, TokenTree.chain([1], base=L))))
    d.update(over)
    return bytes(msgpack.packb(d, use_bin_type=True))


def _i32(*xs: int) -> bytes:
    return np.asarray(xs, dtype="<i4").tobytes()


MORE_CASES: list[HostileCase] = [
    # frames that are not one well-formed msgpack map: fatal, close 1007
    ("trailing bytes", False, lambda L: msgpack.packb({"type": "cancel"}) + b"\x00", ErrorCode.BAD_FRAME, "frame", 1007),
    ("not a map", False, lambda L: msgpack.packb([1, 2]), ErrorCode.BAD_FRAME, "frame", 1007),
    ("deep nesting", False, lambda L: b"\x91" * 5000 + b"\xc0", ErrorCode.BAD_FRAME, "frame", 1007),
    ("huge declared string", False, lambda L: b"\x81\xa4type\xdb\xff\xff\xff\xffx", ErrorCode.BAD_FRAME, "frame", 1007),
    ("huge declared array", False, lambda L: b"\x81\xa4type\xdd\xff\xff\xff\xff", ErrorCode.BAD_FRAME, "frame", 1007),
    ("non-string key", False, lambda L: msgpack.packb({1: 2}), ErrorCode.BAD_FRAME, "frame", 1007),
    ("duplicate key", False, lambda L: b"\x82\xa4type\xa6cancel\xa4type\xa6cancel", ErrorCode.BAD_FRAME, "frame", 1007),
    ("extension type", False, lambda L: b"\x81\xa4type\xd4\x01\x00", ErrorCode.BAD_FRAME, "frame", 1007),
    # fields missing, unknown, of the wrong type or out of range: fatal, close 1007, the field named
    ("type not a string", False, lambda L: msgpack.packb({"type": 5}), ErrorCode.UNKNOWN_TYPE, "type", 1007),
    ("missing tokens", False, lambda L: _prompt_frame(tokens=None), ErrorCode.BAD_MESSAGE, "tokens", 1007),
    ("unknown field", False, lambda L: _prompt_frame(speed=1), ErrorCode.BAD_MESSAGE, "speed", 1007),
    ("unknown mode", False, lambda L: _prompt_frame(mode="turbo"), ErrorCode.BAD_MESSAGE, "mode", 1007),
    ("temperature too high", False, lambda L: _prompt_frame(temperature=1e5), ErrorCode.BAD_MESSAGE, "temperature", 1007),
    ("temperature NaN", False, lambda L: _prompt_frame(temperature=float("nan")), ErrorCode.BAD_MESSAGE, "temperature", 1007),
    ("top_p zero", False, lambda L: _prompt_frame(top_p=0.0), ErrorCode.BAD_MESSAGE, "top_p", 1007),
    ("top_k negative", False, lambda L: _prompt_frame(top_k=-1), ErrorCode.BAD_MESSAGE, "top_k", 1007),
    ("seed negative", False, lambda L: _prompt_frame(seed=-1), ErrorCode.BAD_MESSAGE, "seed", 1007),
    ("max_new_tokens zero", False, lambda L: _prompt_frame(max_new_tokens=0), ErrorCode.BAD_MESSAGE, "max_new_tokens", 1007),
    ("tokens not whole int32s", False, lambda L: _prompt_frame(tokens=b"\x01\x02\x03"), ErrorCode.BAD_MESSAGE, "tokens", 1007),
    ("too many stop ids", False, lambda L: _prompt_frame(stop_ids=_i32(*range(300))), ErrorCode.LIMIT_EXCEEDED, "stop_ids", 1007),
    ("round zero", True, lambda L: _tree_frame(L, round=0), ErrorCode.BAD_MESSAGE, "round", 1007),
    ("negative base", True, lambda L: _tree_frame(L, base=-1), ErrorCode.BAD_MESSAGE, "base", 1007),
    # content the protocol refuses: an error naming the field, the session goes on
    ("prompt id out of range", False, lambda L: encode(Prompt(tokens=np.array([49152]))), ErrorCode.OUT_OF_RANGE, "tokens", None),
    ("stop id out of range", False, lambda L: encode(Prompt(tokens=np.array([1]), stop_ids=(49152,))), ErrorCode.OUT_OF_RANGE, "stop_ids", None),
    ("empty prompt", False, lambda L: encode(Prompt(tokens=np.array([]))), ErrorCode.BAD_MESSAGE, "tokens", None),
    ("continue with no context", False, lambda L: encode(Prompt(tokens=np.array([1]), continue_=True)), ErrorCode.BAD_ORDER, "continue", None),
    ("prompt while generating", True, lambda L: encode(Prompt(tokens=np.array([1, 2]))), ErrorCode.BAD_ORDER, "type", None),
    ("depth over the limit", True, lambda L: encode(Tree(1, TokenTree.chain(list(range(1, 18)), base=L))), ErrorCode.LIMIT_EXCEEDED, "tree.parents", None),
    ("cond over the limit", True, lambda L: encode(Tree(1, TokenTree.chain([1], base=L - 1, cond=[7] * 69))), ErrorCode.LIMIT_EXCEEDED, "tree.cond", None),
    ("cond id out of range", True, lambda L: encode(Tree(1, TokenTree.chain([1], base=L - 1, cond=[49152]))), ErrorCode.OUT_OF_RANGE, "tree.cond", None),
    ("repeated siblings", True, lambda L: encode(Tree(1, TokenTree.build([5, 5], [-1, -1], base=L))), ErrorCode.BAD_TREE, "tree.tokens", None),
    ("parents shorter than tokens", True, lambda L: _tree_frame(L, tokens=_i32(1, 2), parents=_i32(-1)), ErrorCode.BAD_TREE, "tree.parents", None),
]  # fmt: skip

HOSTILE_CASES = BAD_CASES + MORE_CASES


def test_hostile_input_classes_hurt_nobody_else() -> None:
    """Each bad input gets the right error (naming the field); meanwhile /readyz stays 200 and a
    healthy session running concurrently on the same engine produces exactly the target's output."""
    healthy_prompt = prompt_tokens(77, 20)

    async def healthy(url: str) -> list[int]:
        s = await AsyncSession.open(url)
        assert isinstance(await s.recv(), Welcome)
        out = await run_greedy_async(s, healthy_prompt, 64, seed=5, nodes=4)
        await s.close()
        return out

    async def attack(url: str, http: str) -> list[str]:

        results = []
        for name, needs_prompt, frame, code, field, close in HOSTILE_CASES:
            if needs_prompt is None:  # hello with a foreign vocabulary
                s = await AsyncSession.open(url, fingerprint="0" * 64)
            else:
                s = await AsyncSession.open(url)
                assert isinstance(await s.recv(), Welcome)
            if needs_prompt:
                await s.ws.send(s.proto.prompt(Prompt(tokens=np.array([1, 2, 3]), max_new_tokens=50)))
                assert isinstance(await s.recv(), Verdict)
            if needs_prompt == "pending":  # round 7 waits as a conditional tree; round 3 comes after it
                await s.ws.send(
                    encode(Tree(7, TokenTree.chain([1], base=len(s.proto.committed), cond=[9, 9, 9])))
                )
            L = len(s.proto.committed)
            if frame is None and needs_prompt is False:
                await s.ws.send("not msgpack")  # a text frame
            elif frame is not None:
                await s.ws.send(frame(L))
            got: dict[str, Any] = {}
            if code is not None:
                err = msgpack.unpackb(await s.ws.recv())
                got = {k: err.get(k) for k in ("type", "code", "field", "fatal")}
                want = {"type": "error", "code": code.value, "field": field, "fatal": close is not None}
                if got != want:
                    wrong.append(f"{name}: {got} instead of {want}")
            if close is not None:
                try:
                    await asyncio.wait_for(s.ws.recv(), 5)
                    wrong.append(f"{name}: connection stayed open")
                except Exception as exc:  # ConnectionClosed
                    rcvd = getattr(exc, "rcvd", None)
                    if rcvd is None or rcvd.code != close:
                        wrong.append(f"{name}: closed with {rcvd} instead of {close}")
                    table.append((name, got.get("code"), got.get("field"), rcvd.code if rcvd else None))
            else:  # the session goes on: a valid round still works
                if needs_prompt:
                    await s.ws.send(encode(Tree(8, TokenTree.chain([1], base=len(s.proto.committed)))))
                    kinds = [msgpack.unpackb(await s.ws.recv())["type"]]
                    while kinds[-1] == "stale":
                        kinds.append(msgpack.unpackb(await s.ws.recv())["type"])
                    if kinds[-1] != "verdict":
                        wrong.append(f"{name}: the session did not go on ({kinds})")
                table.append((name, got.get("code"), got.get("field"), None))
            async with httpx.AsyncClient() as h:
                assert (await h.get(http + "/readyz")).status_code == 200, name
            await s.ws.close()
            results.append(name)
        return results

    with LiveServer(max_bytes=40_000, max_context=512) as srv:

        async def main() -> tuple[list[int], list[str]]:
            h = asyncio.create_task(healthy(srv.ws))
            names = await attack(srv.ws, srv.http)
            return await h, names

        wrong: list[str] = []
        table: list[tuple[str, Any, Any, Any]] = []
        out, names = asyncio.run(main())
        for row in table:  # the class -> reply table (pytest -s shows it)
            print(f"{row[0]:32s} {row[1] or '-':18s} {row[2] or '-':18s} {row[3] or 'session goes on'}")
        assert not wrong, "\n".join(wrong)
        assert out == reference(tuple(healthy_prompt), 64)
        assert len(names) == len(HOSTILE_CASES) >= 35
        _wait_idle(srv)
