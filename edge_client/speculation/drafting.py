"""The draft step: runs the core's draft actions with the edge's drafter, on the drafting thread.

It takes the drafters as a sequence so that several drafters merged into one tree (SpecInfer
Definition 3.2) can come in behind the same actions; today exactly one is supported.
"""

from __future__ import annotations

from collections.abc import Sequence

from edge_client.drafters.base import Drafter, WorkspaceFullError
from edge_client.speculation.actions import DraftConditional, Drafted, DraftPlain, FinishLeaves, Reanchor
from edge_client.speculation.config import Request
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
from shared.messages import SessionLimits
from shared.tree import ExpansionConfig


class DraftStep:
    """Drafts what the core asks for (speculation.actions) with `drafters` under the server's limits.

    `run(action)` is called on the one drafting thread (llama.cpp contexts are single-threaded);
    `max_nodes` and `ms_per_node` describe the drafter to the core's dynamic budget.
    """

    def __init__(self, drafters: Sequence[Drafter], req: Request, limits: SessionLimits) -> None:
        if len(drafters) != 1:
            raise ValueError(f"the draft step takes exactly one drafter for now, got {len(drafters)}")
        self.drafters = tuple(drafters)
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
            return self._shape(action.committed, self.options, action.budget)
        if isinstance(action, DraftConditional):
            return self._conditional(action)
        if isinstance(action, FinishLeaves):
            return self._leaves(action)
        self.drafter.sync(action.committed)
        replay(self.drafter, action.tree)
        return None

    def _shape(self, committed: Sequence[int], opts: DraftOptions, budget: int) -> DraftResult:
        spec, lim = self.req.tree, self.limits
        if spec.kind == "sequence":
            return draft_sequence(self.drafter, committed, min(spec.chain_depth, lim.max_depth), opts)
        if spec.kind == "budget":
            return draft_dynamic(self.drafter, committed, budget, opts, max_depth=lim.max_depth)
        return draft_static(self.drafter, committed, spec.expansion, opts)

    def _conditional(self, a: DraftConditional) -> Drafted:
        n = len(a.fulls)
        try:
            if not a.lockstep:
                (full,) = a.fulls
                opts = self.options.replace(cond=full[len(a.anchor) :], reuse_workspace=True, stop=a.stops[0])
                return Drafted((self._shape(a.anchor, opts, a.budget),))
            spec = self.req.tree
            config = spec.expansion
            if spec.kind == "sequence":
                config = ExpansionConfig((1,) * min(spec.chain_depth, self.limits.max_depth))
            out = draft_static_many(
                self.drafter,
                a.anchor,
                config,
                [f[len(a.anchor) :] for f in a.fulls],
                self.options,
                stops=list(a.stops),
            )
        except WorkspaceFullError:
            return Drafted((None,) * n, workspace_full=True)
        except DraftCancelled:
            return Drafted((None,) * n, cancelled=n)
        return Drafted(tuple(out), cancelled=sum(d is None for d in out))

    def _leaves(self, a: FinishLeaves) -> Drafted:
        try:
            done = finish_leaves_many(self.drafter, [(dr, nodes) for _, dr, nodes in a.work], self.options)
        except WorkspaceFullError:
            return Drafted((None,) * len(a.work), workspace_full=True)
        return Drafted(tuple(done))
