"""The verifier's round gap (ms from a verdict to its session's next tree reaching the engine) in the
verdicts of a client that asks for it and in /metrics; the pending-tree limits of the default
configuration, advertised to a client that asks and enforced for every client."""

from __future__ import annotations

import re
import time

import msgpack
import numpy as np
import pytest

from cloud_verifier.server_config import ServerConfig
from shared.errors import ErrorCode
from shared.messages import FEATURES, Error, Hello, Mode, Prompt, Stale, Verdict, Welcome
from shared.tree import TokenTree
from tests.cloud_verifier.service import WsSession, prompt_tokens, reference, service, slow_forwards, tiny


def _hello(sess: WsSession, features: tuple[str, ...]) -> Welcome:
    sess.ws.send_bytes(sess.proto.hello(Hello(vocab_fingerprint=tiny().vocab_fingerprint, features=features)))
    w = sess.recv()
    assert isinstance(w, Welcome)
    return w


def _verdict(sess: WsSession) -> Verdict:
    while True:
        msg = sess.recv()
        if isinstance(msg, Stale):
            continue
        assert isinstance(msg, Verdict), msg
        return msg


def _histogram(metrics: str, name: str) -> tuple[float, float]:
    count = re.search(rf"^{name}_count (\S+)$", metrics, re.M)
    total = re.search(rf"^{name}_sum (\S+)$", metrics, re.M)
    assert count and total, metrics
    return float(count.group(1)), float(total.group(1))


def test_the_gap_is_the_wait_for_the_edge_in_verdicts_and_metrics() -> None:
    prompt = prompt_tokens(5)
    ref = prompt + reference(tuple(prompt), 40)
    with service() as client, WsSession(client) as sess:
        w = _hello(sess, FEATURES)
        assert w.limits.max_pending == ServerConfig().max_pending == 32
        assert w.limits.max_pending_bytes == ServerConfig().max_pending_bytes == 1 << 20
        sess.prompt(Prompt(tokens=np.array(prompt), mode=Mode.GREEDY, max_new_tokens=40))
        v0 = _verdict(sess)
        assert v0.round == 0 and v0.gap_ms is None  # the prompt's answer: no gap
        # a slow edge: 500 ms between the verdict and the next tree
        time.sleep(0.5)
        L = len(sess.proto.committed)
        r1 = sess.tree(TokenTree.chain(ref[L : L + 2], base=L))
        v1 = _verdict(sess)
        assert v1.round == r1 and v1.gap_ms is not None
        assert 500 <= v1.gap_ms < 10_000
        # round 2 and, right behind it, a tree for round 2's outcome: pending when round 2's verdict
        # is sent (or, on a fast verify, matching as it arrives), it starts at once
        L = len(sess.proto.committed)
        cond = ref[L : L + 3]  # round 2 accepts 2 reference tokens and its bonus is the third
        pending = TokenTree.chain(ref[L + 3 : L + 5], base=L, cond=cond)
        r2 = sess.tree(TokenTree.chain(ref[L : L + 2], base=L))
        r3 = sess.tree(pending)
        v2 = _verdict(sess)
        v3 = _verdict(sess)
        assert (v2.round, v3.round) == (r2, r3)
        assert v2.gap_ms is not None and v3.gap_ms is not None
        assert v3.gap_ms < 250  # started at once (or as soon as the tree arrived on loopback)
        sess.ws.send_bytes(sess.proto.cancel())
        while not _verdict(sess).done:
            pass
        count, total = _histogram(client.get("/metrics").text, "specdec_round_gap_seconds")
        assert count == 3  # rounds 1, 2, 3: a gap each (round 0 has none)
        assert total >= 0.5
        assert total * 1e3 == pytest.approx(v1.gap_ms + v2.gap_ms + v3.gap_ms, rel=1e-6, abs=1e-3)


def test_a_client_without_features_reads_the_frames_it_always_did() -> None:
    prompt = prompt_tokens(6)
    ref = prompt + reference(tuple(prompt), 20)
    with service() as client, WsSession(client) as sess:
        sess.ws.send_bytes(sess.proto.hello(Hello(vocab_fingerprint=tiny().vocab_fingerprint)))
        raw = sess.ws.receive_bytes()
        assert "max_pending_bytes" not in msgpack.unpackb(raw)["limits"]
        assert isinstance(sess.proto.receive(raw), Welcome)
        sess.prompt(Prompt(tokens=np.array(prompt), mode=Mode.GREEDY, max_new_tokens=20))
        frames = [sess.ws.receive_bytes()]
        sess.proto.receive(frames[-1])
        L = len(sess.proto.committed)
        sess.tree(TokenTree.chain(ref[L : L + 2], base=L))
        while True:
            frames.append(sess.ws.receive_bytes())
            msg = sess.proto.receive(frames[-1])
            if isinstance(msg, Verdict):
                break
        assert all("gap_ms" not in msgpack.unpackb(f) for f in frames)
        # the server measured the gap all the same
        count, _ = _histogram(client.get("/metrics").text, "specdec_round_gap_seconds")
        assert count == 1


def test_the_byte_bound_holds_for_every_client(monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = prompt_tokens(7)
    slow_forwards(monkeypatch, 0.3)  # round 0 in flight while the three trees arrive, whatever the load
    with service(max_pending_bytes=100) as client, WsSession(client) as sess:
        w = _hello(sess, ())
        assert w.limits.max_pending_bytes is None  # not advertised to a client that did not ask
        for _attempt in range(5):
            sess.prompt(Prompt(tokens=np.array(prompt), mode=Mode.GREEDY, max_new_tokens=20))
            # while round 0 is in flight, trees for outcomes two tokens ahead wait (~90-byte frames:
            # 100 bytes hold one); each is answered stale (its outcome did not happen) or refused
            first = sess.proto.last_round + 1
            for r in range(first, first + 3):
                sess.tree(TokenTree.chain([5] * 4, base=len(prompt), cond=[r % 100 + 10, 11]))
            answers: dict[int, Error | Stale] = {}
            while len(answers) < 3:
                msg = sess.recv()
                if isinstance(msg, Error | Stale):
                    assert msg.round is not None
                    answers[msg.round] = msg
            sess.ws.send_bytes(sess.proto.cancel())
            while not _verdict(sess).done:
                pass
            # a tree that arrives after round 0's verdict is stale (no outcome is pending any more), and
            # so is every tree after it: a race with the verifier, not a verdict on the bound; retry
            late = [isinstance(answers[r], Stale) for r in (first + 1, first + 2)]
            assert late != [True, False], answers  # stale, then refused: the frames' order was lost
            if any(late):
                continue
            assert isinstance(answers[first], Stale)
            for r in (first + 1, first + 2):
                e = answers[r]
                assert isinstance(e, Error) and e.code is ErrorCode.TOO_MANY_PENDING and not e.fatal
                assert "max_pending_bytes 100" in e.message
            return
        pytest.fail("round 0 was always answered before the trees reached the server")


def test_the_command_line_sets_the_bounds_and_refuses_a_byte_bound_below_one() -> None:
    from cloud_verifier.cli import build_parser

    a = build_parser().parse_args(["serve"])
    assert (a.max_pending, a.max_pending_bytes) == (32, 1 << 20)
    a = build_parser().parse_args(["serve", "--max-pending", "40", "--max-pending-bytes", "65536"])
    assert (a.max_pending, a.max_pending_bytes) == (40, 65536)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-pending-bytes", "0"])
