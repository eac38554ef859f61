"""The acceptance rules of one row of a walk (cloud_verifier/verify.py has the algorithms and the
walk): the speculative-sampling math in the papers' words (`accepts`, `residual`, `draw_proposals`)
and the step of each algorithm at a row (`verify_greedy`, `verify_match`, `verify_rejection`).
`Rules` holds the math as swappable functions so that tests can plant deliberately wrong variants."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cloud_verifier.sampling import (
    SamplingParams,
    inverse_cdf,
    target_probs,
)


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
