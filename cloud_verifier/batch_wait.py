"""How long a forward may wait for edge rounds about to arrive: a bound from the verify cost curve.

Edge rounds arrive staggered (each edge is ready only after its round trip and its drafting), so
a forward that starts the moment anything is ready carries few sessions. Waiting a little to fill
the batch (SpecEdge, arXiv 2505.17052) pays only where added rows are nearly free.

The rule (`plan_wait`), from F(rows), the forward's ms for a batch of that many rows (`forward_ms`
of the engine's measured curve `cost_ms`, {N nodes: ms} for one session's row 0 + N nodes, so
F(rows) = cost_ms at N = rows - 1; read afresh at every decision, it is refreshed live):

- ready now: R rows of S_R sessions; each session between rounds (WAITING) whose arrival can be
  predicted from its own recent gaps between verdict and next round (`ArrivalPredictor`: the
  median of its last gaps, the next round's rows = its last round's) is expected w_j from now
  with r_j rows, give or take s_j (the median absolute deviation of its gaps): it is waited for
  until w_j + s_j (`Arrival.by_ms`, the wait that takes it in even when it comes a usual amount
  late; the engine goes as soon as it arrives); one later than that is not waited for (its edge
  is late: no estimate).
- waiting w for the set A of sessions expected by w (S_A sessions, r_A rows) against going now,
  when those come in during the forward of R and run in a forward of their own right after it
  (w: the wait that takes in the last of them):
    * the ready sessions' verdicts come later by  w + F(R + r_A) - F(R)  (the wait, and the rows
      the arrivals add to their forward);
    * the arrivals' verdicts come earlier by  F(R) + F(r_A) - F(R + r_A) - w = D_A - w, D_A the
      forward saved by sharing one (their own forward after R's, less what they add to R's);
  so the wait pays when the session-weighted sum is positive:
      gain(w) = S_A * (D_A - w) - S_R * (w + F(R + r_A) - F(R)) > 0
  and the engine waits for the candidate w (an expected arrival) of the largest gain; none: 0.
- the wait is bounded: at most `gather_ms` (EngineConfig, the configured upper bound) and at most
  FORWARD_FRACTION of F(R) (a batch never waits longer than half a forward for company); an
  arrival beyond the bound is not a candidate. No curve (cost measurement off): no wait.

What it gives: a flat curve (a GPU's: F = c for any rows) has F(R + r) = F(R) and D = c, so
gain = S_A * (c - w) - S_R * w > 0 while w < c * S_A / (S_A + S_R): with c = 16 ms, one session
ready and one expected in 2 ms, it waits 2 ms (bounded by gather_ms). A curve where every row
adds forward time (this CPU's: 1 row 69 ms, 4 rows 84, 8 rows 132, 16 rows 252) makes
F(R + r) - F(R) about as large as D: one tree round of 4 nodes ready and one expected in 1 ms,
F(5) = 96, F(10) = 162, D = 30, gain = (30 - 1) - (1 + 66) < 0: no wait. (One-row rounds, mode
`ar`, sit on the flat start of that CPU curve, 69 -> 74 ms for 2 rows: there a wait of a few ms
does pay, and the rule takes it.)
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

FORWARD_FRACTION = 0.5  # the longest wait, as a fraction of the ready rows' forward
MIN_WAIT_MS = 0.05  # a shorter wait is none (the arrival it waits for is as good as here)
GAP_HISTORY = 8  # a session's last gaps its next arrival is predicted from (their median)


def forward_ms(curve: Mapping[int, float], rows: int) -> float | None:
    """F(rows): a forward of `rows` rows at the cost curve {N nodes: ms} (N nodes = N + 1 rows),
    linear between measured N, flat below the first, the last segment's slope (not below 0)
    beyond the last; None without a curve."""
    if not curve:
        return None
    pts = sorted((int(n), float(ms)) for n, ms in curve.items())
    n = max(0, rows - 1)
    if n <= pts[0][0] or len(pts) == 1:
        return pts[0][1] if n <= pts[0][0] else pts[-1][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if n <= x1:
            return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    return y1 + max(0.0, (y1 - y0) / (x1 - x0)) * (n - x1)


@dataclass(frozen=True)
class Arrival:
    """A session between rounds: its next round expected `in_ms` from now (negative: late), give
    or take `spread_ms` (how much its gaps vary), with `rows` rows."""

    in_ms: float
    rows: int
    spread_ms: float = 0.0

    @property
    def by_ms(self) -> float:
        """The wait that takes it in: its expected arrival plus its spread (a jittery edge is waited
        for as long as it usually may take; one later than that is not waited for)."""
        return self.in_ms + self.spread_ms


def wait_bound_ms(curve: Mapping[int, float], ready_rows: int, gather_ms: float) -> float:
    """The longest a forward of `ready_rows` may wait: min(gather_ms, FORWARD_FRACTION x F(R));
    0 without a curve."""
    f = forward_ms(curve, ready_rows)
    if f is None or ready_rows <= 0:
        return 0.0
    return max(0.0, min(gather_ms, FORWARD_FRACTION * f))


def plan_wait(
    curve: Mapping[int, float],
    ready_rows: int,
    ready_sessions: int,
    arrivals: Iterable[Arrival],
    bound_ms: float,
) -> float:
    """The ms to wait before a forward of `ready_rows` rows of `ready_sessions` sessions (module
    docstring): the expected arrival within `bound_ms` of the largest positive gain, else 0."""
    f_r = forward_ms(curve, ready_rows)
    if f_r is None or ready_rows <= 0 or bound_ms <= 0:
        return 0.0
    best_w, best_gain = 0.0, 0.0
    s_a = r_a = 0
    for a in sorted((a for a in arrivals if 0 <= a.by_ms <= bound_ms), key=lambda a: a.by_ms):
        w = a.by_ms
        s_a += 1
        r_a += max(1, a.rows)
        f_a, f_all = forward_ms(curve, r_a), forward_ms(curve, ready_rows + r_a)
        assert f_a is not None and f_all is not None
        saved = f_r + f_a - f_all
        gain = s_a * (saved - w) - max(1, ready_sessions) * (w + f_all - f_r)
        if gain > best_gain:
            best_w, best_gain = w, gain
    return best_w if best_w > MIN_WAIT_MS else 0.0


class ArrivalPredictor:
    """Each session's next round, predicted from its own gaps: the time from a verdict that left
    it between rounds (WAITING) to its next round being submitted (the edge's round trip and
    drafting; a pending conditional tree submitted at once is not a gap here). Times in seconds
    on one clock (time.perf_counter in the engine)."""

    def __init__(self, history: int = GAP_HISTORY) -> None:
        self._gaps: dict[int, deque[float]] = {}
        self._since: dict[int, tuple[float, int]] = {}  # sid -> (verdict time, its round's rows)
        self._history = history

    def verdict(self, sid: int, t: float, rows: int) -> None:
        """Session `sid` got a verdict at `t` and is now between rounds; its round had `rows` rows."""
        self._since[sid] = (t, rows)

    def submitted(self, sid: int, t: float) -> None:
        """Session `sid` submitted its next round at `t`: the gap since its verdict is noted."""
        since = self._since.pop(sid, None)
        if since is not None:
            self._gaps.setdefault(sid, deque(maxlen=self._history)).append(max(0.0, t - since[0]))

    def idle(self, sid: int) -> None:
        """The session's generation ended or began anew: no round is expected until it submits."""
        self._since.pop(sid, None)

    def forget(self, sid: int) -> None:
        self._since.pop(sid, None)
        self._gaps.pop(sid, None)

    def expected(self, sid: int, now: float) -> Arrival | None:
        """When the session's next round should arrive, from `now` (None: not between rounds, or
        no gap measured yet)."""
        since, gaps = self._since.get(sid), self._gaps.get(sid)
        if since is None or not gaps:
            return None
        mid = statistics.median(gaps)
        spread = statistics.median(abs(g - mid) for g in gaps)  # the median absolute deviation
        return Arrival((since[0] + mid - now) * 1e3, since[1], spread * 1e3)
