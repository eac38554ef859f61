"""The fleet's router ranks: a resume to the replica its token names while that one runs, then every
replica by its engine's queue; a new session to the least loaded."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("ray")

from cloud_verifier.fleet.router import rank
from cloud_verifier.resume import new_token


@dataclass
class _Id:
    unique_id: str


@dataclass
class _Replica:
    name: str
    queue: int = 0
    routing_stats: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.replica_id = _Id(self.name)
        self.routing_stats = {"sessions": 1, "queue": self.queue, "parked": 0, "room": 3}


def _names(ranks: list[list[Any]]) -> list[list[str]]:
    return [[r.name for r in group] for group in ranks]


def test_a_new_session_ranks_every_replica_by_its_queue() -> None:
    a, b, c = _Replica("a", 3), _Replica("b", 0), _Replica("c", 1)
    assert _names(rank([a, b, c], None)) == [["b", "c", "a"]]  # type: ignore[list-item]
    assert rank([], None) == []


def test_a_resume_goes_to_its_holder_first_then_to_the_least_loaded() -> None:
    a, b, c = _Replica("a", 3), _Replica("b", 0), _Replica("c", 1)
    token = new_token("a")
    assert _names(rank([a, b, c], token)) == [["a"], ["b", "c", "a"]]  # type: ignore[list-item]
    # the holder is gone (killed, replaced): the least loaded, which prefills the committed tokens
    assert _names(rank([b, c], token)) == [["b", "c"]]  # type: ignore[list-item]
    # the holder at its session cap would refuse it: the least loaded, which prefills it
    a.routing_stats["room"] = 0
    assert _names(rank([a, b, c], token)) == [["b", "c", "a"]]  # type: ignore[list-item]
    # a token of no replica, or with no tag (a single verifier's): a new session's ranks
    assert _names(rank([a, b], new_token(""))) == [["b", "a"]]  # type: ignore[list-item]


def test_a_replica_with_no_stats_yet_counts_as_idle() -> None:
    a, fresh = _Replica("a", 2), _Replica("fresh")
    fresh.routing_stats = {}
    assert _names(rank([a, fresh], None)) == [["fresh", "a"]]  # type: ignore[list-item]
