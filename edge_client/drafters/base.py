"""The draft-model interface every backend implements. Its docstrings are the contract.

A drafter holds two things:

- the **committed sequence** S (prompt + accepted output, length L), evaluated in the draft model's
  KV cache, with the next-token logits after its last token;
- a **workspace** of draft nodes hanging below the committed end. Node ids are 0, 1, 2, ... in the
  order nodes were added since the last `sync`; node i has a token, a parent (-1 = the committed
  end, else an earlier node id) and a depth (1 for children of the committed end). Its absolute
  position is L + depth - 1, the same numbering as a TokenTree's nodes (docs/architecture.md §3.1).

The workspace is a forest, not one tree: a tree builder drafts a tree into it; pre-speculation
(SSD) then drafts conditional trees below workspace nodes (e.g. "accept the path to node j, then
bonus token b": one node b under j, then b's subtree). All of it stays valid until the next `sync`.

Round protocol seen by a drafter:

    logits = d.sync(committed)                # [V], after the last committed token
    out = d.extend(parents, tokens)           # [n, V], one batched evaluation per call
    ...                                       # more extend calls, one per tree level
    logits = d.sync(committed + accepted + [bonus])   # after the verdict

`sync` keeps what the draft cache already holds that is a prefix of the new committed sequence,
INCLUDING a path through the workspace (after a verdict the accepted nodes are already evaluated;
typically only the bonus token is new) and drops everything else.

Arrays returned by `sync` and `extend` are float32 logits (not probabilities) and READ-ONLY: the
drafter keeps them (`logits_at`) until the next `sync`, so callers that want to modify one copy it.

A drafter is not thread-safe: call it from one thread at a time (the client drafts on a worker).
"""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from edge_client.tokenizer import EdgeTokenizer


class DrafterError(RuntimeError):
    """A drafter could not do what was asked; the message says what to change."""


class WorkspaceFullError(DrafterError):
    """The draft workspace has no room for more nodes or branches until the next sync."""


class ContextFullError(DrafterError):
    """The committed sequence does not fit the drafter's context."""


@dataclass
class DrafterStats:
    """Counters since construction (or `reset`): what drafting cost, for benches and budgets."""

    sync_calls: int = 0
    sync_tokens: int = 0  # committed tokens that had to be evaluated (not already cached)
    sync_ms: float = 0.0
    extend_calls: int = 0  # = batched evaluations of draft nodes
    extend_nodes: int = 0
    extend_ms: float = 0.0
    # each evaluation as (kind, rows, ms), kind "sync" or "extend"; None: not logged (a tracing
    # client's own DrafterStats logs them for its round trace, stats.RoundTrace)
    log: list[tuple[str, int, float]] | None = None
    # the running cost of one evaluation by its rows (an exponential average per row count)
    by_rows: dict[int, float] = field(default_factory=dict)
    # the tree builders' own ms per row evaluated, outside the forward (ranking the row's logits,
    # coupling, bookkeeping; an exponential average, trees.builder.HostClock); None: not measured
    host_ms_per_row: float | None = None
    # while one client drafts, its own DrafterStats, told of the same evaluations
    # (speculation.executor.DraftStep sets it for each draft action): a client prices its plans by
    # what it measured itself, never by what another client of this drafter measured (in another
    # mode, under another load)
    mirror: DrafterStats | None = field(default=None, repr=False, compare=False)

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]

    def note_sync(self, tokens: int, ms: float) -> None:
        """A sync that evaluated `tokens` committed tokens (0: all were cached) took `ms`."""
        for st in self._told():
            st.sync_calls += 1
            st.sync_tokens += tokens
            st.sync_ms += ms
            if tokens:
                st.observe(tokens, ms)
                if st.log is not None:
                    st.log.append(("sync", tokens, ms))

    def note_extend(self, nodes: int, ms: float) -> None:
        """One batched evaluation of `nodes` draft nodes took `ms`."""
        for st in self._told():
            st.extend_calls += 1
            st.extend_nodes += nodes
            st.extend_ms += ms
            st.observe(nodes, ms)
            if st.log is not None:
                st.log.append(("extend", nodes, ms))

    def _told(self) -> tuple[DrafterStats, ...]:
        return (self,) if self.mirror is None else (self, self.mirror)

    def observe(self, rows: int, ms: float) -> None:
        """One evaluation of `rows` rows took `ms`."""
        old = self.by_rows.get(rows)
        self.by_rows[rows] = ms if old is None else 0.8 * old + 0.2 * ms

    def observe_host(self, rows: int, ms: float) -> None:
        """A tree level's own work outside the forward took `ms` for `rows` rows."""
        if rows > 0:
            per = max(0.0, ms) / rows
            for st in self._told():
                old = st.host_ms_per_row
                st.host_ms_per_row = per if old is None else 0.8 * old + 0.2 * per

    def ms_per_node(self) -> float:
        """The mean ms of a draft node over every extend (0 before any)."""
        return self.extend_ms / self.extend_nodes if self.extend_nodes else 0.0

    def eval_ms(self, rows: int) -> float | None:
        """The expected ms of one evaluation of `rows` rows, the builders' own work on those rows
        included (host_ms_per_row): the forward's running average at that size, else linear
        between the nearest sizes measured (flat below the smallest); beyond the largest size
        measured, in proportion to the rows (pessimistic: a batch larger than any seen is priced
        as if every row cost what the largest one's rows did, so a plan grows its batches step by
        step as they are measured); None before any evaluation."""
        if not self.by_rows:
            return None
        host = (self.host_ms_per_row or 0.0) * rows
        if rows in self.by_rows:
            return self.by_rows[rows] + host
        xs = sorted(self.by_rows)
        ys = [self.by_rows[x] for x in xs]
        if rows < xs[0]:
            return ys[0] + host
        if rows > xs[-1]:
            return ys[-1] * rows / xs[-1] + host
        return float(np.interp(rows, xs, ys)) + host

    def take_log(self) -> tuple[tuple[str, int, float], ...]:
        """The evaluations logged since the last call (logging stays on)."""
        if self.log is None:
            return ()
        out, self.log = tuple(self.log), []
        return out


