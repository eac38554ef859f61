"""What the speculation core asks its shell to do, and what comes back.

The core (speculation.core) is sans-I/O: its steps are generators that yield these actions and
receive each one's result (`generator.send`). The asyncio shell (speculation.executor) runs draft
actions on the drafting thread (speculation.executor.DraftStep) and send actions on the socket;
a test runs them inline, with a scripted server.

    action              result sent back
    DraftPlain          DraftResult            (below the committed sequence; the anchor moves)
    DraftConditional    Drafted                (below sequences extending the anchor, in its workspace)
    FinishLeaves        Drafted                (evaluate leaves of trees already sent)
    Reanchor            None                   (sync to a new anchor, replay the tree in flight)
    SendPrompt          float                  (perf_counter time it left)
    SendTree            tuple[int, float]      (frame bytes, perf_counter time it left)
    Deliver             None                   (a verdict for the client, in order)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from edge_client.trees import DraftResult
from shared.messages import Prompt, Tree, Verdict
from shared.tree import TokenTree


@dataclass(frozen=True)
class DraftPlain:
    """A tree below `committed`, the drafter re-synced to it; `budget` nodes for a dynamic shape.
    Its leaves are left unevaluated (FinishLeaves, after it is sent)."""

    committed: tuple[int, ...]
    budget: int


@dataclass(frozen=True)
class DraftConditional:
    """Trees below each of `fulls` (each extends `anchor`, the sequence the drafter is synced to),
    in the current workspace; `stops[i]()` True abandons tree i between evaluations. `lockstep`:
    all of them together, one drafter evaluation per level (trees.lockstep)."""

    anchor: tuple[int, ...]
    fulls: tuple[tuple[int, ...], ...]
    stops: tuple[Callable[[], bool], ...]
    lockstep: bool
    budget: int = 0  # nodes of a dynamic shape


@dataclass(frozen=True)
class FinishLeaves:
    """Evaluate the given leaves of sent trees (still in the workspace), in one drafter call."""

    work: tuple[tuple[int, DraftResult, tuple[int, ...]], ...]  # (round, draft, leaf nodes)


@dataclass(frozen=True)
class Reanchor:
    """Sync the drafter to `committed` and replay `tree` (the tree in flight) below it."""

    committed: tuple[int, ...]
    tree: TokenTree


@dataclass(frozen=True)
class SendPrompt:
    prompt: Prompt


@dataclass(frozen=True)
class SendTree:
    tree: Tree


@dataclass(frozen=True)
class Deliver:
    """A verdict for the client (streamed, in order)."""

    verdict: Verdict


@dataclass(frozen=True)
class Drafted:
    """What a conditional draft or a leaf evaluation gave: one entry per tree asked for (None: not
    drafted); workspace_full: the workspace had no room; cancelled: trees abandoned by their stop."""

    results: tuple[DraftResult | None, ...]
    workspace_full: bool = False
    cancelled: int = 0


Action = DraftPlain | DraftConditional | FinishLeaves | Reanchor | SendPrompt | SendTree | Deliver
DRAFT_ACTIONS = (DraftPlain, DraftConditional, FinishLeaves, Reanchor)

__all__ = [
    "DRAFT_ACTIONS",
    "Action",
    "Deliver",
    "DraftConditional",
    "DraftPlain",
    "Drafted",
    "FinishLeaves",
    "Reanchor",
    "SendPrompt",
    "SendTree",
]
