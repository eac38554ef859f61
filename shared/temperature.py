"""Temperature scaling that stays finite for every temperature the protocol accepts.

Sampling at temperature T uses softmax(logits / T). For a tiny T the quotient overflows (in float32
already at T ~ 1e-38 for logits near 10; any float at T = 1e-300), and softmax of infinities is NaN:
the sampler then returned the last vocabulary id, and a NaN row broke top-p for every session of
the engine step. As T -> 0+ softmax(logits / T) tends to the uniform distribution over the row's
maxima (one-hot at the argmax when it is unique), so below MIN_SCALED_TEMPERATURE the scaled row is
replaced by that limit: 0 at the maxima, -inf elsewhere. Above it, logits / T is what it always was
(bit for bit), and finite for any |logit| < 3e8 in float32.
"""

from __future__ import annotations

import numpy as np

MIN_SCALED_TEMPERATURE = 1e-30


def tempered(logits: np.ndarray, temperature: float) -> np.ndarray:
    """logits / temperature along the last axis, or its T -> 0+ limit (0 at the maxima, -inf
    elsewhere) below MIN_SCALED_TEMPERATURE. logits [..., V] float; temperature > 0."""
    if temperature >= MIN_SCALED_TEMPERATURE:
        return logits / temperature
    top = logits.max(axis=-1, keepdims=True)
    return np.where(logits == top, 0.0, -np.inf).astype(logits.dtype)
