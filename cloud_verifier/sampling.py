"""The target's sampling distribution p and target-only decoding (docs/architecture.md §4).

`target_probs` turns target logits into p (temperature, then top-k, then top-p, as in HF
`generate`); every verification algorithm tests drafts against this p. Sampling is by inverse CDF
on ONE uniform per token, so it can be keyed: `keyed_uniform(seed, position)` is a counter-based
uniform (splitmix64 of the session seed and the token's absolute position) shared by target-only
decoding (`sample_next`, the server's mode `ar`) and sample-and-match verification. A seeded
speculative run then emits exactly the tokens of a seeded target-only run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shared.keyed import BELOW_ONE, keyed_uniform
from shared.temperature import MIN_SCALED_TEMPERATURE

_TOP_P_FIRST_K = 256  # top-p looks at this many tokens first and widens only when they hold < top_p


@dataclass(frozen=True)
class SamplingParams:
    """The target's sampling parameters, applied to its logits before verification."""

    temperature: float = 0.0  # 0 means greedy (p is one-hot at the argmax)
    top_k: int = 0  # 0 = off; applied before any sort
    top_p: float = 1.0  # 1 = off

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def target_probs(
    logits: torch.Tensor, params: SamplingParams, *, sync_free: bool | None = None
) -> torch.Tensor:
    """p: the target's sampling distribution, float32, same shape as `logits` [..., V].

    Temperature 0 gives a one-hot p at the argmax (first index on ties), so that every stochastic
    algorithm reduces exactly to greedy decoding. top-k uses `torch.topk` (no full sort); top-p keeps
    the smallest most-likely prefix whose mass reaches top_p (at least one token; tokens tied with
    its last one are kept too), see `top_p_threshold`. sync_free: never wait for the device (None:
    off on a CPU, on elsewhere); the result is the same either way.
    """
    x = logits.float()
    if params.greedy:
        return torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
    x = tempered(x, params.temperature)
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        vals, idx = torch.topk(x, params.top_k, dim=-1)  # sorted, most likely first
        kept = _top_p(torch.softmax(vals, -1), params.top_p)
        return torch.zeros_like(x).scatter_(-1, idx, kept)
    probs = torch.softmax(x, -1)
    if params.top_p >= 1.0:
        return probs
    flat = probs.reshape(-1, vocab)
    threshold = top_p_threshold(flat, params.top_p, sync_free=sync_free).reshape(*probs.shape[:-1], 1)
    kept = probs * (probs >= threshold)
    return kept / kept.sum(-1, keepdim=True)


def tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits [..., V] / temperature, or below MIN_SCALED_TEMPERATURE its T -> 0+ limit: 0 at the
    row's maxima, -inf elsewhere (shared.temperature; the quotient would overflow to inf and softmax
    would give NaN)."""
    if temperature >= MIN_SCALED_TEMPERATURE:
        return logits if temperature == 1.0 else logits / temperature
    top = logits.amax(-1, keepdim=True)
    return torch.full_like(logits, float("-inf")).masked_fill_(logits == top, 0.0)


def top_p_threshold(probs: torch.Tensor, top_p: float, *, sync_free: bool | None = None) -> torch.Tensor:
    """The smallest probability top-p keeps: min{p_i : mass of the tokens more likely than i < top_p}.

    probs [T, V] float32 (a softmax). Returns [T, 1]; top-p keeps exactly the tokens with p >= it.
    When every row's most likely token alone holds top_p that is its probability (one max);
    otherwise a radix select over the float bits finds it in O(V) with no sort (a long flat tail can
    put most of the vocabulary in the nucleus, where a full sort costs ~3 ms per 49,152-token row).

    sync_free (None: everywhere but on a CPU): no read-back to the host (a GPU would otherwise
    wait at every walked row): both answers are computed and the radix rounds run over whole rows
    (`_radix_threshold_dense`), with bit-identical results.
    """
    top = probs.amax(-1, keepdim=True)
    if sync_free is None:
        sync_free = probs.device.type != "cpu"
    if sync_free:
        return torch.where(top >= top_p, top, _radix_threshold_dense(probs, top_p))
    if bool((top >= top_p).all()):  # a sync, only in top-p mode
        return top
    return _radix_threshold(probs, top_p)


def _radix_threshold(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`top_p_threshold` by radix select: non-negative floats order like their int32 bits, so three
    rounds of 10 bits (a 1024-bucket mass histogram each) pin down the threshold's bits. Only the
    first round reads the whole row; the next two see the tokens of the chosen bucket. [T, 1]."""
    t = probs.shape[0]
    bits = probs.contiguous().view(torch.int32)  # p in [0, 1]: bit 30 is 0, so 3 x 10 bits cover it
    p64 = probs.double()  # masses in float64: the boundary token's mass-ahead is exact to ~1e-16
    digit = (bits >> 20).long()
    mass = p64.new_zeros(t, 1024).scatter_add_(1, digit, p64)
    value, above = _threshold_digit(mass, p64.new_zeros(t, 1), top_p)
    row, col = (digit == value).nonzero(as_tuple=True)  # the chosen bucket's tokens (a sync)
    cand_bits, weight = bits[row, col], p64[row, col]
    for shift in (10, 0):
        digit = ((cand_bits >> shift) & 1023).long()
        mass = p64.new_zeros(t, 1024).index_put_((row, digit), weight, accumulate=True)
        d, above = _threshold_digit(mass, above, top_p)
        value = (value << 10) | d
        weight = torch.where(digit == d[row, 0], weight, 0.0)
    return value.int().view(torch.float32)


