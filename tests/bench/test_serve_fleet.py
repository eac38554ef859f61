"""bench.serve against a fleet: the cost counters summed replica by replica, the rows' replicas,
the fleet's figures and plot, `--fleet`'s usage errors, edge sessions opened per request, and
(slow) a short run on an autoscaling fleet of the tiny model."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench.serving import serve, serve_clients, serve_fleet
from bench.serving.serve_clients import BUSY, PREEMPTIONS, Counters, grown

FLEET_METRICS = f"""# TYPE {BUSY} untyped
{BUSY}{{node="10.0.0.1",replica="a"}} 2.5
{BUSY}{{node="10.0.0.1",replica="b"}} 1.0
{PREEMPTIONS}{{node="10.0.0.1",replica="a"}} 3
specdec_verify_forward_seconds_count{{replica="a"}} 40
"""


def test_cost_counters_are_read_by_replica_and_grow_replica_by_replica(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class Answer:
        def __init__(self, text: str) -> None:
            self.text = text.encode()

        def read(self) -> bytes:
            return self.text

        def __enter__(self) -> Answer:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

    texts = iter([FLEET_METRICS, f"{BUSY} 7.0\n{PREEMPTIONS} 1\n"])
    monkeypatch.setattr(urllib.request, "urlopen", lambda url, timeout: Answer(next(texts)))
    fleet, _ = serve_clients._scrape("http://x")
    assert fleet == {BUSY: {"a": 2.5, "b": 1.0}, PREEMPTIONS: {"a": 3.0}}
    lone, _ = serve_clients._scrape("http://x")  # one verifier: unlabelled samples
    assert lone == {BUSY: {"": 7.0}, PREEMPTIONS: {"": 1.0}}
    # between two scrapes replica a ran 1.5 s more, b stopped (its counts went with it), c came up
    later: Counters = {BUSY: {"a": 4.0, "c": 0.5}, PREEMPTIONS: {"a": 3.0}}
    assert grown(fleet, later, BUSY) == pytest.approx(2.0)
    assert grown(fleet, later, PREEMPTIONS) == 0
    assert grown(lone, {BUSY: {"": 9.0}}, BUSY) == pytest.approx(2.0)


def _rows() -> list[dict[str, Any]]:
    return [
        {
            "client": "ar",
            "request_rate": 1.0,
            "wall_start": 100.0,
            "wall_end": 110.0,
            "completed": 5,
            "failed": 0,
        },
        {
            "client": "ar",
            "request_rate": 4.0,
            "wall_start": 111.0,
            "wall_end": 120.0,
            "completed": 5,
            "failed": 1,
        },
    ]


def _timeline() -> list[dict[str, Any]]:
    counts = {99.5: 1, 105.0: 1, 108.0: 2, 112.0: 3, 119.0: 3, 125.0: 2, 131.0: 1, 131.5: 1}
    return [
        {"time": t, "replicas": n, "starting": 0, "sessions": n, "queue": 0, "generations": n}
        for t, n in counts.items()
    ]


def test_rows_gain_their_runs_replicas_and_the_run_its_fleet_figures() -> None:
    rows, timeline = _rows(), _timeline()
    serve_fleet.annotate(rows, timeline)
    # the samples in each run and the last before it (108 s: 2 replicas, as the second run began)
    assert [(r["replicas_min"], r["replicas_max"]) for r in rows] == [(1, 2), (2, 3)]
    fig = serve_fleet.figures(rows, timeline, 1)
    assert fig == {
        "replicas_max": 3,
        "first_scale_up_s": 8.0,  # 108 - 100: the first sample above the minimum
        "back_to_min_s_after_load": 11.0,  # 131 - 120
        "requests": 11,
        "failed": 1,
    }
    still_up = serve_fleet.figures(rows, timeline[:6], 1)  # never back at the minimum
    assert still_up["back_to_min_s_after_load"] is None
    assert "replicas_max 3" in serve_fleet.render(fig)


def test_the_fleet_plot_is_written(tmp_path: Path) -> None:
    rows, path = _rows(), tmp_path / "fleet.png"
    serve_fleet.plot(rows, _timeline(), [("ar", 105.0, 0.02), ("ar", 118.0, None)], "t", path)
    assert path.stat().st_size > 0


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--fleet-plot", "x.png"], "needs --fleet"),
        (["--fleet", "--url", "http://127.0.0.1:1"], "leave out --url"),
        (["--fleet", "--min-replicas", "3", "--max-replicas", "2"], "--min-replicas"),
        (["--fleet", "--rtt-ms", "20", "--fleet-direct"], "--no-fleet-direct"),
    ],
)
def test_fleet_flags_that_cannot_run_are_one_usage_line(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        serve.main(["--model", "tiny", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("python -m bench serve: error: ") and says in err


def test_fleet_flags_resolve_their_defaults() -> None:
    args = SimpleNamespace(fleet=False, fleet_plot=None, session_per_request=None)
    serve_fleet.check_fleet_args(args)  # type: ignore[arg-type]
    assert args.session_per_request is False  # one verifier: each slot keeps its session
    args = SimpleNamespace(
        fleet=True, fleet_plot=None, session_per_request=None, url=None, in_process=False,
        min_replicas=1, max_replicas=2, max_sessions=2, upscale_delay=1.0, downscale_delay=1.0,
        fleet_direct=None, rtt_ms=50.0,
    )  # fmt: skip
    serve_fleet.check_fleet_args(args)  # type: ignore[arg-type]
    assert args.session_per_request is True and args.fleet_direct is False  # moves would leave the link


def test_edge_requests_open_a_session_each_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per request, a client connects at its generation and drops the session after it; otherwise
    each client connects once, up front, and keeps its session."""
    log: list[str] = []

    class Client:
        def __init__(self, *a: object, **k: object) -> None:
            pass

        async def connect(self) -> None:
            log.append("connect")

        async def drop_connection(self) -> None:
            log.append("drop")

        async def close(self) -> None:
            log.append("close")

    async def request(client: object, spec: object, gen: object) -> str:
        log.append("generate")
        return "ok"

    class Pool:
        async def take(self, n: int) -> list[object]:
            return [object()] * n

        def give(self, drafters: object) -> None:
            pass

    monkeypatch.setattr(serve_clients, "EdgeClient", Client)
    monkeypatch.setattr(serve_clients, "edge_request", request)
    variant = SimpleNamespace(tree=None, prespec=False)

    async def two_requests(per_request: bool) -> list[str]:
        log.clear()
        fleet = serve_clients.EdgeFleet("ws://x", Pool(), variant, {}, 1, None, per_request)  # type: ignore[arg-type]
        await fleet.__aenter__()
        for _ in range(2):
            assert await fleet.send(None) == "ok"  # type: ignore[arg-type, comparison-overlap]
        await fleet.__aexit__()
        return list(log)

    assert asyncio.run(two_requests(True)) == ["generate", "drop", "generate", "drop", "close"]
    assert asyncio.run(two_requests(False)) == ["connect", "generate", "generate", "close"]


