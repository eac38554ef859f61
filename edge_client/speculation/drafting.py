"""The draft step: runs the core's draft actions with the edge's drafters, on the drafting thread.

With several drafters (SpecInfer Definition 3.2) every tree, conditional ones included, is drafted
by each drafter in turn, each with its own shape, below the same sequence, and the trees are
merged (trees.merged): the core sees one tree. Leaves are evaluated and the tree in flight is
replayed in the first drafter's workspace; the others draft conditional trees below the anchor in
theirs (a path they lack is evaluated on the way).
"""

from __future__ import annotations

from collections.abc import Sequence

from edge_client.drafters.base import Drafter, WorkspaceFullError
from edge_client.speculation.actions import DraftConditional, Drafted, DraftPlain, FinishLeaves, Reanchor
from edge_client.speculation.config import Request, TreeSpec
from edge_client.speculation.outcomes import replay
from edge_client.trees import (
    DraftCancelled,
    DraftOptions,
    DraftResult,
    draft_dynamic,
    draft_sequence,
    draft_static,
    draft_static_many,
    finish_leaves_many,
)
from edge_client.trees.merged import merge_drafts
from shared.messages import SessionLimits
from shared.tree import ExpansionConfig


class DraftStep:
    """Drafts what the core asks for (speculation.actions) with `drafters` under the server's limits.

    `shapes[i]` is drafter i's tree shape (default: `req.tree` for every drafter); the first
    drafter's is `req.tree`, the one the core sizes (a dynamic budget of 0 is chosen by the core
    for the first drafter only: the others need a fixed budget). `run(action)` is called on the
    one drafting thread (llama.cpp contexts are single-threaded); `max_nodes` and `ms_per_node`
    describe the first drafter to the core's dynamic budget.
    """

    def __init__(
        self,
        drafters: Sequence[Drafter],
        req: Request,
        limits: SessionLimits,
        shapes: Sequence[TreeSpec] | None = None,
    ) -> None:
        if not drafters:
            raise ValueError("the draft step needs at least one drafter")
        shapes = tuple(shapes) if shapes is not None else (req.tree,) * len(drafters)
        if len(shapes) != len(drafters):
            raise ValueError(f"{len(drafters)} drafters but {len(shapes)} tree shapes: give one per drafter")
        for i, sh in enumerate(shapes[1:], 1):
            if sh.kind == "budget" and sh.budget <= 0:
                raise ValueError(f"drafter {i}: a dynamic tree after the first drafter needs a budget > 0")
        self.drafters = tuple(drafters)
        self.shapes = (req.tree, *shapes[1:])
        self.req = req
        self.limits = limits
        self.options = DraftOptions(mode=req.mode, sampling=req.sampling, rng=req.rng, coupling=req.coupling)

    @property
    def drafter(self) -> Drafter:
        return self.drafters[0]

    @property
    def max_nodes(self) -> int:
        return self.drafter.max_nodes

    def ms_per_node(self) -> float:
        st = self.drafter.stats
        return st.extend_ms / st.extend_nodes if st.extend_nodes else 0.0

    def run(self, action: DraftPlain | DraftConditional | FinishLeaves | Reanchor) -> object:
        if isinstance(action, DraftPlain):
            return self._each(action.committed, self.options, action.budget)
        if isinstance(action, DraftConditional):
            return self._conditional(action)
        if isinstance(action, FinishLeaves):
            return self._leaves(action)
        for d in self.drafters:
            d.sync(action.committed)
        replay(self.drafter, action.tree)
        return None

    def _each(self, committed: Sequence[int], opts: DraftOptions, budget: int) -> DraftResult:
        """Every drafter's tree below `committed` (+ opts.cond), in turn, merged."""
        return merge_drafts([self._shape(i, committed, opts, budget) for i in range(len(self.drafters))])

    def _shape(self, i: int, committed: Sequence[int], opts: DraftOptions, budget: int) -> DraftResult:
        drafter, spec, lim = self.drafters[i], self.shapes[i], self.limits
        if spec.kind == "sequence":
            return draft_sequence(drafter, committed, min(spec.chain_depth, lim.max_depth), opts)
        if spec.kind == "budget":
            if i:  # the core sizes the first drafter's budget; the others' are fixed
                budget = min(spec.budget, lim.max_nodes, drafter.max_nodes // 2)
            return draft_dynamic(drafter, committed, budget, opts, max_depth=lim.max_depth)
        return draft_static(drafter, committed, spec.expansion, opts)

    def _conditional(self, a: DraftConditional) -> Drafted:
        n = len(a.fulls)
        try:
            if not a.lockstep:
                (full,) = a.fulls
                opts = self.options.replace(cond=full[len(a.anchor) :], reuse_workspace=True, stop=a.stops[0])
                return Drafted((self._each(a.anchor, opts, a.budget),))
            per_drafter = [self._lockstep(i, a) for i in range(len(self.drafters))]
        except WorkspaceFullError:
            return Drafted((None,) * n, workspace_full=True)
        except DraftCancelled:
            return Drafted((None,) * n, cancelled=n)
        out: list[DraftResult | None] = []
        for j in range(n):
            drafts = [d for trees in per_drafter if (d := trees[j]) is not None]
            out.append(merge_drafts(drafts) if len(drafts) == len(per_drafter) else None)
        return Drafted(tuple(out), cancelled=sum(d is None for d in out))

    def _lockstep(self, i: int, a: DraftConditional) -> list[DraftResult | None]:
        """Drafter i's trees below each of a.fulls: together, one evaluation per level, for a static
        or sequence shape; one after the other for a dynamic one."""
        spec = self.shapes[i]
        conds = [f[len(a.anchor) :] for f in a.fulls]
        if spec.kind == "budget":
            out: list[DraftResult | None] = []
            for cond, stop in zip(conds, a.stops, strict=True):
                opts = self.options.replace(cond=cond, reuse_workspace=True, stop=stop)
                try:
                    out.append(self._shape(i, a.anchor, opts, a.budget))
                except DraftCancelled:
                    out.append(None)
            return out
        config = spec.expansion
        if spec.kind == "sequence":
            config = ExpansionConfig((1,) * min(spec.chain_depth, self.limits.max_depth))
        return draft_static_many(self.drafters[i], a.anchor, config, conds, self.options, stops=list(a.stops))

    def _leaves(self, a: FinishLeaves) -> Drafted:
        try:
            done = finish_leaves_many(self.drafter, [(dr, nodes) for _, dr, nodes in a.work], self.options)
        except WorkspaceFullError:
            return Drafted((None,) * len(a.work), workspace_full=True)
        return Drafted(tuple(done))
