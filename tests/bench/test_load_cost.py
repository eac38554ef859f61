"""bench.serving.load --cloud-cost (bench.serving.load_cost, with bench.lib.replay): scripts cut from frame
logs,
their replay against the real service on the tiny model (every verdict checked, cloud-only ar
reproducing the edge's tokens), and the flat verifier model (--flat-only: from a scripts file)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from bench.harness import load_suite
from bench.lib.replay import Script, Step, Tally, renumbered, replay_once, script_from_log
from bench.serving import load_cost
from bench.serving.load_cost import FlatRound, predict_flat
from edge_client.drafters.registry import create_drafter
from edge_client.transports import WebSocketTransport
from shared.messages import Hello, Mode, Prompt, Tree, Verdict, decode, encode
from shared.tree import TokenTree
from tests.cloud_verifier.service import LiveServer


def _tree(rnd: int) -> bytes:
    return encode(Tree(round=rnd, tree=TokenTree.build([4, 5, 6], [-1, 0, 1], base=3)))


def _verdict(rnd: int, tokens: list[int], done: bool = False) -> bytes:
    return encode(
        Verdict(rnd, np.array(tokens, dtype=np.int32), np.array([], dtype=np.int32), True, 3, done=done)
    )


PROMPT = encode(Prompt(np.array([1, 2, 3], dtype=np.int32), max_new_tokens=5))


def test_a_script_keeps_each_frame_with_its_cue_and_the_answered_tokens() -> None:
    log = [
        ("out", 0.0, _tree(99)),  # before the prompt: another generation's, ignored
        ("out", 1.0, PROMPT),
        ("in", 2.0, _verdict(0, [5, 6])),
        ("out", 2.3, _tree(1)),  # drafted after the first verdict: a miss path
        ("out", 2.5, _tree(2)),  # pre-speculated: left before round 1's verdict
        ("in", 4.0, _verdict(1, [7])),
        ("in", 5.0, _verdict(2, [8, 9], done=True)),
        ("out", 5.5, _tree(3)),  # after the done verdict: not the generation's
    ]
    s = script_from_log(log, 4)
    assert s.prompt_index == 4 and s.tokens == [5, 6, 7, 8, 9]
    assert s.verdicts == [(0, 2), (1, 1), (2, 2)]
    assert [(st.after, round(st.delay_s, 6)) for st in s.steps] == [(0, 0.0), (1, 0.3), (1, 0.5)]
    assert s.steps[0].frame == PROMPT and s.steps[2].frame == _tree(2)
    with pytest.raises(ValueError, match="no prompt"):
        script_from_log(log[:1], 0)


def test_replayed_rounds_move_above_the_sessions_last_round() -> None:
    s = Script(0, [Step(PROMPT, 0, 0.0), Step(_tree(5), 1, 0.1), Step(_tree(6), 1, 0.2)], [1, 2])
    frames, last = renumbered(s, 10)
    assert frames[0] == PROMPT and last == 12
    assert [decode(f).round for f in frames[1:]] == [11, 12]  # type: ignore[union-attr]
    assert renumbered(Script(0, [Step(PROMPT, 0, 0.0)], [1]), 7) == ([PROMPT], 7)
    ar = s.as_ar()
    msg = decode(ar.steps[0].frame)
    assert isinstance(msg, Prompt) and msg.mode is Mode.AR and msg.tree is None
    assert ar.tokens == [1, 2] and ar.verdicts == [(0, 1), (0, 1)] and len(ar.steps) == 1


def test_the_flat_verifier_packs_every_ready_session() -> None:
    ar = [[FlatRound(0, 0.0, 1)] * 8]
    out = predict_flat(ar, 4, 0.01, 10.0)
    assert out["tokens_per_forward"] == pytest.approx(4.0)
    assert out["verifier_s_per_token"] == pytest.approx(0.0025)
    # every tree pre-speculated (it left before the verdict it follows): rounds back to back
    hits = [[FlatRound(max(0, k - 1), 0.0, 5) for k in range(6)]]
    assert predict_flat(hits, 3, 0.01, 10.0)["tokens_per_forward"] == pytest.approx(15.0)
    # every tree drafted after its verdict, 0.1 s later: one round a 0.11 s, the verifier mostly idle
    misses = [[FlatRound(k, 0.1, 5) for k in range(6)]]
    one = predict_flat(misses, 1, 0.01, 10.0)
    assert one["tokens_per_forward"] == pytest.approx(5.0)
    assert one["verifier_s_per_token"] == pytest.approx(0.002)
    assert predict_flat(misses, 2, 0.01, 10.0)["tokens_per_forward"] == pytest.approx(10.0)


@dataclasses.dataclass
class Replayed:
    """What the clients of one replay received, and the verifier's forwards and seconds for it."""

    tallies: list[Tally]
    forwards: int
    busy_s: float

    @property
    def tokens(self) -> int:
        return sum(sum(t.tokens) for t in self.tallies)


