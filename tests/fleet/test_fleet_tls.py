"""The fleet over TLS on a local Ray cluster: Serve's proxy serves https:// and wss://, each
replica's own address serves wss:// with the same certificate, and an edge client that trusts it
moves its session there (never to a ws:// address) and generates the target's tokens."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve")

from bench.lib.ray_fleet import LocalFleet
from cloud_verifier.fleet.config import FleetArgs
from edge_client.client import EdgeClient
from edge_client.drafters.registry import create_drafter
from tests.cloud_verifier.service import reference
from tests.cloud_verifier.test_tls import _self_signed


@pytest.mark.slow
def test_wss_through_the_proxy_and_to_the_replicas_own_address(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)  # names 127.0.0.1 and localhost
    fleet = FleetArgs(
        model="tiny",
        max_sessions_per_replica=4,
        direct_host="localhost",
        direct_ssl_certfile=cert,
        direct_ssl_keyfile=key,
        overrides={"measure_cost": False, "max_context": 512, "kv_blocks": 512, "threads": 1},
    )
    drafter = create_drafter("torch", "tiny")

    async def generate(url: str) -> tuple[list[int], int, str]:
        async with EdgeClient(url, drafter, ca_file=cert) as c:
            async for _ in c.generate([5, 6, 7, 8], max_new_tokens=24, raw=True):
                pass
            assert c.last is not None and c.session.welcome is not None
            return list(c.last.tokens), c.session.moves, str(c.session.welcome.direct)

    try:
        with LocalFleet(num_cpus=2, tls=(cert, key)) as local:
            local.run(fleet)
            ready = httpx.get(local.http + "/readyz", verify=ssl.create_default_context(cafile=cert))
            tokens, moves, direct = asyncio.run(generate(local.url))
    finally:
        drafter.close()
    assert local.url.startswith("wss://") and ready.status_code == 200
    assert direct.startswith("wss://localhost:") and moves == 1
    assert tokens == reference((5, 6, 7, 8), 24)