# ------------------------------------------------------------------------------- on a fleet
@pytest.mark.slow
def test_a_short_run_on_an_autoscaling_fleet_of_tiny(tmp_path: Path) -> None:
    """ar and an edge kind through a 1-2 replica fleet's one address: every request completes,
    the edge outputs are ar's, the verifier's cost is read across replicas, and the fleet was
    read over the run."""
    from bench.lib.ray_fleet import ray_missing

    if ray_missing():
        pytest.skip("the fleet extra (Ray Serve) is not installed")
    out = tmp_path / "serve.json"
    argv = ["--model", "tiny", "--fleet", "--min-replicas", "1", "--max-replicas", "2", "--cool-seconds", "5"]
    argv += ["--clients", "ar,tree", "--num-prompts", "3", "--max-tokens", "12", "--request-rate", "inf"]
    argv += ["--no-progress", "--json", str(out), "--fleet-plot", str(tmp_path / "fleet.png")]
    assert serve.main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["complete"] is True and doc["fleet"]["failed"] == 0 and doc["fleet"]["requests"] == 6
    assert doc["fleet_timeline"] and doc["fleet"]["replicas_max"] >= 1
    for row in doc["rows"]:
        assert (row["completed"], row["failed"]) == (3, 0), row["errors"]
        assert row["identical_to_ar"] is True and row["verifier_busy_s_per_token"] > 0
        assert row["replicas_max"] >= 1
    assert (tmp_path / "fleet.png").stat().st_size > 0
