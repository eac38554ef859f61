"""The TypeScript client (clients/typescript): its own tests (the protocol vectors, prompt lookup)
and, through its CLI against a live verifier, exactly the tokens of target-only decoding (greedy,
auto, seeded match). Skipped, saying why, on a machine without Node 20 and npm; the shared build,
CLI and fixtures are tests/clients/typescript_support.py's."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from tests.clients.typescript_support import PROMPT, TS, _auto_cli, _cli, _seeded_ar
from tests.cloud_verifier.service import LiveServer, reference, slow_forwards, tiny


def test_typescript_unit_tests_and_vectors(built: None) -> None:
    r = subprocess.run(["node", "--test", "dist/test/"], cwd=TS, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "# fail 0" in r.stdout and "# pass " in r.stdout


def test_greedy_through_the_typescript_client_equals_target_only(built: None) -> None:
    with LiveServer() as srv:
        out = _cli("--server", srv.ws, "--fingerprint", tiny().vocab_fingerprint,
                   "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "40")  # fmt: skip
    assert out["tokens"] == reference(tuple(PROMPT), 40)
    stats = out["stats"]
    assert isinstance(stats, dict) and stats["tokens"] == len(out["tokens"])


def test_auto_through_the_typescript_client_equals_ar(built: None) -> None:
    """Mode auto, the client's default (prompt lookup drafting): greedy output is the target's own
    under both objectives, and at T 0.9 (auto verifies match) exactly seeded ar's; the verifier
    honours round.stream, so the latency plan keeps a stream waiting behind its trees."""
    with LiveServer() as srv:
        for objective in ("latency", "cost"):
            out = _auto_cli(srv.ws, "--max-new-tokens", "40", "--objective", objective)
            assert out["tokens"] == reference(tuple(PROMPT), 40), objective
            st = out["stats"]
            assert isinstance(st, dict) and st["mode"] == "greedy" and st["tokens"] == 40, st
            if objective == "latency":
                assert st["streams"] >= 1, st
        seeded = _auto_cli(srv.ws, "--temperature", "0.9", "--seed", "77", "--max-new-tokens", "30")
        assert isinstance(seeded["stats"], dict) and seeded["stats"]["mode"] == "match"
        assert seeded["tokens"] == _seeded_ar(srv.ws)


def test_auto_speculates_as_before_against_a_verifier_without_streams(
    built: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verifier that does not honour round.stream (its welcome.features lacks it): auto sends no
    stream and keeps the output; one of an earlier release, which refuses hello.features, is spoken
    to again without them."""
    import shared.messages
    import shared.server_protocol
    from shared.messages import FEATURE_STREAM, FEATURES

    monkeypatch.setattr(shared.server_protocol, "FEATURES", tuple(f for f in FEATURES if f != FEATURE_STREAM))
    with LiveServer() as srv:
        out = _auto_cli(srv.ws, "--max-new-tokens", "40")
    assert out["tokens"] == reference(tuple(PROMPT), 40)
    assert isinstance(out["stats"], dict) and out["stats"]["streams"] == 0

    hello = shared.messages._DECODERS["hello"]

    def earlier(r: Any) -> Any:  # the decoder of a release before hello.features
        if r.has("features"):
            raise r.bad("features", "unknown field")
        return hello(r)

    monkeypatch.setitem(shared.messages._DECODERS, "hello", earlier)
    with LiveServer() as srv:
        old = _auto_cli(srv.ws, "--max-new-tokens", "40")
    assert old["tokens"] == reference(tuple(PROMPT), 40)
    assert isinstance(old["stats"], dict) and old["stats"]["streams"] == 0


def test_auto_trees_drafted_below_a_stream_are_re_rooted_and_keep_the_output(
    built: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the target streams, auto sends a tree drafted below the sequence it knows (no
    prediction of the streamed tokens); the verifier re-roots it below the tokens streamed meanwhile
    (PROTOCOL.md section 5) and verifies it instead of the next stream step, and the client checks
    the verdict's accepted nodes against the re-rooted tree it computes: greedy output stays the
    target's own and seeded match seeded ar's. 30 ms a forward, so the tree arrives mid-stream."""
    import shared.server_protocol

    slow_forwards(monkeypatch, 0.03)
    usable = shared.server_protocol.ServerProtocol._usable
    rerooted = []

    def counting(gen: Any, tree: Any) -> Any:
        u = usable(gen, tree)
        if u is not None and u is not tree:
            rerooted.append(len(u.cond) - len(tree.cond))
        return u

    monkeypatch.setattr(shared.server_protocol.ServerProtocol, "_usable", staticmethod(counting))
    with LiveServer() as srv:
        out = _auto_cli(srv.ws, "--max-new-tokens", "40")
        assert out["tokens"] == reference(tuple(PROMPT), 40)
        st = out["stats"]
        assert isinstance(st, dict) and st["aheadTrees"] >= 1 and st["hits"] >= 1, st
        assert rerooted and min(rerooted) >= 1, rerooted
        seeded = _auto_cli(srv.ws, "--temperature", "0.9", "--seed", "77", "--max-new-tokens", "30")
        assert seeded["tokens"] == _seeded_ar(srv.ws)


def test_seeded_match_through_the_typescript_client_equals_seeded_ar(built: None) -> None:
    with LiveServer() as srv:
        want = _seeded_ar(srv.ws)
        out = _cli("--server", srv.ws, "--fingerprint", tiny().vocab_fingerprint, "--prompt-ids",
                   ",".join(map(str, PROMPT)), "--mode", "match", "--temperature", "0.9", "--seed", "77",
                   "--max-new-tokens", "30")  # fmt: skip
        assert out["tokens"] == want
