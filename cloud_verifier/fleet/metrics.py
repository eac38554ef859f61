"""The fleet's `/metrics`: every live replica's Prometheus metrics in one exposition.

Through Serve's proxy a request reaches one replica, so every replica sends what its own `/metrics`
renders to the fleet's board (`status.py`) each second, and a replica's `/metrics` answers with all
of them (`app.py`). `merge` writes each family once, with every replica's samples under it, each
sample labelled `replica` (Serve's replica id) and `node` (its node's IP). A replica whose text
does not parse, or was over MAX_BYTES (`bound`: neither the board nor a scrape holds more), is left
out with a comment line saying why.

No Ray here: `merge` is a pure function of the replicas' texts.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

MAX_BYTES = 4 << 20  # one replica's exposition (ours are ~20 KB)
_NOTE_CHARS = 300


@dataclass(frozen=True)
class ReplicaMetrics:
    """One replica's exposition: Serve's replica id, its node's IP and the text its `/metrics`
    renders; `refused` says why the text was not kept (it is then empty)."""

    replica: str
    node: str
    text: str
    refused: str = ""


def bound(metrics: ReplicaMetrics) -> ReplicaMetrics:
    """`metrics`, or without its text when that is over MAX_BYTES."""
    size = len(metrics.text.encode())
    if size <= MAX_BYTES:
        return metrics
    return replace(metrics, text="", refused=f"{size} bytes of metrics, over the limit of {MAX_BYTES}")


class _Families:
    """The merged families as a collector `generate_latest` writes (HELP and TYPE once each)."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families


def merge(replicas: Iterable[ReplicaMetrics], notes: Sequence[str] = ()) -> str:
    """One exposition of the replicas' metrics, each sample labelled with its replica and node,
    then a comment line for each replica left out and each of `notes`."""
    families: dict[str, Metric] = {}
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()  # (sample name, labels) written
    left_out = list(notes)
    for r in replicas:
        where = f"replica {r.replica} on {r.node}"
        if r.refused:
            left_out.append(f"{where} left out: {r.refused}")
            continue
        try:
            parsed = list(text_string_to_metric_families(r.text))  # all of it before any is kept
        except ValueError as exc:
            left_out.append(f"{where} left out: its metrics do not parse ({exc})")
            continue
        for family in parsed:
            merged = families.setdefault(
                family.name, Metric(family.name, family.documentation, family.type, family.unit)
            )
            if merged.type != family.type:
                left_out.append(
                    f"{where}: {family.name} left out, a {family.type} where others have a {merged.type}"
                )
                continue
            for sample in family.samples:
                labels = {**sample.labels, "replica": r.replica, "node": r.node}
                key = (sample.name, tuple(sorted(labels.items())))
                if key not in seen:  # a series twice would make the exposition invalid
                    seen.add(key)
                    merged.samples.append(sample._replace(labels=labels))
    text = generate_latest(_Families(families.values())).decode()
    return text + "".join(f"# {_one_line(note)}\n" for note in left_out)


def _one_line(note: str) -> str:
    flat = " ".join(note.split())
    return flat if len(flat) <= _NOTE_CHARS else flat[: _NOTE_CHARS - 3] + "..."
