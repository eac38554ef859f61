"""A verifier of an earlier release refuses a hello naming `features` (its strict decoder does not
know the field): the edge opens the session again without them and works as before."""

from __future__ import annotations

import asyncio
from collections import deque

from edge_client.client import EdgeClient
from edge_client.transports import TransportClosed
from shared.errors import ErrorCode
from shared.messages import FEATURES, Error, Hello, Mode, SessionLimits, Welcome, decode, encode
from tests.edge_client.fake_drafter import FakeDrafter


class EarlierVerifier:
    """One connection to a verifier whose hello decoder refuses `features` (fatal BAD_MESSAGE
    naming the field, then it closes), and otherwise welcomes the client."""

    def __init__(self, hellos: list[Hello], fingerprint: str, strict: bool = True) -> None:
        self.hellos, self.fingerprint, self.strict = hellos, fingerprint, strict
        self.out: deque[bytes] = deque()
        self.closed = False

    async def send(self, data: bytes) -> None:
        msg = decode(data)
        if not isinstance(msg, Hello):  # the client's close at the end
            return
        self.hellos.append(msg)
        if msg.features and self.strict:
            self.out.append(encode(Error(ErrorCode.BAD_MESSAGE, "unknown field", "features", True, None)))
            return
        self.out.append(
            encode(
                Welcome(
                    session_id="old",
                    model_id="earlier",
                    vocab_size=64,
                    eos_ids=(0,),
                    allowed_modes=(Mode.GREEDY, Mode.AR),
                    limits=SessionLimits(),
                    verify_cost_ms={1: 1.0},
                    vocab_fingerprint=self.fingerprint,
                )
            )
        )

    async def recv(self) -> bytes:
        if self.out:
            return self.out.popleft()
        raise TransportClosed(1000, "closed")

    async def close(self) -> None:
        self.closed = True


def _connect(strict: bool) -> tuple[list[Hello], Welcome]:
    drafter = FakeDrafter(64)
    hellos: list[Hello] = []

    async def factory() -> EarlierVerifier:
        return EarlierVerifier(hellos, drafter.vocab_fingerprint(), strict)

    async def go() -> Welcome:
        client = EdgeClient("ws://earlier", drafter, transport=factory, resume=False)
        try:
            return await client.connect()
        finally:
            await client.close()

    return hellos, asyncio.run(go())


def test_an_earlier_verifier_gets_a_hello_without_features() -> None:
    hellos, welcome = _connect(strict=True)
    assert welcome.model_id == "earlier"
    assert [h.features for h in hellos] == [FEATURES, ()]


def test_a_current_verifier_gets_one_hello_with_features() -> None:
    hellos, _ = _connect(strict=False)
    assert [h.features for h in hellos] == [FEATURES]
