"""Tensor parallelism inside a fleet replica (`cloud-verifier fleet --tensor-parallel 2`, on CPUs
with gloo here; `--gpus-per-replica N` on GPUs): the replica starts its second rank as a child
process, and a session through the fleet generates the tokens the target alone does."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from bench.lib.ray_fleet import LocalFleet  # noqa: E402
from cloud_verifier.cli import build_parser  # noqa: E402
from cloud_verifier.fleet.cli import fleet_args  # noqa: E402
from cloud_verifier.fleet.config import FleetArgs  # noqa: E402
from tests.cloud_verifier.service import prompt_tokens, reference  # noqa: E402
from tests.fleet.wsclient import greedy_session  # noqa: E402


@pytest.mark.slow
def test_a_replica_of_two_tensor_parallel_ranks_generates_the_targets_tokens() -> None:
    flags = ["fleet", "--model", "tiny", "--replicas", "1", "--tensor-parallel", "2", "--threads", "2",
             "--no-measure-cost", "--kv-blocks", "2048", "--max-context", "512"]  # fmt: skip
    fleet = fleet_args(build_parser().parse_args(flags))
    assert isinstance(fleet, FleetArgs)
    prompts = [prompt_tokens(500 + i, 10) for i in range(2)]
    with LocalFleet(num_cpus=2) as local:
        local.run(fleet)
        outs = [greedy_session(local.url, p, 24, i)[0] for i, p in enumerate(prompts)]
    assert outs == [reference(tuple(p), 24) for p in prompts]
