"""TLS: the verifier serves wss:// and https:// with --ssl-certfile/--ssl-keyfile; the edge client
trusts a self-signed certificate through its CA file and refuses it without one."""

from __future__ import annotations

import asyncio
import shutil
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
