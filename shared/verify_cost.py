"""What makes a verify cost curve usable: the rule both sides apply to `welcome.verify_cost_ms`.

A curve maps N tree nodes to the milliseconds of one verify forward with N nodes. The edge sizes
its trees by it (edge_client.speculation.estimates: tokens per ms of a round) and waits for a
verdict in proportion to it (edge_client.session.Timeouts), so a value that is not a real forward
time breaks both: NaN or an infinity poisons every comparison, 0 makes every node free (the
budget divides by the round's time), 1e308 overflows a sum of a few of them. The client refuses
such a welcome (shared.messages.Welcome.from_wire); the verifier checks a curve before it
advertises one, measured or read back from its cost cache (cloud_verifier.cost).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from shared.wire import MAX_U31

# the slowest forward a curve may state: 1e6 s, far beyond any verifier a client would wait for,
# and small enough that a round's sum of a few of them stays finite
MAX_VERIFY_MS = 1e9


def cost_curve_error(curve: Mapping[int, float], allow_zero: bool = False) -> str | None:
    """Why `curve` is not a usable verify cost curve, or None. Node counts are integers in
    [1, 2^31 - 1] ([0, ...] with `allow_zero`: a verdict's maps price a stream step, row 0 alone,
    as 0 nodes); milliseconds are finite, > 0 and at most MAX_VERIFY_MS. An empty curve is
    usable: the verifier measured nothing, and the client sizes its trees without it."""
    lo = 0 if allow_zero else 1
    for n, ms in curve.items():
        if isinstance(n, bool) or not isinstance(n, int) or not lo <= n <= MAX_U31:
            return f"node count {n!r} is not an integer in [{lo}, {MAX_U31}]"
        if isinstance(ms, bool) or not isinstance(ms, int | float):
            return f"{n} nodes: {ms!r} is not a number of milliseconds"
        if not (math.isfinite(ms) and 0 < ms <= MAX_VERIFY_MS):
            return f"{n} nodes: {ms!r} ms is not a forward time (finite, > 0 and <= {MAX_VERIFY_MS:g})"
    return None
