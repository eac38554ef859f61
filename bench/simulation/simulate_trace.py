"""The pieces of bench.simulation.simulate that other simulators share: forward and evaluation cost curves,
traced generations (rounds a real run logged) and the overheads a replay adds."""

from __future__ import annotations

import bisect
import csv
import json
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.lib.stats import median
from edge_client.stats import DraftEvent, RoundTrace, SendEvent, VerdictEvent


@dataclass(frozen=True)
class Curve:
    """ms of one evaluation (drafter) or forward (verifier) of n rows: piecewise linear through
    `points` (rows ascending), flat below the first, the last segment's slope (not below 0)
    beyond the last."""

    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("a cost curve needs at least one (rows, ms) point")
        xs = [p[0] for p in self.points]
        if xs != sorted(xs) or len(set(xs)) != len(xs):
            raise ValueError("a cost curve's rows must be distinct and ascending")
        if any(ms < 0 for _, ms in self.points):
            raise ValueError("a cost curve's ms must be 0 or more")

    def __call__(self, rows: float) -> float:
        pts = self.points
        xs = [p[0] for p in pts]
        if rows <= xs[0] or len(pts) == 1:
            return pts[0][1] if rows <= xs[0] else pts[-1][1]
        if rows >= xs[-1]:
            (x0, y0), (x1, y1) = pts[-2], pts[-1]
            return y1 + max(0.0, (y1 - y0) / (x1 - x0)) * (rows - x1)
        i = bisect.bisect_right(xs, rows)
        (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)

    @classmethod
    def flat(cls, ms: float) -> Curve:
        return cls(((1.0, float(ms)),))

    @classmethod
    def fit(cls, samples: Iterable[tuple[float, float]]) -> Curve:
        """The median ms at each row count seen."""
        by: dict[float, list[float]] = {}
        for rows, ms in samples:
            by.setdefault(float(rows), []).append(float(ms))
        if not by:
            raise ValueError("no samples to fit a cost curve to")
        return cls(tuple((x, statistics.median(by[x])) for x in sorted(by)))

    @classmethod
    def load(cls, path: Path) -> Curve:
        """A curve file: CSV of `rows,ms` lines (a header line is skipped), or JSON as
        {"rows": [...], "ms": [...]}, [[rows, ms], ...], {"<rows>": ms, ...} or the verifier's
        cost file {"verify_cost_ms": {"<nodes>": ms, ...}}, or a GPU check's forward file
        (`bench.kernels.gpu_forward --json`: its first attention mode's forward ms by rows, i.e. the
        product's own attention, `model`, by default)."""
        text = path.read_text(encoding="utf-8")
        pts: list[tuple[float, float]] = []
        if path.suffix.lower() == ".csv":
            for row in csv.reader(text.splitlines()):
                if len(row) < 2:
                    continue
                try:
                    pts.append((float(row[0]), float(row[1])))
                except ValueError:
                    continue  # a header
        else:
            doc = json.loads(text)
            if isinstance(doc, dict) and isinstance(doc.get("verify_cost_ms"), dict):
                doc = doc["verify_cost_ms"]  # the verifier's measured curve (cloud_verifier.cost)
            rows = doc.get("rows") if isinstance(doc, dict) else None
            if isinstance(rows, list) and rows and isinstance(rows[0], dict) and "forward_ms" in rows[0]:
                doc = rows[0]["forward_ms"]  # bench.kernels.gpu_forward: the forward of n rows on the GPU
            if isinstance(doc, dict) and "rows" in doc and "ms" in doc:
                pts = [(float(x), float(y)) for x, y in zip(doc["rows"], doc["ms"], strict=True)]
            elif isinstance(doc, dict):
                pts = [(float(x), float(y)) for x, y in doc.items()]
            elif isinstance(doc, list):
                pts = [(float(p[0]), float(p[1])) for p in doc]
        if not pts:
            raise ValueError(f"{path}: no (rows, ms) points")
        return cls.fit(pts)

    def as_dict(self) -> dict[str, list[float]]:
        return {"rows": [p[0] for p in self.points], "ms": [round(p[1], 3) for p in self.points]}