def _radix_threshold_dense(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`_radix_threshold` without `nonzero` (a device sync): the second and third rounds scatter
    whole rows with zero mass outside the chosen bucket. The nonzero masses are added in the same
    order and adding 0.0 changes no float, so the threshold is the same bit for bit. [T, 1]."""
    t = probs.shape[0]
    bits = probs.contiguous().view(torch.int32)
    p64 = probs.double()
    digit = (bits >> 20).long()
    mass = p64.new_zeros(t, 1024).scatter_add_(1, digit, p64)
    value, above = _threshold_digit(mass, p64.new_zeros(t, 1), top_p)
    weight = torch.where(digit == value, p64, 0.0)  # the chosen bucket's tokens
    for shift in (10, 0):
        digit = ((bits >> shift) & 1023).long()
        mass = p64.new_zeros(t, 1024).scatter_add_(1, digit, weight)
        d, above = _threshold_digit(mass, above, top_p)
        value = (value << 10) | d
        weight = torch.where(digit == d, weight, 0.0)
    return value.int().view(torch.float32)


def _threshold_digit(
    mass: torch.Tensor, above: torch.Tensor, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The last bucket d whose values, with every larger value, still hold top_p, and the mass
    of the values above bucket d. mass [T, 1024] per bucket; above [T, 1] mass of the larger
    buckets already passed. Returns d [T, 1] int64, above [T, 1]."""
    after = mass.sum(-1, keepdim=True) - torch.cumsum(mass, -1)  # mass of buckets > d
    d = ((after + mass + above >= top_p).sum(-1, keepdim=True) - 1).clamp_(min=0)
    return d, above + after.gather(1, d)


def _top_p(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Renormalised nucleus of probabilities sorted most likely first. [..., k] -> [..., k]."""
    if top_p >= 1.0:
        return sorted_probs / sorted_probs.sum(-1, keepdim=True)
    before = torch.cumsum(sorted_probs, -1) - sorted_probs  # mass strictly ahead of each token
    kept = sorted_probs * (before < top_p)
    return kept / kept.sum(-1, keepdim=True)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample one token per row by inverse CDF: probs [T, V] (need not be normalised), u [T] in [0, 1).

    Returns the first token whose CDF exceeds u * total, [T] int64. The CDF is accumulated in
    float64, so each token's share is exact to ~1e-16 whatever V (a float32 running sum over 49,152
    tokens could misplace ~1e-3 of the mass), and the threshold stays strictly below the total, so a
    token with zero mass is never returned.
    """
    cdf = torch.cumsum(probs, -1, dtype=torch.float64)  # [T, V]
    total = cdf[:, -1:]
    threshold = torch.minimum(u.unsqueeze(-1) * total, total * BELOW_ONE)
    # an all-zero row (no mass at all: a caller's bug) still gets an in-range token
    return torch.searchsorted(cdf, threshold, right=True).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


def sample_next(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> int:
    """Target-only decoding of the token at absolute `position` from its logits [V].

    Argmax at temperature 0, else inverse CDF of `target_probs` at `keyed_uniform(seed, position)`:
    the same rule sample-and-match verification applies at every tree node.
    """
    if params.greedy:
        return int(logits.argmax())
    p = target_probs(logits.unsqueeze(0), params)
    u = torch.tensor([keyed_uniform(seed, position)], dtype=torch.float64, device=logits.device)
    return int(inverse_cdf(p, u)[0])


def sample_next_async(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> torch.Tensor:
    """`sample_next` without reading the token back: [1] int64 on the logits' device (the engine
    reads every session's verdict with one copy per step). The same token, bit for bit."""
    if params.greedy:
        return logits.argmax().reshape(1)
    p = target_probs(logits.unsqueeze(0), params, sync_free=True)
    u = to_device(np.array([keyed_uniform(seed, position)], dtype=np.float64), logits.device)
    return inverse_cdf(p, u)


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device` without waiting for the device: on a GPU through pinned memory with
    a non-blocking copy (a pageable copy waits for every kernel queued before it)."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    if device.type == "cpu":
        return t
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
