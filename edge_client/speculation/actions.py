"""What the speculation core asks its shell to do, and the typed result each request gets back.

The core (speculation.core) is sans-I/O: its steps are generators that yield these actions and
receive each one's result (`generator.send`). Every action is an `Ask[R]`: it names the type of
its result and checks it (`Ask.take`), so the core reads `result = yield from ask(action)` with
the result's own type and a shell that answers with the wrong thing fails at once, naming the
action. The asyncio shell (speculation.executor) runs draft actions on the drafting thread
(speculation.executor.DraftStep) and puts frames on the socket; a test runs them inline, with a
scripted server (tests/edge_client/scripted.py).

    action              result                 what the shell does
    DraftPlain          DraftResult            draft below the committed sequence; the anchor moves
    DraftConditional    Drafted                draft below sequences extending the anchor, in its workspace
    FinishLeaves        Drafted                evaluate leaves of trees already sent
    Reanchor            Reanchored             sync to a new anchor, replay the tree in flight
    Send                Sent                   put a frame (encoded by the core's protocol) on the socket
    Deliver             Delivered              hand a verdict to the client, in order
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Generic, TypeVar

from edge_client.speculation.config import TreeSpec
from edge_client.trees import DraftResult
from shared.messages import Verdict
from shared.tree import TokenTree

R_co = TypeVar("R_co", covariant=True)


class Ask(Generic[R_co]):
    """An action whose result is an R_co (see the module docstring)."""

    def take(self, result: object) -> R_co:  # pragma: no cover - every action overrides it
        raise NotImplementedError

    def _wrong(self, result: object) -> TypeError:
        return TypeError(f"{type(self).__name__} got a {type(result).__name__} back from its shell")


Steps = Generator["Ask[object]", object, None]


def ask(action: Ask[R_co]) -> Generator[Ask[object], object, R_co]:
    """Yield `action` to the shell and return its checked, typed result."""
    result = yield action
    return action.take(result)


@dataclass(frozen=True)
class Drafted:
    """What a conditional draft or a leaf evaluation gave: one entry per tree asked for (None: not
    drafted); workspace_full: the workspace had no room; cancelled: trees abandoned by their stop."""

    results: tuple[DraftResult | None, ...]
    workspace_full: bool = False
    cancelled: int = 0


@dataclass(frozen=True)
class Sent:
    """A frame left: its size and the clock time it left (the core's clock)."""

    size: int
    at: float


@dataclass(frozen=True)
class Reanchored:
    """The drafter is synced to the new anchor and the tree in flight replayed below it."""


@dataclass(frozen=True)
class Delivered:
    """The client has the verdict."""


@dataclass(frozen=True)
class DraftPlain(Ask[DraftResult]):
    """A tree below `committed`, the drafter re-synced to it; `budget` nodes for a dynamic shape;
    `shape` instead of the configured one (the miss path's, speculation.backup). Its leaves are
    left unevaluated (FinishLeaves, after it is sent)."""

    committed: tuple[int, ...]
    budget: int
    shape: TreeSpec | None = None

    def take(self, result: object) -> DraftResult:
        if not isinstance(result, DraftResult):
            raise self._wrong(result)
        return result


@dataclass(frozen=True)
class DraftConditional(Ask[Drafted]):
    """Trees below each of `fulls` (each extends `anchor`, the sequence the drafter is synced to),
    in the current workspace; `stops[i]()` True abandons tree i between evaluations. `lockstep`:
    all of them together, one drafter evaluation per level (trees.lockstep). `shapes`: one per
    tree instead of the configured shape (the outcome cache's chains, speculation.schedule)."""

    anchor: tuple[int, ...]
    fulls: tuple[tuple[int, ...], ...]
    stops: tuple[Callable[[], bool], ...]
    lockstep: bool
    budget: int = 0  # nodes of a dynamic shape
    shapes: tuple[TreeSpec, ...] | None = None

    def take(self, result: object) -> Drafted:
        if not isinstance(result, Drafted) or len(result.results) != len(self.fulls):
            raise self._wrong(result)
        return result


@dataclass(frozen=True)
class FinishLeaves(Ask[Drafted]):
    """Evaluate the given leaves of sent trees (still in the workspace), in one drafter call."""

    work: tuple[tuple[int, DraftResult, tuple[int, ...]], ...]  # (round, draft, leaf nodes)

    def take(self, result: object) -> Drafted:
        if not isinstance(result, Drafted) or len(result.results) != len(self.work):
            raise self._wrong(result)
        return result


@dataclass(frozen=True)
class Reanchor(Ask[Reanchored]):
    """Sync the drafter to `committed` and replay `tree` (the tree in flight) below it."""

    committed: tuple[int, ...]
    tree: TokenTree

    def take(self, result: object) -> Reanchored:
        if not isinstance(result, Reanchored):
            raise self._wrong(result)
        return result


@dataclass(frozen=True)
class Send(Ask[Sent]):
    """Put `frame` on the socket. `kind` ("prompt" or "tree") and `round` say what it carries."""

    frame: bytes
    kind: str
    round: int

    def take(self, result: object) -> Sent:
        if not isinstance(result, Sent):
            raise self._wrong(result)
        return result


@dataclass(frozen=True)
class Deliver(Ask[Delivered]):
    """A verdict for the client (streamed, in order)."""

    verdict: Verdict

    def take(self, result: object) -> Delivered:
        if not isinstance(result, Delivered):
            raise self._wrong(result)
        return result


Action = DraftPlain | DraftConditional | FinishLeaves | Reanchor | Send | Deliver
DRAFT_ACTIONS = (DraftPlain, DraftConditional, FinishLeaves, Reanchor)
DraftAction = DraftPlain | DraftConditional | FinishLeaves | Reanchor

__all__ = [
    "DRAFT_ACTIONS",
    "Action",
    "Ask",
    "Deliver",
    "Delivered",
    "DraftAction",
    "DraftConditional",
    "DraftPlain",
    "Drafted",
    "FinishLeaves",
    "Reanchor",
    "Reanchored",
    "Send",
    "Sent",
    "Steps",
    "ask",
]
