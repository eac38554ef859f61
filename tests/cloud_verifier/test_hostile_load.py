"""Hostile load against a live verifier: stochastic trees whose work must stay bounded, a client that
never reads, a frame flood, foreign origins, HTTP abuse, deeply nested frames, a stalled step
(readyz). Each slows or fails only its sender."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest

from shared.errors import ErrorCode
from shared.messages import Error, Mode, Prompt, Tree, Verdict, Welcome, encode
from shared.tree import TokenTree
from tests.cloud_verifier.hostile_helpers import _closed_with, _honest, _wait_idle
from tests.cloud_verifier.service import (
    AsyncSession,
    LiveServer,
    collect_verdicts,
    prompt_tokens,
    reference,
    tiny,
)


def _draw_tree(base: int, parents: list[int], draws_at: list[int], rows: list[list[int]]) -> Any:
    """A stochastic tree: node i (parent parents[i], token rows[qrow][0]) made by the draws whose
    node is i (draws_at lists each draw's node); one q row per parent, spread uniformly over its ids
    (the weights sum to 2^16)."""
    import numpy as np

    from shared.sparse import Q_TOTAL, SparseDist, SparseRows
    from shared.tree import Draws

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
