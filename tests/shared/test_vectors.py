"""The Python implementation against the protocol's test vectors (tests/vectors/*.json, PROTOCOL.md):
every valid frame decodes to its stated meaning and re-encodes to the same bytes, every invalid one
raises the stated error, and every session gets the stated answers from the server protocol."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from shared.errors import ProtocolError
from shared.messages import SessionLimits, Verdict, Welcome, decode, encode
from shared.protocol import ServerProtocol, VerifyTree
from shared.wire import Reader, WireLimits
from tests.vectors.generate import meaning

VECTORS = Path(__file__).resolve().parents[1] / "vectors"
FRAMES = json.loads((VECTORS / "frames.json").read_text())
SESSIONS = json.loads((VECTORS / "sessions.json").read_text())


def _limits(d: dict[str, Any]) -> SessionLimits:
    return SessionLimits.from_wire(Reader(d, "limits", WireLimits()))


@pytest.mark.parametrize("vec", FRAMES, ids=[v["name"] for v in FRAMES])
def test_frame_vector(vec: dict[str, Any]) -> None:
    frame = bytes.fromhex(vec["hex"])
    wire = ServerProtocol(vocab_size=1000, limits=_limits(SESSIONS[0]["limits"])).wire
    if vec["valid"]:
        msg = decode(frame, wire)
        assert meaning(msgpack.unpackb(frame)) == vec["decoded"]
        assert encode(msg).hex() == vec["hex"]  # one encoding: type first, then the fields in order
    else:
        with pytest.raises(ProtocolError) as err:
            decode(frame, wire)
        got = {"code": err.value.code.value, "field": err.value.field, "fatal": err.value.fatal}
        assert got == vec["error"]


@pytest.mark.parametrize("vec", SESSIONS, ids=[v["name"] for v in SESSIONS])
def test_session_vector(vec: dict[str, Any]) -> None:
    proto = ServerProtocol(vocab_size=vec["vocab_size"], limits=_limits(vec["limits"]))
    for i, step in enumerate(vec["steps"]):
        frame = bytes.fromhex(step["hex"])
        verified: list[VerifyTree | None] = []
        if step["from"] == "client":
            events = proto.receive(frame)
            assert [type(e).__name__ for e in events] == step["events"], i
            verified = [e for e in events if isinstance(e, VerifyTree)]
        else:
            msg = decode(frame)
            if isinstance(msg, Welcome):
                proto.welcome(msg)
            else:
                assert isinstance(msg, Verdict)
                nxt = proto.verdict(msg)
                assert (nxt.round if nxt is not None else None) == step["verify_next"], i
                verified = [nxt]
        if "verify_tree" in step:  # the re-rooted tree the server verifies (PROTOCOL.md section 5)
            t = verified[0].tree if verified and verified[0] is not None else None
            assert t is not None, i
            got = {"base": t.base} | {
                k: np.asarray(getattr(t, k)).tolist() for k in ("cond", "tokens", "parents")
            }
            assert got == step["verify_tree"], i
        sent = proto.data_to_send()
        assert [meaning(msgpack.unpackb(f)) for f in sent] == step["sent"], i
        assert [f.hex() for f in sent] == step["sent_hex"], i


def test_there_are_enough_vectors() -> None:
    assert sum(v["valid"] for v in FRAMES) >= 12 and sum(not v["valid"] for v in FRAMES) >= 20
    assert len(SESSIONS) >= 8
