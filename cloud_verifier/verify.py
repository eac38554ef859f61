"""Exact verification of token trees (DESIGN sections 3.1 and 4): pure functions over torch tensors.

Terms (as in vLLM's rejection sampler): a walk starts at row 0 (the last committed token) and at
each row tests the draws (or children) there; an accepted draw moves the walk to its node, and the
first row where nothing is accepted emits the BONUS token (the recovered token after a rejection,
or a fresh sample from p after a leaf). Output = accepted tokens, then the bonus.

Algorithms, one small function each:
  greedy  SpecInfer VerifyGreedy (arXiv 2305.09781, Algorithm 2 with greedy decoding).
  match   sample-and-match: draw x ~ p (keyed by session seed and absolute position, exactly like
          `sample_next`), follow the child whose token is x, else emit x. Exact for any tree.
  naive   the same rule with unkeyed randomness: SpecInfer's naive sampling (Section 4.3).
  mss     SpecInfer multi-step speculative sampling (Algorithm 2, VerifyStochastic): draws in draw
          order, each tested against its own q row with ratio r(x) / q(x); after a rejection the
          residual r <- norm(max(0, r - q)), once per draw, duplicates included.
  rrs     recursive rejection sampling for draws made WITHOUT replacement (RSD arXiv 2402.14160,
          Sequoia arXiv 2402.12374): the k-th draw of a group was sampled from q with the group's
          earlier draws removed and renormalised; it is tested against, and the residual updated
          with, that distribution. Groups (one q row each) are independent.

Everything is batched over a leading trial dimension T (production calls it with T = 1 through
`verify_tree`), runs where the logits live, and only the rows on the walked path are softmaxed.

Host synchronisation: on a CPU the walk reads its position back at every depth (and mss / rrs
after every tested draw) to stop early. `sync_free` walks (the default off the CPU: a GPU would
otherwise idle at every node and draw) run every depth and every draw with the decisions kept on
the device; finished walks and tested-out draws leave their state untouched, so the verdict is
bit for bit the one of the early-stopping walk. `verify_tree_async` returns it packed on the device
and `read_verdicts` brings every session's verdict of an engine step to the host in ONE copy.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from cloud_verifier.sampling import (
    SamplingParams,
    inverse_cdf,
    sample_next,
    target_probs,
    to_device,
)
from shared.keyed import keyed_uniform, keyed_uniforms
from shared.messages import Mode
from shared.sparse import Q_TOTAL, SparseRows
from shared.tree import TokenTree

__all__ = [
    "EXACT",
    "MODES",
    "Algorithm",
    "BatchResult",
    "Rules",
    "SamplingParams",
    "TreeBatch",
    "Uniforms",
    "VerifyResult",
    "keyed_uniform",
    "read_verdicts",
    "sample_next",
    "target_probs",
    "verify_batch",
    "verify_tree",
    "verify_tree_async",
]


class Algorithm(str, enum.Enum):
    """The verification algorithms (module doc). The wire's `Mode` names all but `naive` (a baseline
    for the statistical tests) and adds `ar` (no tree to verify): `Algorithm.of` maps one to one."""

    GREEDY = "greedy"
    MATCH = "match"
    NAIVE = "naive"
    MSS = "mss"
    RRS = "rrs"

    @property
    def stochastic(self) -> bool:
        """Whether the algorithm tests draws against q rows (the tree must carry them)."""
        return self in (Algorithm.MSS, Algorithm.RRS)

    @classmethod
    def of(cls, mode: Mode, params: SamplingParams) -> Algorithm:
        """The algorithm a session in `mode` is verified with (match at temperature 0 is greedy)."""
        if mode is Mode.AR:
            raise ValueError("mode ar decodes with the target alone; it has no tree to verify")
        if mode is Mode.MATCH and params.temperature == 0:
            return cls.GREEDY
        return cls(mode.value)


MODES = tuple(Algorithm)


# --------------------------------------------------------------------------- tree tensors
def draw_slots(tree: TokenTree) -> tuple[np.ndarray, np.ndarray]:
    """The draws (stochastic trees) or children (deterministic trees) at each row, in order.

    Returns slots [N + 1, K] int64 (the node made by the k-th draw at row r; row 0 = the last
    committed token, row 1 + i = node i; -1 = none) and qrow [N + 1, K] int64 (that draw's q row,
    -1 for none or for a deterministic tree). A node shared by several draws appears once per draw.
    """
    n = tree.num_nodes
    if tree.draws is not None:
        node = tree.draws.node.astype(np.int64)
        qrow = tree.draws.qrow.astype(np.int64)
    else:
        node = np.arange(n, dtype=np.int64)
        qrow = np.full(n, -1, dtype=np.int64)
    row = tree.parents.astype(np.int64)[node] + 1
    order = np.argsort(row, kind="stable")  # draw order (node order) within each row
    counts = np.bincount(row, minlength=n + 1)
    start = np.concatenate(([0], np.cumsum(counts)[:-1]))
    rank = np.arange(row.size) - start[row[order]]
    k = max(int(counts.max(initial=0)), 1)
    slots = np.full((n + 1, k), -1, dtype=np.int64)
    rows = np.full((n + 1, k), -1, dtype=np.int64)
    slots[row[order], rank] = node[order]
    rows[row[order], rank] = qrow[order]
    return slots, rows


def padded_rows(q: SparseRows) -> tuple[np.ndarray, np.ndarray]:
    """CSR q rows as padded arrays: ids [R, Kq] int64 and probs [R, Kq] float32 (weight / 2^16, exact
    in float32). A row is padded with its last id at probability 0, so ids stay sorted and in range."""
    lengths = np.diff(q.ptr)
    width = max(int(lengths.max(initial=0)), 1)
    row = np.repeat(np.arange(lengths.size), lengths)
    col = np.arange(q.ids.size) - q.ptr[:-1][row]
    ids = np.repeat(q.ids[q.ptr[1:] - 1].astype(np.int64)[:, None], width, axis=1)
    probs = np.zeros((lengths.size, width), dtype=np.float32)
    ids[row, col] = q.ids
    probs[row, col] = q.weights / Q_TOTAL
    return ids, probs


@dataclass(frozen=True)
class TreeBatch:
    """T token trees of at most N nodes on one device; each trial may have its own topology.

    q rows are padded sparse rows (u16 weights / 2^16; ids sorted within a row, pads at probability
    0), one set per trial. Tensors may be expanded (stride 0) along T where trials share them.
    """

    tokens: torch.Tensor  # [T, N] int64, token of each node
    slots: torch.Tensor  # [T, N + 1, K] int64, node made by the k-th draw/child at each row, -1 none
    committed_len: np.ndarray  # [T] int64, L of each trial (host: keys the sampler by position)
    depth: int  # max node depth over the batch (the walk visits at most depth + 1 rows)
    qrow: torch.Tensor | None = None  # [T, N + 1, K] int64, q row of each draw, -1 none
    q_ids: torch.Tensor | None = None  # [T, R, Kq] int64, token ids of each q row, sorted
    q_probs: torch.Tensor | None = None  # [T, R, Kq] float32, q(id); pads 0

    @property
    def num_trials(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def is_stochastic(self) -> bool:
        return self.qrow is not None

    @classmethod
    def from_tree(cls, tree: TokenTree, device: torch.device | str = "cpu") -> TreeBatch:
        """One tree as a batch of one (the production path)."""
        dev = torch.device(device)
        slots, qrow = draw_slots(tree)
        tokens = to_device(tree.tokens.astype(np.int64), dev).unsqueeze(0)
        lens = np.array([tree.committed_len], dtype=np.int64)
        if tree.draws is None:
            return cls(tokens, to_device(slots, dev)[None], lens, tree.max_depth)
        ids, probs = padded_rows(tree.draws.q)
        return cls(
            tokens,
            to_device(slots, dev)[None],
            lens,
            tree.max_depth,
            to_device(qrow, dev)[None],
            to_device(ids, dev)[None],
            to_device(probs, dev)[None],
        )

    @classmethod
    def stack(cls, batches: Sequence[TreeBatch]) -> TreeBatch:
        """The trials of several batches as one, padded to the largest N, K, R and row width (their
        logits must be padded to the same N + 1 rows; padded rows are never visited)."""
        n = max(b.tokens.shape[1] for b in batches)
        k = max(b.slots.shape[2] for b in batches)
        stochastic = {b.is_stochastic for b in batches}
        if len(stochastic) != 1:
            raise ValueError("cannot stack stochastic and deterministic trees")

        def cat(xs: list[torch.Tensor], value: int | float, mode: str = "constant") -> torch.Tensor:
            width = max(x.shape[-1] for x in xs)
            rows = max(x.shape[-2] for x in xs) if xs[0].dim() == 3 else 0
            out = []
            for x in xs:
                if x.shape[-1] < width:
                    x = F.pad(
                        x, (0, width - x.shape[-1]), mode=mode, value=None if mode != "constant" else value
                    )
                if rows and x.shape[-2] < rows:
                    x = F.pad(x, (0, 0, 0, rows - x.shape[-2]), value=value)
                out.append(x)
            return torch.cat(out)

        tokens = cat([b.tokens for b in batches], 0)
        slots = cat([F.pad(b.slots, (0, k - b.slots.shape[2]), value=-1) for b in batches], -1)
        lens = np.concatenate([b.committed_len for b in batches])
        depth = max(b.depth for b in batches)
        if not stochastic.pop():
            return cls(tokens, slots, lens, depth)
        qrow = cat(
            [F.pad(b.qrow, (0, k - b.qrow.shape[2]), value=-1) for b in batches if b.qrow is not None], -1
        )
        ids = cat([b.q_ids.float() for b in batches if b.q_ids is not None], 0, "replicate").long()
        probs = cat([b.q_probs for b in batches if b.q_probs is not None], 0.0)
        assert slots.shape[1] == n + 1
        return cls(tokens, slots, lens, depth, qrow, ids, probs)


@dataclass(frozen=True)
class BatchResult:
    """Outcome of one round for each trial."""

    accepted: torch.Tensor  # [T, depth] int64 accepted node indices, root to leaf, then -1
    num_accepted: torch.Tensor  # [T] int64
    bonus: torch.Tensor  # [T] int64
    tokens: torch.Tensor  # [T, depth + 1] int64 accepted tokens then the bonus, then -1


@dataclass(frozen=True)
class VerifyResult:
    accepted_nodes: list[int]  # tree node indices of the accepted path, root to leaf
    tokens: list[int]  # accepted tokens then the bonus token
    bonus: int


# --------------------------------------------------------------------------- the math
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


# --------------------------------------------------------------------------- the walk
@dataclass(frozen=True)
class Uniforms:
    """Explicit per-trial randomness for naive / mss / rrs (instead of drawing it from a generator)."""

    sample: torch.Tensor  # [T, depth + 1] float64 in [0, 1): inverse-CDF uniform at each depth
    accept: torch.Tensor | None = None  # [T, depth + 1, K] float32 in [0, 1): one per draw (mss, rrs)


@dataclass(frozen=True)
class _Walk:
    nodes: list[torch.Tensor]  # per depth: [T] accepted node, -1 once the walk stopped
    bonus: torch.Tensor  # [T]
    host_nodes: list[int] | None  # T = 1: the accepted path, read at the per-depth syncs


def _walk(
    mode: Algorithm,
    batch: TreeBatch,
    logits: torch.Tensor,
    params: SamplingParams,
    seeds: np.ndarray | int,
    generator: torch.Generator | None,
    rules: Rules,
    uniforms: Uniforms | None = None,
    sync_free: bool = False,
) -> _Walk:
    """Walk every tree from row 0, one depth per step, applying the mode's rule at each row.

    sync_free: all depth + 1 steps, nothing read back (see the module doc)."""
    if not isinstance(mode, Algorithm):
        raise TypeError(f"the verification mode must be an Algorithm (Algorithm.of(mode)), got {mode!r}")
    t, n = batch.tokens.shape
    if logits.dim() != 3 or logits.shape[0] != t or logits.shape[1] != n + 1:
        raise ValueError(f"logits must be [{t}, {n + 1}, V], got {tuple(logits.shape)}")
    stochastic = mode.stochastic
    if stochastic and not batch.is_stochastic:
        raise ValueError(f"mode {mode.value} needs a stochastic tree (draws with q rows)")
    dev = logits.device
    steps, k = batch.depth + 1, batch.slots.shape[2]
    slots_all = batch.slots
    tokens_all = batch.tokens.gather(1, slots_all.clamp(min=0).reshape(t, -1)) if n else slots_all
    tokens_all = torch.where(slots_all >= 0, tokens_all.reshape(slots_all.shape), -1)
    if mode is Algorithm.MATCH:
        pos = batch.committed_len.reshape(-1, 1) + np.arange(steps)
        u_sample = to_device(keyed_uniforms(np.reshape(seeds, (-1, 1)), pos), dev).unbind(1)
    elif uniforms is not None:
        u_sample = uniforms.sample.unbind(1)
    elif mode is not Algorithm.GREEDY:
        u_sample = torch.rand((t, steps), generator=generator, device=dev, dtype=torch.float64).unbind(1)
    # per-row tables, flattened to [T * (N + 1), ...]: one row fetch per step
    parts = [slots_all, tokens_all]
    if stochastic:
        assert batch.qrow is not None and batch.q_ids is not None and batch.q_probs is not None
        q_ids, q_probs = batch.q_ids, batch.q_probs
        parts.append(batch.qrow)
        q_all = draw_proposals(
            tokens_all, slots_all, batch.qrow, q_ids, q_probs, mode is Algorithm.RRS, logits.shape[-1]
        )
        q_table = q_all.reshape(t * (n + 1), k)
        if uniforms is not None and uniforms.accept is not None:
            u_accept = uniforms.accept.unbind(1)
        else:
            u_accept = torch.rand((t, steps, k), generator=generator, device=dev).unbind(1)
    table = torch.cat(parts, -1).reshape(t * (n + 1), len(parts) * k)
    flat_logits = logits.reshape(t * (n + 1), -1)
    # T = 1 (production): the row index comes to the host at the per-depth sync anyway, so rows are
    # fetched as views; T > 1: one index_select per table
    host_nodes: list[int] | None = [] if t == 1 and not sync_free else None
    probs = rules.probs
    if sync_free and probs is target_probs:
        probs = _sync_free_probs
    base = torch.arange(t, device=dev) * (n + 1)
    cur = torch.zeros(t, dtype=torch.long, device=dev)  # row: 0 = row 0, 1 + i = node i
    row = 0
    active = torch.ones(t, dtype=torch.bool, device=dev)
    bonus = torch.zeros(t, dtype=torch.long, device=dev)
    walked: list[torch.Tensor] = []
    for d in range(steps):
        if host_nodes is not None:
            row_logits, at = flat_logits[row : row + 1], table[row : row + 1]  # [1, V], [1, parts * K]
        else:
            flat = base + cur
            row_logits, at = flat_logits.index_select(0, flat), table.index_select(0, flat)
        slots, slot_tokens = at[:, :k], at[:, k : 2 * k]
        if host_nodes is None:  # finished trials have nothing left to test
            slots = torch.where(active.unsqueeze(-1), slots, -1)
            slot_tokens = torch.where(active.unsqueeze(-1), slot_tokens, -1)
        if mode is Algorithm.GREEDY or (params.greedy and not stochastic):
            nxt, x = verify_greedy(row_logits, slots, slot_tokens)
        elif not stochastic:
            nxt, x = verify_match(probs(row_logits, params), slots, slot_tokens, u_sample[d])
        else:
            slot_q = q_table[row : row + 1] if host_nodes is not None else q_table.index_select(0, flat)
            nxt, x = verify_rejection(
                probs(row_logits, params),
                slots,
                slot_tokens,
                slot_q,
                at[:, 2 * k :],
                q_ids,
                q_probs,
                u_accept[d],
                u_sample[d],
                mode is Algorithm.RRS,
                rules,
                sync_free,
            )
        walked.append(nxt)
        if host_nodes is not None:
            node = int(nxt)  # the step's one sync
            if node < 0:
                return _Walk(walked[:-1], x, host_nodes)
            host_nodes.append(node)
            row = node + 1
            continue
        moved = nxt >= 0  # finished trials never move
        bonus = torch.where(active & ~moved, x, bonus)
        active = moved
        cur = nxt + 1
        # a sync per depth: stop at the end of the longest walked path
        if not sync_free and not bool(moved.any()):
            break
    return _Walk(walked[: steps - 1], bonus, host_nodes)


def _sync_free_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return target_probs(logits, params, sync_free=True)


def verify_batch(
    mode: Algorithm,
    batch: TreeBatch,
    logits: torch.Tensor,
    params: SamplingParams,
    *,
    seeds: np.ndarray | int = 0,
    generator: torch.Generator | None = None,
    rules: Rules = EXACT,
    uniforms: Uniforms | None = None,
    sync_free: bool | None = None,
) -> BatchResult:
    """Verify T trees at once (the production path with T = 1, and the tests' batched trials).

    logits: [T, N + 1, V] (row 0 = the last committed token, row 1 + i = node i).
    seeds: [T] or one session seed (mode match): the token sampled after the row at depth d is at
    absolute position committed_len + d and uses keyed_uniform(seed, that position).
    generator: randomness of naive / mss / rrs, on the logits' device (None: torch's default).
    rules: the math (tests swap in wrong variants). uniforms: explicit randomness (naive / mss / rrs).
    sync_free: nothing read back to the host (None: on any device but a CPU); the same verdicts.
    """
    if sync_free is None:
        sync_free = logits.device.type != "cpu"
    w = _walk(mode, batch, logits, params, seeds, generator, rules, uniforms, sync_free)
    t, depth, dev = batch.num_trials, batch.depth, logits.device
    accepted = torch.full((t, depth), -1, dtype=torch.long, device=dev)
    if w.nodes:
        accepted[:, : len(w.nodes)] = torch.stack(w.nodes, 1)
    num = (accepted >= 0).sum(-1)
    out = torch.full((t, depth + 1), -1, dtype=torch.long, device=dev)
    if batch.tokens.shape[1]:
        out[:, :depth] = torch.where(accepted >= 0, batch.tokens.gather(-1, accepted.clamp(min=0)), -1)
    out[torch.arange(t, device=dev), num] = w.bonus
    return BatchResult(accepted, num, w.bonus, out)


def verify_tree(
    mode: Algorithm,
    tree: TokenTree,
    logits: torch.Tensor,
    params: SamplingParams,
    *,
    seed: int = 0,
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Verify one tree (the engine's call, once per session per round).

    logits: [N + 1, V] on the model's device, row 0 = the last committed token (DESIGN 3.1).
    mode greedy / match / naive take any tree; mss / rrs need its draws and q rows, and the tree must
    have passed `TokenTree.validate` for the mode (every drawn token has mass in its q row; rrs:
    without_replacement=True). match keys its sampler by (seed, absolute position) exactly like
    `sample_next`; naive, mss and rrs use `generator` (on the logits' device). Syncs with the device
    once per walked depth (plus once per tested draw in mss / rrs).
    """
    n = tree.num_nodes
    if logits.dim() != 2 or logits.shape[0] != n + 1:
        raise ValueError(f"logits must be [{n + 1}, V], got {tuple(logits.shape)}")
    batch = TreeBatch.from_tree(tree, logits.device)
    w = _walk(mode, batch, logits.unsqueeze(0), params, seed, generator, EXACT)
    assert w.host_nodes is not None
    bonus = int(w.bonus)
    tokens = [int(tok) for tok in tree.tokens[w.host_nodes]] + [bonus]
    return VerifyResult(accepted_nodes=w.host_nodes, tokens=tokens, bonus=bonus)


