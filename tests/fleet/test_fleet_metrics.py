"""The fleet's merged `/metrics` without Ray: the replicas' expositions merged into one that parses
again, each sample labelled with its replica and node, one family per metric, and a replica whose
text does not parse or is too large left out with a comment; the board that keeps them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cloud_verifier.fleet import status
from cloud_verifier.fleet.metrics import MAX_BYTES, ReplicaMetrics, bound, merge
from cloud_verifier.metrics import Metrics


def _exposition(rounds: int, sessions: int) -> str:
    """A replica's `/metrics`: the verifier's own registry after `rounds` rounds."""
    m = Metrics()
    m.model_name = "tiny"
    for _ in range(rounds):
        m.record_round(8, [1, 2, 3])
    m.sessions.set(sessions)
    m.errors.labels(code="BUSY").inc()
    m.vllm_ttft.labels("tiny").observe(0.2)
    return generate_latest(m.registry).decode()


def _families(text: str) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    out: dict[str, list[tuple[str, dict[str, str], float]]] = {}
    for f in text_string_to_metric_families(text):
        assert f.name not in out, f"family {f.name} written twice"
        out[f.name] = [(s.name, s.labels, s.value) for s in f.samples]
    return out


def test_two_replicas_merge_under_one_family_each_with_their_labels() -> None:
    a = ReplicaMetrics("Verifier#a", "10.0.0.1", _exposition(rounds=2, sessions=3))
    b = ReplicaMetrics("Verifier#b", "10.0.0.2", _exposition(rounds=5, sessions=1))
    text = merge([a, b])
    families = _families(text)  # parses again, each family once
    assert set(families) == set(_families(a.text))
    drafts = families["specdec_num_drafts"]
    assert sorted(
        (labels["replica"], labels["node"], v) for name, labels, v in drafts if name.endswith("_total")
    ) == [
        ("Verifier#a", "10.0.0.1", 2.0),
        ("Verifier#b", "10.0.0.2", 5.0),
    ]
    assert {(labels["replica"], v) for _, labels, v in families["specdec_sessions"]} == {
        ("Verifier#a", 3.0),
        ("Verifier#b", 1.0),
    }
    for samples in families.values():  # every sample of every family carries both labels
        assert all({"replica", "node"} <= set(labels) for _, labels, _ in samples)
    errors = families["specdec_errors"]
    assert {(labels["code"], labels["replica"]) for name, labels, _ in errors if name.endswith("_total")} == {
        ("BUSY", "Verifier#a"),
        ("BUSY", "Verifier#b"),
    }
    assert text.count("# TYPE specdec_num_drafts_total counter\n") == 1
    assert text.count("# HELP vllm:time_to_first_token_seconds ") == 1


def test_a_histogram_stays_whole_per_replica() -> None:
    r = CollectorRegistry()
    h = Histogram("latency_seconds", "Latency", ["route"], buckets=(0.1, 1.0), registry=r)
    h.labels("/v1").observe(0.5)
    h.labels("/v1").observe(2.0)
    text = merge(
        [
            ReplicaMetrics("x", "n1", generate_latest(r).decode()),
            ReplicaMetrics("y", "n2", generate_latest(r).decode()),
        ]
    )
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "latency_seconds"]
    assert family.type == "histogram"
    for replica in ("x", "y"):
        mine = {
            (s.name, s.labels.get("le")): s.value for s in family.samples if s.labels["replica"] == replica
        }
        assert mine == {
            ("latency_seconds_bucket", "0.1"): 0.0,
            ("latency_seconds_bucket", "1.0"): 1.0,
            ("latency_seconds_bucket", "+Inf"): 2.0,
            ("latency_seconds_count", None): 2.0,
            ("latency_seconds_sum", None): 2.5,
        }
    lines = [line for line in text.splitlines() if line.startswith("latency_seconds_bucket")]
    assert len(lines) == 6 and all('replica="' in line and 'node="' in line for line in lines)


def test_one_replica_is_its_own_exposition_plus_labels() -> None:
    r = CollectorRegistry()
    Counter("hits", 'Hits with "quotes" and \\ in the help', registry=r).inc(3)
    Gauge("temperature", "Degrees", ["room"], registry=r).labels('a "b"').set(21.5)
    own = generate_latest(r).decode()
    text = merge([ReplicaMetrics("Verifier#q", "10.1.2.3", own)])
    assert '# HELP hits_total Hits with "quotes" and \\\\ in the help\n' in text
    assert 'hits_total{node="10.1.2.3",replica="Verifier#q"} 3.0\n' in text
    assert 'temperature{node="10.1.2.3",replica="Verifier#q",room="a \\"b\\""} 21.5\n' in text
    merged = _families(text)
    assert {
        k: [(n, {x: y for x, y in lab.items() if x not in ("replica", "node")}, v) for n, lab, v in s]
        for k, s in merged.items()
    } == _families(own)


def test_a_replica_whose_text_does_not_parse_is_left_out_with_a_comment() -> None:
    good = ReplicaMetrics("Verifier#a", "10.0.0.1", _exposition(rounds=1, sessions=0))
    bad = ReplicaMetrics("Verifier#b", "10.0.0.2", "specdec_sessions{oops 1\nnot metrics at all\n")
    text = merge([bad, good])
    families = _families(text)
    assert {labels["replica"] for _, labels, _ in families["specdec_sessions"]} == {"Verifier#a"}
    comments = [
        line
        for line in text.splitlines()
        if line.startswith("# ") and not line.startswith(("# HELP", "# TYPE"))
    ]
    assert len(comments) == 1
    assert comments[0].startswith("# replica Verifier#b on 10.0.0.2 left out: its metrics do not parse (")


def test_a_family_of_another_type_is_left_out() -> None:
    counter, gauge = CollectorRegistry(), CollectorRegistry()
    Counter("jobs", "Jobs", registry=counter).inc()
    Gauge("jobs", "Jobs", registry=gauge).set(4)
    text = merge(
        [
            ReplicaMetrics("a", "n", generate_latest(gauge).decode()),
            ReplicaMetrics("b", "n", generate_latest(counter).decode()),
        ]
    )
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["jobs"].type == "gauge"
    assert [s.labels["replica"] for s in families["jobs"].samples] == ["a"]
    assert "# replica b on n: jobs left out, a counter where others have a gauge\n" in text


def test_a_series_twice_is_written_once() -> None:
    text = merge([ReplicaMetrics("a", "n", "x 1\nx 2\n")])
    assert [line for line in text.splitlines() if line.startswith("x")] == ['x{node="n",replica="a"} 1.0']


def test_an_exposition_over_the_limit_is_not_kept() -> None:
    small = ReplicaMetrics("a", "n", "x 1\n")
    assert bound(small) is small
    big = bound(ReplicaMetrics("b", "n", "x 1\n" + "#" * MAX_BYTES))
    assert big.text == "" and f"over the limit of {MAX_BYTES}" in big.refused
    text = merge([small, big])
    assert text.endswith(f"# replica b on n left out: {big.refused}\n")
    assert _families(text) == {"x": [("x", {"replica": "a", "node": "n"}, 1.0)]}


def test_nothing_to_merge_is_an_empty_exposition_with_the_notes() -> None:
    assert merge([]) == ""
    assert merge([], notes=["the fleet's board did not answer:\nTimeoutError"]) == (
        "# the fleet's board did not answer: TimeoutError\n"
    )


def test_the_board_keeps_each_replicas_last_metrics_bounded_and_drops_stale_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr(status, "time", SimpleNamespace(time=lambda: now[0]))
    the_board = status._Board()
    the_board.report_metrics(ReplicaMetrics("a", "n1", "x 1\n"))
    the_board.report_metrics(ReplicaMetrics("b", "n2", "#" * (MAX_BYTES + 1)))
    now[0] += 1
    the_board.report_metrics(ReplicaMetrics("a", "n1", "x 2\n"))  # the last report wins
    kept = {m.replica: m for m in the_board.metrics()}
    assert kept["a"] == ReplicaMetrics("a", "n1", "x 2\n")
    assert kept["b"].text == "" and "over the limit" in kept["b"].refused
    now[0] += status.STALE_S  # b's report is now older than STALE_S, a's is not yet
    assert [m.replica for m in the_board.metrics()] == ["a"]
    assert the_board.expositions.keys() == {"a"}
