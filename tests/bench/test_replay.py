"""bench.lib.replay: a block's recorded frames cut into one script per generation (the last prompt
onwards, whatever the session sent before it), and the eager form of a script."""

from __future__ import annotations

import asyncio

import numpy as np

from bench.lib.replay import Recorders, RecordingTransport, Script, Step, eager, last_prompt
from shared.messages import Hello, Prompt, Tree, Verdict, encode
from shared.tree import TokenTree


def _tree(rnd: int) -> bytes:
    return encode(Tree(round=rnd, tree=TokenTree.build([4, 5, 6], [-1, 0, 1], base=3)))


def _verdict(rnd: int, tokens: list[int], done: bool = False) -> bytes:
    return encode(
        Verdict(rnd, np.array(tokens, dtype=np.int32), np.array([], dtype=np.int32), True, 3, done=done)
    )


def _prompt(n: int) -> bytes:
    return encode(Prompt(np.array([1, 2, n], dtype=np.int32), max_new_tokens=5))


class _Null:
    async def send(self, data: bytes) -> None:
        pass

    async def recv(self) -> bytes:
        raise AssertionError("not used")

    async def close(self) -> None:
        pass


def test_each_generation_is_cut_from_its_own_prompt() -> None:
    rec = Recorders("ws://unused")
    t = RecordingTransport(_Null())
    rec.transports["tree"] = [t]
    hello = encode(Hello(vocab_fingerprint="f00d"))
    t.log += [("out", 0.0, hello), ("out", 0.1, _prompt(7)), ("in", 0.5, _verdict(0, [4], done=True))]
    rec.cut("tree", 0)  # the warm-up generation
    t.log += [("out", 1.0, _prompt(8)), ("in", 1.4, _verdict(0, [5, 6]))]
    t.log += [("out", 1.5, _tree(1)), ("in", 2.0, _verdict(1, [7], done=True))]
    assert last_prompt(t.log) == 3
    rec.cut("tree", 3)
    first, second = rec.scripts["tree"]
    assert first.tokens == [4] and len(first.steps) == 1
    assert second.prompt_index == 3 and second.tokens == [5, 6, 7]
    assert [st.frame for st in second.steps] == [_prompt(8), _tree(1)]
    assert rec.hello("tree") == hello
    # a session opened again mid-generation has no prompt: counted, not scripted
    rec.transports["tree"].append(RecordingTransport(_Null()))
    rec.transports["tree"][-1].log.append(("out", 3.0, _tree(2)))
    rec.cut("tree", 4)
    assert rec.lost == {"tree": 1} and len(rec.scripts["tree"]) == 2
    assert last_prompt([("out", 0.0, _tree(1))]) == 0


def test_an_eager_script_keeps_its_cues_and_drops_the_delays() -> None:
    s = Script(2, [Step(_prompt(1), 0, 0.0), Step(_tree(1), 1, 0.3), Step(_tree(2), 1, 0.5)], [1, 2, 3])
    e = eager(s)
    assert [(st.after, st.delay_s) for st in e.steps] == [(0, 0.0), (1, 0.0), (1, 0.0)]
    assert [st.frame for st in e.steps] == [st.frame for st in s.steps] and e.tokens == s.tokens
    assert s.steps[1].delay_s == 0.3  # the recorded script is left as it was


def test_the_recording_transport_logs_both_directions() -> None:
    class Echo(_Null):
        async def recv(self) -> bytes:
            return b"in"

    r = RecordingTransport(Echo())
    asyncio.run(r.send(b"out"))
    assert asyncio.run(r.recv()) == b"in"
    assert [(d, b) for d, _, b in r.log] == [("out", b"out"), ("in", b"in")]