def verify_tree_async(
    mode: Algorithm,
    tree: TokenTree,
    logits: torch.Tensor,
    params: SamplingParams,
    *,
    seed: int = 0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """`verify_tree` with nothing read back: the verdict packed on the logits' device, [2 depth + 1]
    int64 = the accepted nodes (depth slots, -1 after the path) then the output tokens (depth + 1
    slots, -1 after the bonus). Decode it with `read_verdicts` + `unpack_verdict`; the same verdict
    as `verify_tree`, bit for bit, on any device.
    """
    n = tree.num_nodes
    if logits.dim() != 2 or logits.shape[0] != n + 1:
        raise ValueError(f"logits must be [{n + 1}, V], got {tuple(logits.shape)}")
    batch = TreeBatch.from_tree(tree, logits.device)
    res = verify_batch(
        mode, batch, logits.unsqueeze(0), params, seeds=seed, generator=generator, sync_free=True
    )
    return torch.cat((res.accepted[0], res.tokens[0]))


def read_verdicts(packed: Sequence[torch.Tensor]) -> list[list[int]]:
    """Every pending verdict of an engine step (1-D int64 device tensors) to the host in one copy."""
    if not packed:
        return []
    flat = torch.cat([p.reshape(-1) for p in packed]).tolist()  # the step's one device -> host copy
    out, a = [], 0
    for p in packed:
        out.append(flat[a : a + p.numel()])
        a += p.numel()
    return out


def unpack_verdict(values: Sequence[int], tree: TokenTree) -> VerifyResult:
    """A `verify_tree_async` verdict read back (`read_verdicts`) as a VerifyResult."""
    depth = tree.max_depth
    if len(values) != 2 * depth + 1:
        raise ValueError(f"a verdict of a depth-{depth} tree has {2 * depth + 1} values, got {len(values)}")
    nodes = [int(i) for i in values[:depth] if i >= 0]
    tokens = [int(t) for t in values[depth : depth + len(nodes) + 1]]
    return VerifyResult(accepted_nodes=nodes, tokens=tokens, bonus=tokens[-1])
