"""The fleet on a local Ray cluster: two replicas of the tiny verifier behind Serve's proxy; every
session through the fleet's address generates the tokens a verifier served directly generates,
`fleet status` shows both replicas, `/metrics` through the proxy shows both replicas' metrics, and a
session cut mid-generation resumes on the replica that holds its KV cache. The replicas offer their
own addresses (`direct`): the edge client moves its sessions there, the raw clients that do not ask
stay on the proxy."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from bench.lib.ray_fleet import LocalFleet  # noqa: E402
from cloud_verifier.fleet.app import build_app  # noqa: E402
from cloud_verifier.fleet.config import APP_NAME, DEPLOYMENT_NAME, FleetArgs  # noqa: E402
from cloud_verifier.fleet.status import fleet_status  # noqa: E402
from tests.cloud_verifier.service import LiveServer, prompt_tokens  # noqa: E402
from tests.fleet.wsclient import greedy_session  # noqa: E402

TINY = FleetArgs(
    model="tiny",
    replicas_min=2,
    replicas_max=2,
    max_sessions_per_replica=4,
    direct=True,  # each replica offers its own address: an edge client moves its sessions there
    overrides={"measure_cost": False, "max_context": 512, "kv_blocks": 2048, "threads": 1},
)


def test_build_app_is_the_verifier_deployment() -> None:
    """build_app makes the Serve application without a cluster."""
    app = build_app({"model": "tiny", "replicas_min": 1, "replicas_max": 3, "max_sessions_per_replica": 8})
    assert isinstance(app, serve.Application)


@pytest.fixture(scope="module")
def fleet() -> Iterator[str]:
    """The fleet's address: ws://127.0.0.1:PORT."""
    with LocalFleet(num_cpus=2) as local:
        local.run(TINY)
        yield local.base


@pytest.mark.slow
def test_sessions_through_the_fleet_generate_the_direct_verifiers_tokens(fleet: str) -> None:
    cases = [(prompt_tokens(200 + i), i) for i in range(4)]
    with LiveServer(threads=1) as srv:
        direct = [greedy_session(srv.url, prompt, 32, seed)[0] for prompt, seed in cases]
    through = [greedy_session(f"{fleet}/v1/session", prompt, 32, seed)[0] for prompt, seed in cases]
    assert through == direct
    assert all(len(out) == 32 for out in through)


@pytest.mark.slow
def test_status_shows_every_replica(fleet: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        rows = fleet_status()
        settled = len(rows) == 2 and all(r["sessions"] == 0 for r in rows)  # reported, sessions closed
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(rows) == 2
    assert {r["state"] for r in rows} == {"RUNNING"}
    assert len({r["pid"] for r in rows}) == 2
    assert all(r["sessions"] == 0 and r["queue"] == 0 for r in rows)
    assert serve.status().applications[APP_NAME].deployments[DEPLOYMENT_NAME].status == "HEALTHY"


@pytest.mark.slow
def test_metrics_through_the_proxy_show_every_replica(fleet: str) -> None:
    """One scrape of the fleet's address: every replica's samples, labelled by replica and node."""
    url = fleet.replace("ws://", "http://") + "/metrics"
    deadline = time.monotonic() + 30
    while True:
        with urllib.request.urlopen(url, timeout=30) as response:
            text = response.read().decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}  # parses again
        replicas = {s.labels["replica"] for s in families["specdec_kv_blocks_total"].samples}
        if len(replicas) == 2 or time.monotonic() > deadline:  # each replica reports every second
            break
        time.sleep(0.5)
    rows = fleet_status()
    assert len(replicas) == 2
    assert {s.labels["node"] for s in families["specdec_sessions"].samples} == {r["node"] for r in rows}
    assert all(s.labels["replica"] in replicas for f in families.values() for s in f.samples)
    assert [s.value for s in families["specdec_kv_blocks_total"].samples] == [2048.0, 2048.0]


def test_a_dropped_session_resumes_on_the_replica_that_holds_it(fleet: str) -> None:
    """Sessions moved to their replica's own address, cut mid-generation (no closing handshake):
    each resume's upgrade through the fleet's address names its token (X-Session-Id), the router
    sends it to the replica that gave it, the session moves to that replica's address again and
    takes its KV cache over; the output is the uninterrupted one. (The default suite's test on a
    Ray cluster.)"""
    import asyncio

    from edge_client.client import EdgeClient, ResumeConfig
    from edge_client.drafters.registry import create_drafter

    drafter = create_drafter("torch", "tiny")
    prompts = [prompt_tokens(300 + i, 8) for i in range(4)]

    async def generate(prompt: list[int], drop_at: int | None) -> tuple[list[int], int, int]:
        c = EdgeClient(f"{fleet}/v1/session", drafter, resume=ResumeConfig(backoff_s=0.05))
        got = 0
        async for _ in c.generate(prompt, max_new_tokens=40, raw=True):
            got += 1
            if got == drop_at:
                c.session._transport._ws.transport.abort()  # type: ignore[union-attr]
        assert c.last is not None
        out = (list(c.last.tokens), c.last.stats.resumes, c.session.moves)
        await c.close()
        return out

    try:
        with LiveServer(threads=1) as srv:
            direct = [greedy_session(srv.url, p, 40, 0)[0] for p in prompts]
        runs = [asyncio.run(generate(p, 3)) for p in prompts]
    finally:
        drafter.close()
    assert [out for out, _, _ in runs] == direct and all(n == 1 for _, n, _ in runs)
    assert all(moves == 2 for _, _, moves in runs)  # the session and its resume, each moved
    url = fleet.replace("ws://", "http://") + "/metrics"
    deadline = time.monotonic() + 30
    while True:  # each replica reports its metrics every second
        with urllib.request.urlopen(url, timeout=30) as response:
            families = {f.name: f for f in text_string_to_metric_families(response.read().decode())}
        kv: dict[str, float] = {}
        for s in families["cloud_verifier_resumes"].samples:
            if s.name.endswith("_total"):
                kv[s.labels["kv"]] = kv.get(s.labels["kv"], 0.0) + s.value
        moved = sum(
            s.value for s in families["cloud_verifier_direct_moves"].samples if s.name.endswith("_total")
        )
        if (sum(kv.values()) >= len(prompts) and moved >= 2 * len(prompts)) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert kv.get("gone", 0.0) == 0.0  # every resume reached the replica holding its session
    assert kv.get("reused", 0.0) + kv.get("busy", 0.0) == len(prompts)
    assert moved == 2 * len(prompts)
