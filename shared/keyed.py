"""Counter-based uniforms keyed by (session seed, absolute position) (PROTOCOL.md section 7).

Sample-and-match verification and target-only decoding draw the token at absolute position `pos`
of a seeded session by inverse CDF at `keyed_uniform(seed, pos)`. The edge knows the seed it sent,
so it can draft with the same uniforms (edge_client.trees.Coupling): where the draft's
distribution is close to the target's, the two inverse-CDF draws agree, and the draft proposes the
very token the target will sample.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
# an inverse-CDF threshold is u * total capped at total * BELOW_ONE: strictly below the total, so a
# token with zero mass is never drawn (both the verifier and the edge's coupled drafting use it)
BELOW_ONE = 1.0 - 2.0**-50


def _mix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finalizer (a bijection of uint64), elementwise."""
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    out: np.ndarray = x ^ (x >> np.uint64(31))
    return out


def keyed_uniforms(seeds: np.ndarray | int, positions: np.ndarray | int) -> np.ndarray:
    """Counter-based uniforms in [0, 1) keyed by (seed, absolute position), float64, broadcast shape.

    splitmix64: the stream of `seed` starts at mix64(seed) and advances by the golden gamma per
    position; the top 53 bits of the mixed state give the uniform (an exact float64).
    """
    with np.errstate(over="ignore"):
        s = np.asarray(seeds, dtype=np.int64).astype(np.uint64)
        pos = np.asarray(positions, dtype=np.int64).astype(np.uint64)
        h = _mix64(_mix64(np.atleast_1d(s)) + (pos + np.uint64(1)) * _GOLDEN)
    out: np.ndarray = (h >> np.uint64(11)).astype(np.float64) * 2.0**-53
    return out.reshape(np.broadcast_shapes(np.shape(seeds), np.shape(positions)))


def keyed_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) that samples the token at absolute `position` of session `seed`."""
    return float(keyed_uniforms(seed, position))
