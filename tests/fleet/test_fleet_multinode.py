"""The fleet on a multi-node Ray cluster on this machine (a head with no CPUs and two worker nodes
of one CPU each, separate raylets with their own resources): the two replicas land on different
nodes; a worker node that dies mid-generation loses no session (its edges resume on the other
node's replica, outputs identical), and a node that joins again gets the missing replica back."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from ray.cluster_utils import Cluster  # noqa: E402

from cloud_verifier.fleet.app import build  # noqa: E402
from cloud_verifier.fleet.config import APP_NAME, DEPLOYMENT_NAME, FleetArgs  # noqa: E402
from edge_client.client import EdgeClient, ResumeConfig  # noqa: E402
from edge_client.drafters.registry import create_drafter  # noqa: E402
from tests.cloud_verifier.service import prompt_tokens, reference  # noqa: E402

FLEET = FleetArgs(
    model="tiny",
    replicas_min=2,
    replicas_max=2,
    max_sessions_per_replica=4,
    overrides={"measure_cost": False, "max_context": 512, "kv_blocks": 2048, "threads": 1},
)


def _replicas() -> list[dict[str, Any]]:
    """The fleet's running replicas as Serve's details list them (node id, pid, state)."""
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    assert client is not None
    details = client.get_serve_details()
    deployment = details["applications"][APP_NAME]["deployments"][DEPLOYMENT_NAME]
    return [r for r in deployment["replicas"] if str(getattr(r["state"], "value", r["state"])) == "RUNNING"]


def _wait(until: Callable[[list[dict[str, Any]]], bool], timeout_s: float = 180.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while True:
        rows = _replicas()
        if until(rows):
            return rows
        assert time.monotonic() < deadline, f"the fleet's replicas did not settle: {rows}"
        time.sleep(0.3)


def _held_sessions(sessions: int, timeout_s: float = 20.0) -> dict[str, int]:
    """Sessions by Ray node id, once the replicas' reports add up to `sessions` (or after
    `timeout_s`)."""
    from cloud_verifier.fleet.status import fleet_status

    deadline = time.monotonic() + timeout_s
    while True:
        held = {str(r["node_id"]): int(r["sessions"] or 0) for r in fleet_status()}
        if sum(held.values()) >= sessions or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


@pytest.mark.slow
def test_replicas_spread_over_nodes_and_a_dead_node_loses_no_session() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    drafters = [create_drafter("torch", "tiny") for _ in range(4)]
    try:
        # one proxy, on the head: the nodes share this machine's address (and so its ports)
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        serve.run(build(FLEET), name=APP_NAME, route_prefix="/")
        rows = _wait(lambda rows: len(rows) == 2)
        by_node = {r["node_id"]: r for r in rows}
        assert len(by_node) == 2  # one replica on each worker node (each has one CPU)
        prompts = [prompt_tokens(400 + i, 8) for i in range(4)]

        async def generate(i: int, started: asyncio.Event | None) -> tuple[list[int], int]:
            c = EdgeClient(
                f"ws://127.0.0.1:{port}/v1/session",
                drafters[i],
                resume=ResumeConfig(attempts=100, backoff_s=0.1, max_backoff_s=0.5),
            )
            n = 0
            async for _ in c.generate(prompts[i], max_new_tokens=240, raw=True):
                n += 1
                if n == 2 and started is not None:
                    started.set()
            assert c.last is not None
            out = (list(c.last.tokens), c.last.stats.resumes)
            await c.close()
            return out

        async def main() -> list[tuple[list[int], int]]:
            started = [asyncio.Event() for _ in prompts]
            tasks = [asyncio.create_task(generate(i, started[i])) for i in range(len(prompts))]
            await asyncio.gather(*(e.wait() for e in started))
            # the node dies: its raylet and every process on it (a replica among them); the victim
            # is a node whose replica holds sessions (the replicas report them every second)
            held = await asyncio.to_thread(_held_sessions, len(prompts))
            victims.append(next(w for w in workers if held.get(w.node_id, 0) > 0))
            await asyncio.to_thread(cluster.remove_node, victims[0], False)
            return await asyncio.gather(*tasks)

        victims: list[Any] = []
        runs = asyncio.run(main())
        victim = victims[0]
        assert [out for out, _ in runs] == [reference(tuple(p), 240) for p in prompts]
        assert sum(n for _, n in runs) >= 1  # the dead node's sessions resumed on the other
        # a node joins: Serve places the missing replica there
        cluster.add_node(num_cpus=1)
        nodes = _wait(lambda rows: len(rows) == 2 and victim.node_id not in {r["node_id"] for r in rows})
        assert len({r["node_id"] for r in nodes}) == 2
    finally:
        for d in drafters:
            d.close()
        shutdown: Callable[[], None] = serve.shutdown  # (untyped in Ray)
        shutdown()
        ray.shutdown()
        stop: Callable[[], None] = cluster.shutdown  # (untyped in Ray)
        stop()
