"""Exact verification of token trees (docs/architecture.md §3 and §4): pure functions over torch tensors.

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

Here: the algorithms (`Algorithm`), the walk and the public `verify_*`, then the trees as tensors
(`TreeBatch`: each row's children as slots, `draw_slots`; the q rows padded to one width,
`padded_rows`; T trees stacked with -1 padding). One row's acceptance rules (the math) are in
sampling.py, beside the distribution p they test against.

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
    EXACT,
    Rules,
    SamplingParams,
    draw_proposals,
    sample_next,
    target_probs,
    to_device,
    verify_greedy,
    verify_match,
    verify_rejection,
)
from shared.keyed import keyed_uniform, keyed_uniforms
from shared.messages import Mode
from shared.sparse import Q_TOTAL, SparseRows
from shared.tree import TokenTree


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


@dataclass(frozen=True)
class _Draws:
    """What mss / rrs test the draws with, besides the row's table entries."""

    q_table: torch.Tensor  # [T * (N + 1), K] float32: q_k(x_k) of each draw (`draw_proposals`)
    q_ids: torch.Tensor  # [T, R, Kq] int64
    q_probs: torch.Tensor  # [T, R, Kq] float32
    u_accept: tuple[torch.Tensor, ...]  # per depth: [T, K] float32, one uniform per draw