class Drafter(abc.ABC):
    """A draft model behind one interface (see the module docstring for the contract).

    Attributes set by every backend:
      name         backend name in the registry ("llama_cpp", "torch")
      model_id     what was loaded (alias or path)
      vocab_size   V, the logits' last dimension
      max_context  the longest committed sequence `sync` accepts
      max_nodes    workspace capacity in nodes between two syncs
      max_leaves   workspace capacity in branches (leaves of the workspace forest) between two syncs;
                   llama.cpp: one KV sequence per leaf, so n_seq_max = max_leaves + 1
      tokenizer    the draft model's tokenizer (always present)
    """

    name: str
    model_id: str
    vocab_size: int
    max_context: int
    max_nodes: int
    max_leaves: int
    tokenizer: EdgeTokenizer

    def __init__(self) -> None:
        self._closed = False
        self.stats = DrafterStats()
        self._committed: list[int] = []
        self._end_logits: np.ndarray | None = None  # [V] after the last committed token
        self._reset_workspace()

    # ------------------------------------------------------------------ the contract
    def vocab_fingerprint(self) -> str:
        """sha256 fingerprint of the draft vocabulary (PROTOCOL.md section 8), compared at `hello`."""
        return self.tokenizer.fingerprint

    def sync(self, committed: Sequence[int]) -> np.ndarray:
        """Make the draft state equal to `committed`; return the next-token logits [V] after it.

        Drops every workspace node. Reuses the longest cached prefix of `committed`: the old
        committed sequence's common prefix, extended by the deepest workspace path that
        `committed` continues along (so accepted draft nodes are never evaluated twice). Only the
        remaining tokens are evaluated. `committed` must be non-empty (its last token is row 0 of
        the next verify) and at most `max_context` long (ContextFullError otherwise).
        """
        self._check_open()
        new = [int(t) for t in committed]
        if not new:
            raise ValueError("sync needs at least one committed token (e.g. the prompt's BOS)")
        if len(new) > self.max_context:
            raise ContextFullError(
                f"{len(new)} committed tokens exceed this drafter's context of {self.max_context}; "
                "create the drafter with a larger max_context"
            )
        self._check_ids(new, "committed")
        old = self._committed
        keep = 0
        limit = min(len(old), len(new))
        while keep < limit and old[keep] == new[keep]:
            keep += 1
        path: list[int] = []
        if keep == len(old):
            node = -1
            for tok in new[keep:]:
                child = self._child.get((node, tok))
                if child is None:
                    break
                path.append(child)
                node = child
        tail = new[keep + len(path) :]
        logits = self._end_logits if keep == len(old) and not path else None
        if path:
            logits = self._logits[path[-1]]
        if not tail and logits is None:
            # truncated to a strict prefix: its last token's logits were never kept, re-evaluate it
            keep -= 1
            tail = new[keep:]
        t0 = time.perf_counter()
        out = self._commit(keep, path, tail)
        self.stats.note_sync(len(tail), (time.perf_counter() - t0) * 1e3)
        if tail:
            if out is None:
                raise AssertionError("backend returned no logits for evaluated tokens")
            logits = _readonly(out)
        self._committed = new
        self._end_logits = logits
        self._reset_workspace()
        assert logits is not None
        return logits

    def extend(self, parents: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """Add draft nodes; return the next-token logits [n, V] float32 after each new node.

        parents[i] is -1 (a child of the committed end) or the id of an EARLIER node: a node added by
        a previous call, or one earlier in this same call (so a chain or a whole subtree can be
        added at once). The new nodes get ids num_nodes, num_nodes + 1, ... in order. All nodes of
        one call are evaluated in ONE batch (llama.cpp: one llama_decode); evaluating a node costs
        the same whether or not its parent came in this call. A node may repeat a sibling's token
        (the workspace does not deduplicate; `find_child` returns the first).

        Raises WorkspaceFullError (nothing added) when the workspace would exceed `max_nodes`
        nodes or `max_leaves` branches, ValueError for bad ids. If the backend fails mid-way, the
        whole workspace is dropped (the committed state survives) and DrafterError says so.
        """
        self._check_open()
        if not self._committed:
            raise DrafterError("call sync(committed) before extend()")
        par = [int(p) for p in parents]
        tok = [int(t) for t in tokens]
        if len(par) != len(tok):
            raise ValueError(f"parents and tokens differ in length ({len(par)} vs {len(tok)})")
        n = len(tok)
        first = len(self._tokens)
        if n == 0:
            return _readonly(np.zeros((0, self.vocab_size), dtype=np.float32))
        self._check_ids(tok, "tokens")
        for i, p in enumerate(par):
            if not -1 <= p < first + i:
                raise ValueError(
                    f"parents[{i}] = {p}: must be -1 or an earlier node id (< {first + i}); "
                    "a node's parent is added before it"
                )
        if first + n > self.max_nodes:
            raise WorkspaceFullError(
                f"the draft workspace holds at most {self.max_nodes} nodes between syncs "
                f"({first} held, {n} more asked); sync() first or create the drafter with a larger max_nodes"
            )
        leaves = self._leaves
        extended: set[int] = set()  # nodes that got a child in this call
        for p in par:
            if p == -1 or (p < first and self._has_child[p]) or p in extended:
                leaves += 1  # a new branch
            else:
                extended.add(p)  # the node continues a leaf: the leaf count is unchanged
        if leaves > self.max_leaves:
            raise WorkspaceFullError(
                f"the draft workspace holds at most {self.max_leaves} branches (leaves) between syncs; "
                f"this extend would make {leaves}. sync() first or create the drafter with a larger "
                "max_leaves (llama.cpp: at most 255)"
            )
        self._append(par, tok)
        t0 = time.perf_counter()
        try:
            out = self._evaluate(first, n)
        except Exception as exc:
            self._drop_workspace_safely()
            raise DrafterError(
                f"draft evaluation failed ({exc}); the draft workspace was dropped, call sync() to continue"
            ) from exc
        self.stats.note_extend(n, (time.perf_counter() - t0) * 1e3)
        if out.shape != (n, self.vocab_size):
            raise AssertionError(
                f"backend returned logits of shape {out.shape}, expected {(n, self.vocab_size)}"
            )
        out = _readonly(out)
        self._logits.extend(out)
        return out

    def close(self) -> None:
        """Free the model and its native or device memory. The drafter is unusable afterwards."""
        self._closed = True
        self._committed = []
        self._end_logits = None
        self._reset_workspace()

    # ------------------------------------------------------------------ workspace queries
    @property
    def committed_len(self) -> int:
        return len(self._committed)

    def committed_tokens(self) -> list[int]:
        return list(self._committed)

    @property
    def num_nodes(self) -> int:
        return len(self._tokens)

    @property
    def num_leaves(self) -> int:
        return self._leaves

    def node_token(self, node: int) -> int:
        return self._tokens[node]

    def node_parent(self, node: int) -> int:
        return self._parents[node]

    def node_depth(self, node: int) -> int:
        """1 for a child of the committed end; 0 for node -1 (the committed end itself)."""
        return 0 if node < 0 else self._depths[node]

    def find_child(self, parent: int, token: int) -> int | None:
        """The first workspace node with this parent (-1: the committed end) and token, or None."""
        return self._child.get((parent, token))

    def path_to(self, node: int) -> list[int]:
        """Workspace node ids from depth 1 down to `node` ([] for -1)."""
        out = []
        while node >= 0:
            out.append(node)
            node = self._parents[node]
        return out[::-1]

    def logits_at(self, node: int) -> np.ndarray:
        """The logits [V] after workspace node `node` (-1: after the committed sequence)."""
        if node < 0:
            if self._end_logits is None:
                raise DrafterError("call sync(committed) first")
            return self._end_logits
        return self._logits[node]

    # ------------------------------------------------------------------ backend hooks
    @abc.abstractmethod
    def _commit(self, keep: int, path: list[int], tail: list[int]) -> np.ndarray | None:
        """Set the backend's committed state to old[:keep] + tokens of `path` + `tail`; drop the workspace.

        `path` (workspace node ids from depth 1 down, non-empty only when keep == len(old)) is
        already evaluated: keep it. Evaluate `tail` and return the logits [V] after its last token
        (None when `tail` is empty). The base class updates its own bookkeeping afterwards.
        """

    @abc.abstractmethod
    def _evaluate(self, first: int, count: int) -> np.ndarray:
        """Evaluate the workspace nodes [first, first + count), already in the bookkeeping
        (`_tokens`, `_parents`, `_depths`), in one batch; return their logits [count, V] float32."""

    @abc.abstractmethod
    def _drop_workspace(self) -> None:
        """Forget every draft node in the backend (the committed state stays)."""

    # ------------------------------------------------------------------ internals
    def _reset_workspace(self) -> None:
        self._tokens: list[int] = []
        self._parents: list[int] = []
        self._depths: list[int] = []
        self._has_child: list[bool] = []
        self._child: dict[tuple[int, int], int] = {}
        self._logits: list[np.ndarray] = []  # [V] rows, views of the arrays extend returned
        self._leaves = 0

    def _append(self, parents: list[int], tokens: list[int]) -> None:
        for p, t in zip(parents, tokens, strict=True):
            node = len(self._tokens)
            if p == -1 or self._has_child[p]:
                self._leaves += 1
            else:
                self._has_child[p] = True
            self._tokens.append(t)
            self._parents.append(p)
            self._depths.append(1 if p < 0 else self._depths[p] + 1)
            self._has_child.append(False)
            self._child.setdefault((p, t), node)

    def _drop_workspace_safely(self) -> None:
        try:
            self._drop_workspace()
        finally:
            self._reset_workspace()

    def _check_open(self) -> None:
        if self._closed:
            raise DrafterError("this drafter is closed; create a new one")

    def _check_ids(self, ids: list[int], field: str) -> None:
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            bad = next(t for t in ids if not 0 <= t < self.vocab_size)
            raise ValueError(f"{field}: token id {bad} is out of range [0, {self.vocab_size})")

    def __enter__(self) -> Drafter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _readonly(a: np.ndarray) -> np.ndarray:
    a.setflags(write=False)
    return a
