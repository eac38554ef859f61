"""TLS: the verifier serves wss:// and https:// with --ssl-certfile/--ssl-keyfile; the edge client
trusts a self-signed certificate through its CA file and refuses it without one."""

from __future__ import annotations

import asyncio
import shutil
import socket
import ssl
import subprocess
from pathlib import Path

import httpx
import pytest

from edge_client.client import EdgeClient, GenerationError
from edge_client.drafters.registry import create_drafter
from tests.cloud_verifier.service import LiveServer, reference


def _self_signed(tmp: Path) -> tuple[str, str]:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return str(cert), str(key)


def test_wss_with_a_self_signed_certificate(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    drafter = create_drafter("torch", "tiny")
    with LiveServer(ssl_certfile=cert, ssl_keyfile=key) as srv:
        assert srv.url.startswith("wss://")
        assert (
            httpx.get(srv.http + "/readyz", verify=ssl.create_default_context(cafile=cert)).status_code == 200
        )

        async def generate(ca: str | None) -> list[int]:
            async with EdgeClient(srv.url, drafter, ca_file=ca) as c:
                async for _ in c.generate([5, 6, 7, 8], max_new_tokens=16, raw=True):
                    pass
                assert c.last is not None
                return c.last.tokens

        assert asyncio.run(generate(cert)) == reference((5, 6, 7, 8), 16)
        with pytest.raises(GenerationError, match=r"cannot reach|CERTIFICATE"):
            asyncio.run(generate(None))  # not signed by a CA the system trusts
    drafter.close()


@pytest.mark.parametrize("offer", ["wss", "ws"])
def test_a_wss_session_moves_only_to_a_wss_address(tmp_path: Path, offer: str) -> None:
    """A verifier's own address (welcome.direct) over TLS takes the session; a ws:// one is never
    even opened from wss://, since the hello there would carry the key in the clear."""
    cert, key = _self_signed(tmp_path)
    drafter = create_drafter("torch", "tiny")
    plain = socket.create_server(("127.0.0.1", 0))  # the ws:// offer: it counts who knocks
    plain.settimeout(0.2)
    with plain, LiveServer(ssl_certfile=cert, ssl_keyfile=key) as srv:
        own = srv.url.replace("127.0.0.1", "localhost")  # the same server under the certificate's other name
        srv.state.direct = own if offer == "wss" else f"ws://127.0.0.1:{plain.getsockname()[1]}/v1/session"

        async def generate() -> tuple[list[int], int]:
            async with EdgeClient(srv.url, drafter, ca_file=cert) as c:
                async for _ in c.generate([5, 6, 7, 8], max_new_tokens=16, raw=True):
                    pass
                assert c.last is not None
                return c.last.tokens, c.session.moves

        tokens, moves = asyncio.run(generate())
        moved = srv.state.metrics.direct_moves._value.get()
        try:
            plain.accept()[0].close()
            knocked = True
        except TimeoutError:
            knocked = False
    drafter.close()
    assert tokens == reference((5, 6, 7, 8), 16)
    assert (moves, moved, knocked) == ((1, 1, False) if offer == "wss" else (0, 0, False))