@dataclass(frozen=True)
class _Rows:
    """One walk's fixed inputs: the per-row tables, flattened to [T * (N + 1), ...] so that a step
    fetches its row with one slice (T = 1) or one index_select, and the walk's randomness."""

    mode: Algorithm
    params: SamplingParams
    rules: Rules
    probs: Callable[[torch.Tensor, SamplingParams], torch.Tensor]  # rules.probs, or its sync-free twin
    sync_free: bool
    k: int  # K: draws (or children) per row
    table: torch.Tensor  # [T * (N + 1), parts * K] int64: slots, their tokens (and their q rows)
    logits: torch.Tensor  # [T * (N + 1), V]
    u_sample: tuple[torch.Tensor, ...]  # per depth: [T] float64 (empty for greedy)
    draws: _Draws | None  # mss / rrs only

    def step(self, d: int, row: int | torch.Tensor, active: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """The mode's rule at depth d on each trial's row (an int: T = 1, the row fetched as a view;
        else [T] flat row indices). active: [T] trials still walking (None: T = 1, always).
        Returns (next [T] accepted node or -1, x [T] the bonus where next < 0)."""
        if isinstance(row, int):
            row_logits, at = self.logits[row : row + 1], self.table[row : row + 1]  # [1, V], [1, parts * K]
        else:
            row_logits, at = self.logits.index_select(0, row), self.table.index_select(0, row)
        k = self.k
        slots, slot_tokens = at[:, :k], at[:, k : 2 * k]
        if active is not None:  # finished trials have nothing left to test
            slots = torch.where(active.unsqueeze(-1), slots, -1)
            slot_tokens = torch.where(active.unsqueeze(-1), slot_tokens, -1)
        q = self.draws
        if self.mode is Algorithm.GREEDY or (self.params.greedy and q is None):
            return verify_greedy(row_logits, slots, slot_tokens)
        if q is None:
            return verify_match(self.probs(row_logits, self.params), slots, slot_tokens, self.u_sample[d])
        slot_q = q.q_table[row : row + 1] if isinstance(row, int) else q.q_table.index_select(0, row)
        return verify_rejection(
            self.probs(row_logits, self.params),
            slots,
            slot_tokens,
            slot_q,
            at[:, 2 * k :],
            q.q_ids,
            q.q_probs,
            q.u_accept[d],
            self.u_sample[d],
            self.mode is Algorithm.RRS,
            self.rules,
            self.sync_free,
        )


def _check_walk(mode: Algorithm, batch: TreeBatch, logits: torch.Tensor) -> None:
    """The walk's arguments: an Algorithm, [T, N + 1, V] logits, and draws for mss / rrs."""
    if not isinstance(mode, Algorithm):
        raise TypeError(f"the verification mode must be an Algorithm (Algorithm.of(mode)), got {mode!r}")
    t, n = batch.tokens.shape
    if logits.dim() != 3 or logits.shape[0] != t or logits.shape[1] != n + 1:
        raise ValueError(f"logits must be [{t}, {n + 1}, V], got {tuple(logits.shape)}")
    if mode.stochastic and not batch.is_stochastic:
        raise ValueError(f"mode {mode.value} needs a stochastic tree (draws with q rows)")


def _sample_uniforms(
    mode: Algorithm,
    batch: TreeBatch,
    seeds: np.ndarray | int,
    generator: torch.Generator | None,
    uniforms: Uniforms | None,
    dev: torch.device,
) -> tuple[torch.Tensor, ...]:
    """Per depth, [T] float64: the inverse-CDF uniforms (match: keyed by seed and absolute position;
    else `uniforms.sample` or the generator's first draw). Empty for greedy with no `uniforms`."""
    steps = batch.depth + 1
    if mode is Algorithm.MATCH:
        pos = batch.committed_len.reshape(-1, 1) + np.arange(steps)
        return to_device(keyed_uniforms(np.reshape(seeds, (-1, 1)), pos), dev).unbind(1)
    if uniforms is not None:
        return uniforms.sample.unbind(1)
    if mode is not Algorithm.GREEDY:
        t = batch.num_trials
        return torch.rand((t, steps), generator=generator, device=dev, dtype=torch.float64).unbind(1)
    return ()


def _draws(
    mode: Algorithm,
    batch: TreeBatch,
    slot_tokens: torch.Tensor,
    vocab: int,
    generator: torch.Generator | None,
    uniforms: Uniforms | None,
    dev: torch.device,
) -> _Draws:
    """mss / rrs: each draw's proposal probability (flattened per row) and the acceptance uniforms
    (`uniforms.accept`, or the generator's draw after `_sample_uniforms`'). slot_tokens [T, N + 1, K]."""
    assert batch.qrow is not None and batch.q_ids is not None and batch.q_probs is not None
    t, n = batch.tokens.shape
    steps, k = batch.depth + 1, batch.slots.shape[2]
    q_all = draw_proposals(
        slot_tokens, batch.slots, batch.qrow, batch.q_ids, batch.q_probs, mode is Algorithm.RRS, vocab
    )
    if uniforms is not None and uniforms.accept is not None:
        u_accept = uniforms.accept.unbind(1)
    else:
        u_accept = torch.rand((t, steps, k), generator=generator, device=dev).unbind(1)
    return _Draws(q_all.reshape(t * (n + 1), k), batch.q_ids, batch.q_probs, u_accept)


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
    _check_walk(mode, batch, logits)
    t, n = batch.tokens.shape
    dev = logits.device
    k = batch.slots.shape[2]
    slots_all = batch.slots
    tokens_all = batch.tokens.gather(1, slots_all.clamp(min=0).reshape(t, -1)) if n else slots_all
    tokens_all = torch.where(slots_all >= 0, tokens_all.reshape(slots_all.shape), -1)
    u_sample = _sample_uniforms(mode, batch, seeds, generator, uniforms, dev)
    # per-row tables, flattened to [T * (N + 1), ...]: one row fetch per step
    parts = [slots_all, tokens_all]
    draws = None
    if mode.stochastic:
        assert batch.qrow is not None
        parts.append(batch.qrow)
        draws = _draws(mode, batch, tokens_all, logits.shape[-1], generator, uniforms, dev)
    table = torch.cat(parts, -1).reshape(t * (n + 1), len(parts) * k)
    probs = rules.probs
    if sync_free and probs is target_probs:
        probs = _sync_free_probs
    flat_logits = logits.reshape(t * (n + 1), -1)
    rows = _Rows(mode, params, rules, probs, sync_free, k, table, flat_logits, u_sample, draws)
    # T = 1 (production): the row index comes to the host at the per-depth sync anyway, so rows are
    # fetched as views; T > 1: one index_select per table
    if t == 1 and not sync_free:
        return _walk_host(rows, batch.depth + 1)
    return _walk_batched(rows, t, n, batch.depth + 1)


def _walk_host(rows: _Rows, steps: int) -> _Walk:
    """T = 1 with a sync per depth: the accepted node is read back and the walk stops at the bonus."""
    host_nodes: list[int] = []
    walked: list[torch.Tensor] = []
    row = 0  # 0 = row 0, 1 + i = node i
    for d in range(steps):
        nxt, x = rows.step(d, row, None)
        walked.append(nxt)
        node = int(nxt)  # the step's one sync
        if node < 0:
            return _Walk(walked[:-1], x, host_nodes)
        host_nodes.append(node)
        row = node + 1
    # not reached: the row at the last depth is a leaf, which has nothing to accept
    return _Walk(walked[: steps - 1], torch.zeros(1, dtype=torch.long, device=rows.logits.device), host_nodes)


def _walk_batched(rows: _Rows, t: int, n: int, steps: int) -> _Walk:
    """T trials at once: each step fetches every trial's row; finished trials never move and keep
    their bonus. Unless sync_free, a sync per depth stops at the end of the longest walked path."""
    dev = rows.logits.device
    base = torch.arange(t, device=dev) * (n + 1)
    cur = torch.zeros(t, dtype=torch.long, device=dev)  # row: 0 = row 0, 1 + i = node i
    active = torch.ones(t, dtype=torch.bool, device=dev)
    bonus = torch.zeros(t, dtype=torch.long, device=dev)
    walked: list[torch.Tensor] = []
    for d in range(steps):
        nxt, x = rows.step(d, base + cur, active)
        walked.append(nxt)
        moved = nxt >= 0  # finished trials never move
        bonus = torch.where(active & ~moved, x, bonus)
        active = moved
        cur = nxt + 1
        # a sync per depth: stop at the end of the longest walked path
        if not rows.sync_free and not bool(moved.any()):
            break
    return _Walk(walked[: steps - 1], bonus, None)


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

    logits: [N + 1, V] on the model's device, row 0 = the last committed token (docs/architecture.md §3.1).
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


# ---------------------------------------------------------------------------------------------------
# Trees as tensors: a batch of token trees for verification (docs/architecture.md §3.4)


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


__all__ = [
    "MODES",
    "Algorithm",
    "BatchResult",
    "SamplingParams",
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
