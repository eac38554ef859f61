"""The target's sampling distribution p, target-only decoding, and the acceptance rules that test
drafts against p (docs/architecture.md §4).

`target_probs` turns target logits into p (temperature, then top-k, then top-p, as in HF
`generate`); every verification algorithm tests drafts against this p. Sampling is by inverse CDF
on ONE uniform per token, so it can be keyed: `keyed_uniform(seed, position)` is a counter-based
uniform (splitmix64 of the session seed and the token's absolute position) shared by target-only
decoding (`sample_next`, the server's mode `ar`) and sample-and-match verification. A seeded
speculative run then emits exactly the tokens of a seeded target-only run.

The acceptance rules of one row of a walk (cloud_verifier/verify.py has the algorithms and the
walk): the speculative-sampling math in the papers' words (`accepts`, `residual`, `draw_proposals`)
and the step of each algorithm at a row (`verify_greedy`, `verify_match`, `verify_rejection`).
`Rules` holds the math as swappable functions so that tests can plant deliberately wrong variants.
"""

from __future__ import annotations

from collections.abc import Callable
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


# ---------------------------------------------------------------------------------------------------
# The acceptance rules of one row of a walk


def accepts(r_x: torch.Tensor, q_x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Accept a draw x with probability min(1, r(x) / q(x)) (Leviathan et al.; SpecInfer Alg. 2).

    r_x, q_x, u: [T]; q_x > 0 for every real draw. Written as u * q < r, so r >= q always accepts
    and r = 0 never does, with no division.
    """
    return u * q_x < r_x


def residual(r: torch.Tensor, q_ids: torch.Tensor, q_probs: torch.Tensor) -> torch.Tensor:
    """After a rejection: r <- norm(max(0, r - q)) (SpecInfer Alg. 2; RSD Algorithm 1).

    r: [T, V] normalised; q as padded sparse rows q_ids [T, Kq], q_probs [T, Kq] (a row of zeros
    leaves r as it is). max(0, r - q) = r - min(r, q) only changes r on q's support.
    If nothing is left (r == q, so the rejection had probability 0) r is kept.
    """
    cut = torch.minimum(r.gather(-1, q_ids), q_probs)
    left = r.scatter_add(-1, q_ids, -cut)
    mass = left.sum(-1, keepdim=True)
    return torch.where(mass > 0, left / mass, r)


def without_earlier(
    q_ids: torch.Tensor, q_probs: torch.Tensor, earlier_tokens: torch.Tensor, same_group: torch.Tensor
) -> torch.Tensor:
    """The proposal of a draw made without replacement (RSD, Sequoia): its group's q with the
    group's earlier draws removed, renormalised.

    q_ids, q_probs: [T, Kq] the group's q row; earlier_tokens [T, J] the tokens of the earlier draws
    at this row, same_group [T, J] which of them are in this draw's group. Returns probs [T, Kq].
    """
    hit = (q_ids.unsqueeze(-1) == earlier_tokens.unsqueeze(-2)) & same_group.unsqueeze(-2)
    left = q_probs.masked_fill(hit.any(-1), 0.0)
    return left / left.sum(-1, keepdim=True).clamp_min(1e-30)


def draw_proposals(
    slot_tokens: torch.Tensor,
    slots: torch.Tensor,
    qrow: torch.Tensor,
    q_ids: torch.Tensor,
    q_probs: torch.Tensor,
    without_replacement: bool,
    vocab: int,
) -> torch.Tensor:
    """q_k(x_k): the probability with which each draw's proposal gave its own token. [T, N + 1, K].

    With replacement (mss) that is q_row(x). Without replacement (rrs) it is
    q_row(x_k) / (1 - sum of q_row(x_j) over the group's earlier draws j). Exact in float32: the q
    values are multiples of 2^-16. slot_tokens, slots, qrow [T, N + 1, K]; q_ids, q_probs [T, R, Kq];
    vocab: V (ids and tokens are < V).
    """
    t, rows, k = slots.shape
    v = vocab
    r_n, width = q_ids.shape[1], q_ids.shape[2]
    # rows are sorted by id, so (row, id) keys are sorted along the flattened rows of each trial
    keys = (torch.arange(r_n, device=q_ids.device).unsqueeze(-1) * v + q_ids).reshape(t, r_n * width)
    want = (qrow.clamp(min=0) * v + slot_tokens).reshape(t, rows * k)
    pos = torch.searchsorted(keys, want).clamp_(max=r_n * width - 1)
    found = keys.gather(1, pos) == want
    qx = torch.where(found, q_probs.reshape(t, -1).gather(1, pos), 0.0).reshape(t, rows, k)
    qx = qx * (slots >= 0)
    if not without_replacement:
        return qx
    same = (qrow.unsqueeze(-1) == qrow.unsqueeze(-2)) & (slots >= 0).unsqueeze(-2)
    earlier = torch.ones(k, k, dtype=torch.bool, device=slots.device).tril(-1)  # [k, j]: j < k
    removed = (qx.unsqueeze(-2) * (same & earlier)).sum(-1)
    return qx / (1.0 - removed).clamp_min(1e-30)


@dataclass(frozen=True)
class Rules:
    """The pieces of the math, swappable so tests can prove that wrong variants get caught."""

    probs: Callable[[torch.Tensor, SamplingParams], torch.Tensor] = target_probs
    accepts: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = accepts
    residual: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = residual


EXACT = Rules()


def follow(slots: torch.Tensor, slot_tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The first child (or draw) at this row whose token is x, else -1.

    slots [T, K] nodes at the current row (-1 none), slot_tokens [T, K] their tokens (-1 none);
    x [T]. Returns [T] int64.
    """
    hit = slot_tokens == x.unsqueeze(-1)
    first = hit.to(torch.uint8).argmax(-1, keepdim=True)
    return torch.where(hit.gather(-1, first), slots.gather(-1, first), -1).squeeze(-1)


def verify_greedy(
    logits: torch.Tensor, slots: torch.Tensor, slot_tokens: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """SpecInfer VerifyGreedy at one row: x = argmax of the target logits; follow the child equal
    to x, else x is the bonus. logits [T, V]; slots, slot_tokens [T, K]. Returns (next [T], x [T])."""
    x = logits.argmax(-1)
    return follow(slots, slot_tokens, x), x


def verify_match(
    p: torch.Tensor, slots: torch.Tensor, slot_tokens: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """Sample-and-match at one row (match / naive): x ~ p by inverse CDF at u; follow the child
    equal to x, else x is the bonus. Exact for any tree: the output token is always x ~ p.
    p [T, V]; slots, slot_tokens [T, K]; u [T] float64. Returns (next [T], x [T])."""
    x = inverse_cdf(p, u)
    return follow(slots, slot_tokens, x), x


def verify_rejection(
    p: torch.Tensor,
    slots: torch.Tensor,
    slot_tokens: torch.Tensor,
    slot_q: torch.Tensor,
    qrow: torch.Tensor,
    q_ids: torch.Tensor,
    q_probs: torch.Tensor,
    u_accept: torch.Tensor,
    u_bonus: torch.Tensor,
    without_replacement: bool,
    rules: Rules = EXACT,
    sync_free: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Multi-step speculative sampling (SpecInfer Alg. 2) or, `without_replacement`, recursive
    rejection sampling (RSD / Sequoia) at one row: the same loop, only the proposals differ.

    Draws are tested in draw order, each with ratio r(x) / q_k(x) against its own proposal q_k (its
    q row; without replacement, minus the group's earlier draws, renormalised); after each
    rejection r <- norm(max(0, r - q_k)). If every draw is rejected (or there is none: a leaf) the
    bonus is sampled from the residual (= p at a leaf).
    p [T, V]; slots, slot_tokens (-1 none), qrow [T, K] at this row; slot_q [T, K] q_k(x_k)
    (`draw_proposals`);
    q_ids, q_probs [T, R, Kq]; u_accept [T, K] float32; u_bonus [T] float64.
    sync_free: test all K slots without reading anything back; a trial with no draw left to test
    keeps its residual as it is, so the bonus is that of the early-stopping loop.
    Returns (next [T] accepted node or -1, bonus [T] valid where next < 0).
    """
    r = p
    nxt = torch.full_like(slots[:, 0], -1)
    testing = torch.ones_like(slots[:, 0], dtype=torch.bool)  # no draw accepted yet (leaves included)
    valid = slots[:, 0] >= 0
    slot_tokens = slot_tokens.clamp(min=0)
    for k in range(slots.shape[1]):
        node = slots[:, k]
        if k:
            valid = testing & (node >= 0)
        # syncs: stop as soon as no trial has a draw left to test (T = 1: usually after one draw)
        if not sync_free and not bool(valid.any()):
            break
        r_x = r.gather(-1, slot_tokens[:, k : k + 1]).squeeze(-1)
        ok = valid & rules.accepts(r_x, slot_q[:, k], u_accept[:, k])
        nxt = torch.where(ok, node, nxt)
        testing = testing & ~ok
        if not sync_free and not bool(testing.any()):
            return nxt, torch.zeros_like(nxt)
        trials = torch.arange(p.shape[0], device=p.device)
        row = qrow[:, k].clamp(min=0)
        ids, probs = q_ids[trials, row], q_probs[trials, row]  # [T, Kq]
        if without_replacement and k:
            probs = without_earlier(ids, probs, slot_tokens[:, :k], qrow[:, :k] == qrow[:, k : k + 1])
        left = rules.residual(r, ids, probs * valid.unsqueeze(-1))
        r = torch.where(valid.unsqueeze(-1), left, r) if sync_free else left
    return nxt, inverse_cdf(r, u_bonus)