# --------------------------------------------------------------------------- input
@dataclass(frozen=True)
class TracedGeneration:
    """One traced generation: its trace, and what was measured of it."""

    trace: RoundTrace
    tokens: int
    ms_per_token: float  # measured (wall time / tokens)
    mode: str = ""
    rtt_ms: float = 0.0
    temperature: float = 0.0
    prompt_index: int = 0

    @property
    def wall_ms(self) -> float:
        return self.ms_per_token * self.tokens


def trace_from_dict(d: dict[str, Any]) -> RoundTrace:
    """A RoundTrace from its as_dict() form."""
    return RoundTrace(
        sends=[SendEvent(**e) for e in d.get("sends", [])],
        verdicts=[VerdictEvent(**e) for e in d.get("verdicts", [])],
        drafts=[
            DraftEvent(
                **{**e, "evaluations": tuple((str(k), int(r), float(ms)) for k, r, ms in e["evaluations"])}
            )
            for e in d.get("drafts", [])
        ],
    )


def load_generations(paths: Sequence[Path]) -> tuple[list[TracedGeneration], list[TracedGeneration]]:
    """The traced generations of `bench.end_to_end.network --trace` files: (speculative ones with a trace
    of at least one verdict, mode-ar ones (no trees: their measured ms/token is the reference))."""
    spec: list[TracedGeneration] = []
    ar: list[TracedGeneration] = []
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: cannot read a trace file ({exc})") from None
        gens = doc.get("generations") if isinstance(doc, dict) else None
        if not isinstance(gens, list):
            raise ValueError(f"{path}: no 'generations' list; is it a bench.end_to_end.network --trace file?")
        for g in gens:
            st = g.get("stats") or {}
            gen = TracedGeneration(
                trace=trace_from_dict(g.get("trace") or {}),
                tokens=int(st.get("tokens", 0)),
                ms_per_token=float(st.get("ms_per_token", 0.0)),
                mode=str(g.get("mode", "")),
                rtt_ms=float(g.get("rtt_ms", 0.0)),
                temperature=float(g.get("temperature", 0.0)),
                prompt_index=int(g.get("prompt_index", 0)),
            )
            if gen.mode == "ar":
                ar.append(gen)
            elif gen.trace.verdicts and gen.trace.sends and gen.tokens > 0:
                spec.append(gen)
    return spec, ar


# --------------------------------------------------------------------------- what the log says
@dataclass(frozen=True)
class Overheads:
    """Time the replay does not derive from costs, measured in the traces (ms).

    link:   a round trip beyond the nominal RTT and the verification (framing, sockets, the event
            loops), from the rounds sent with the server idle (after a miss): verdict - send -
            verify - RTT
    server: between two verifications back to back (a hit whose tree was there in time): the
            server's own per-round work outside the verify time (verdict, next tree, gathering)
    """

    link: float = 0.0
    server: float = 0.0

    @classmethod
    def measure(cls, gens: Sequence[TracedGeneration]) -> Overheads:
        link: list[float] = []
        server: list[float] = []
        for g in gens:
            tr = g.trace
            sends = {s.round: s for s in tr.sends}
            vs = tr.verdicts
            for j, v in enumerate(vs):
                s = sends.get(v.round)
                if s is None:
                    continue
                prev = vs[j - 1] if j else None
                if prev is None or not prev.hit:  # sent with nothing in flight
                    if j:  # round 0 carries the prompt's prefill in its verify time
                        link.append((v.t - s.t) * 1e3 - v.verify_ms - g.rtt_ms)
                elif s.t * 1e3 + g.rtt_ms / 2 < prev.t * 1e3 - g.rtt_ms / 2:
                    # at the server before the previous verification ended: back to back
                    server.append((v.t - prev.t) * 1e3 - v.verify_ms)
        return cls(_median0(link), _median0(server))


def _median0(xs: Sequence[float]) -> float:
    return max(0.0, median(xs) or 0.0)
