"""The verify cost curve the welcome advertises: a forward of fewer nodes never costs more, and a
curve read from the cost cache or measured is one a client can use (shared.verify_cost)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cloud_verifier import cost
from cloud_verifier.cost import DEFAULT_NODES, cached_verify_cost, cost_cache_key, monotone, read_cached_cost
from shared import model_store
from shared.messages import Welcome
from shared.model import Target
from shared.verify_cost import cost_curve_error
from tests.cloud_verifier.service import WsSession, service, tiny


def test_a_curve_measured_under_load_is_capped_by_larger_forwards() -> None:
    busy = {1: 1303.0, 2: 1038.0, 4: 818.0, 8: 882.0, 16: 1257.0, 32: 2144.0}
    assert monotone(busy) == {1: 818.0, 2: 818.0, 4: 818.0, 8: 882.0, 16: 1257.0, 32: 2144.0}
    quiet = {1: 505.8, 2: 513.0, 4: 526.1, 8: 634.6}
    assert monotone(quiet) == quiet
    assert list(monotone({8: 3.0, 1: 1.0})) == [1, 8]


# ------------------------------------------------------------------------------ the cost cache
NODES = (1, 2)
PREFIX = 8


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    tiny()  # loaded (and its tokenizer found) before the cache moves
    monkeypatch.setenv("TREESPEC_CACHE", str(tmp_path))
    return tmp_path


def _cost_file(target: Target) -> Path:
    return model_store.cache_dir() / "cost" / f"{cost_cache_key(target, 0, NODES, PREFIX)}.json"


UNUSABLE = [
    '{"verify_cost_ms": {"1": NaN, "2": 3.0}}',
    '{"verify_cost_ms": {"1": 2.0, "2": Infinity}}',
    '{"verify_cost_ms": {"1": 0, "2": 0}}',
    '{"verify_cost_ms": {"1": 1e308, "2": 1e308}}',
    '{"verify_cost_ms": {"1": -1.0, "2": 3.0}}',
    '{"verify_cost_ms": {"1": true, "2": 3.0}}',
    '{"verify_cost_ms": {"1": 2.0}}',  # measured at other sizes
    '{"verify_cost_ms": []}',
    "{}",
    "[]",
    "not json",
]


@pytest.mark.parametrize("text", UNUSABLE)
def test_an_unusable_cached_curve_is_measured_again_and_rewritten(cache: Path, text: str) -> None:
    """A cached curve is read by the rule the client reads the welcome by: NaN, an infinity, 0,
    1e308 or a negative value were advertised (and every client refused the welcome); `{}` ended
    the start with KeyError, blamed on the model."""
    target = tiny()
    path = _cost_file(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    curve = cached_verify_cost(target, target.new_kv_cache(64, 16), nodes=NODES, prefix=PREFIX)
    assert cost_curve_error(curve) is None and sorted(curve) == list(NODES)
    assert read_cached_cost(path, NODES) == curve  # rewritten: the next start reads it back


def test_a_usable_cached_curve_is_read_back_not_measured(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tiny()
    path = _cost_file(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"verify_cost_ms": {"1": 2.5, "2": 3.0}}', encoding="utf-8")

    def never(*args: object, **kw: object) -> dict[int, float]:
        raise AssertionError("measured although a usable curve is cached")

    monkeypatch.setattr(cost, "measure_verify_cost", never)
    assert cached_verify_cost(target, target.new_kv_cache(64, 16), nodes=NODES, prefix=PREFIX) == {
        1: 2.5,
        2: 3.0,
    }


def test_a_measured_curve_is_checked_before_it_is_kept_or_advertised(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tiny()
    monkeypatch.setattr(cost, "measure_verify_cost", lambda *a, **k: {1: float("nan"), 2: 3.0})
    with pytest.raises(ValueError, match=r"measured verify cost curve .* is not usable"):
        cached_verify_cost(target, target.new_kv_cache(64, 16), nodes=NODES, prefix=PREFIX)
    assert not _cost_file(target).exists()


def test_a_measurement_never_reads_0_ms(cache: Path) -> None:
    """A forward is timed to 1 us; one faster than that is 0.001 ms, never 0 (which no client takes)."""
    target = tiny()
    curve = cost.measure_verify_cost(target, target.new_kv_cache(64, 16), NODES, PREFIX, repeats=1)
    assert all(ms >= 0.001 for ms in curve.values())


def test_the_service_remeasures_an_unusable_cached_curve_and_clients_take_its_welcome(cache: Path) -> None:
    """The whole start: a NaN curve in the cost cache under the key the service computes; the
    service measures again, rewrites the file, and a client reads its welcome."""
    target = tiny()
    target.model.prepare(False, False)  # as the service prepares a target handed to it
    path = model_store.cache_dir() / "cost" / f"{cost_cache_key(target, 0, DEFAULT_NODES, 64)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"verify_cost_ms": {str(n): float("nan") for n in DEFAULT_NODES}}))
    with service(measure_cost=True) as client, WsSession(client) as sess:
        welcome = sess.hello()
        assert isinstance(welcome, Welcome), welcome
        assert sorted(welcome.verify_cost_ms) == list(DEFAULT_NODES)
        assert cost_curve_error(welcome.verify_cost_ms) is None
    assert read_cached_cost(path, DEFAULT_NODES) == welcome.verify_cost_ms