def _replayed(srv: LiveServer, hello: bytes, scripts: Sequence[Script], clients: int) -> Replayed:
    """Every script once, eagerly, on each of `clients` sessions at once (bench.lib.replay.replay_once),
    and the verifier's forwards and forward seconds from /metrics, read before the first generation
    and after the last: counted over whole generations, whatever the machine's speed (the limit
    only ends a replay that hangs)."""

    async def one() -> Tally:
        ws = await WebSocketTransport.connect(srv.url)
        try:
            return await replay_once(ws, hello, scripts, limit_s=600.0)
        finally:
            await ws.close()

    async def together() -> list[Tally]:
        return list(await asyncio.gather(*(one() for _ in range(clients))))

    busy0, forwards0 = load_cost.scrape(srv.http)
    tallies = asyncio.run(together())
    busy1, forwards1 = load_cost.scrape(srv.http)
    return Replayed(tallies, int(forwards1 - forwards0), busy1 - busy0)


def test_recorded_generations_replay_exactly_and_cloud_only_ar_reproduces_them() -> None:
    """A real edge (tree_prespec, the tiny self-draft) recorded, then replayed by two clients at once:
    no verdict differs from the recording, the verifier's seconds and forwards are read from
    /metrics; mode ar on the same prompts answers the same tokens; a script whose recorded tokens
    are wrong is caught; the bench's timed run (load_cost.measure) checks every verdict too.

    Tokens per forward are counted over whole generations, never over a window of time: in a window
    the clients count tokens as verdicts arrive, /metrics counts forwards when a thread gets to read
    it, and on a busy machine the read at the window's start came late: two ar sessions showed more
    than the 2 tokens a forward they can make (2.15 with that read 0.8 s late)."""
    drafter = create_drafter("torch", "tiny")
    prompts = load_suite(1, 1)
    with LiveServer(max_pending=6) as srv:
        hello, scripts = asyncio.run(
            load_cost.record(srv.url, drafter, prompts, 24, "tree_prespec", "2,1,1", 20.0, 0.0, False)
        )
        assert len(scripts) == 2 and all(len(s.tokens) == 24 for s in scripts)
        assert all(isinstance(decode(s.steps[0].frame), Prompt) for s in scripts)
        assert any(len(s.steps) > 2 for s in scripts)
        tokens = sum(len(s.tokens) for s in scripts)
        assert sum(len(s.verdicts) for s in scripts) < tokens  # trees: fewer rounds than tokens

        edge = _replayed(srv, hello, scripts, 2)
        assert all(t.diverged == 0 and not t.errors and t.generations == 2 for t in edge.tallies)
        assert edge.tokens == 2 * tokens and edge.busy_s > 0
        assert edge.tokens > edge.forwards > 0  # trees: several tokens a forward
        verify_ms = [v for t in edge.tallies for v in t.verify_ms]  # the rounds' verify time, edge idle
        assert verify_ms and min(verify_ms) > 0

        ar_scripts = [s.as_ar() for s in scripts]
        ar = _replayed(srv, hello, ar_scripts, 2)
        assert all(t.diverged == 0 and not t.errors and t.generations == 2 for t in ar.tallies)
        assert ar.tokens == 2 * tokens
        assert ar.forwards <= ar.tokens <= 2 * ar.forwards  # a token per session per forward

        wrong = [dataclasses.replace(s, tokens=[t + 1 for t in s.tokens]) for s in ar_scripts]
        (bad,) = _replayed(srv, hello, wrong, 1).tallies
        assert bad.diverged == 2 and bad.generations == 0

        timed = asyncio.run(load_cost.measure(srv.url, srv.http, hello, scripts, 2, 0.0, 1.0))
        assert timed["diverged"] == 0 and timed["errors"] == 0, timed
    drafter.close()


def test_flat_only_predicts_from_a_scripts_file_without_a_verifier(tmp_path: Path) -> None:
    """--flat-only: the saved scripts, the flat verifier alone (no model, no service). One game of
    three rounds for five tokens, every tree ready at once: 3 forwards against ar's 5."""
    steps = [Step(PROMPT, 0, 0.0), Step(_tree(1), 1, 0.0), Step(_tree(2), 2, 0.0)]
    script = Script(0, steps, [5, 6, 7, 8, 9], [(0, 1), (1, 2), (2, 2)])
    path = tmp_path / "scripts.json"
    load_cost.save_scripts(path, encode(Hello(vocab_fingerprint="f00d")), [script], {"mode": "tree_prespec"})
    out = tmp_path / "flat.json"
    args = ["--flat-only", "--scripts", str(path), "--clients", "1,2", "--flat-ms", "10", "--json", str(out)]
    assert load_cost.main(args) == 0
    doc = json.loads(out.read_text())
    rows = {(r["kind"], r["clients"]): r for r in doc["rows"]}
    assert rows[("ar", 1)]["flat_verifier_s_per_token"] == pytest.approx(0.010)
    assert rows[("edge", 1)]["flat_verifier_s_per_token"] == pytest.approx(0.006)
    assert rows[("edge", 2)]["flat_tokens_per_forward"] == pytest.approx(10 / 3, abs=1e-3)
    assert doc["edge_over_ar"]["flat"] == {"1": 0.6, "2": 0.6}
    with pytest.raises(SystemExit):
        load_cost.main(["--flat-only", "--scripts", str(tmp_path / "missing.json")])
