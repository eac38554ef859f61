"""The engine's state, as plain dataclasses: a session's generation (`SeqState`) with its explicit
status (`SeqStatus`, transitions checked), the round it wants verified (`Job`), a round's outcome
(`RoundResult`), the engine's config, one session's part of a step (`Planned`), and what the
stages of a step hand each other (`Packed`, `StepVerdict`, `StepOutcome`, `StepDone`).

cloud_verifier.step runs a step over this state (and re-exports every name here); which thread
may touch which field is told there.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cloud_verifier.sampling import SamplingParams
from shared.errors import ProtocolError
from shared.messages import Mode
from shared.tree import TokenTree

# ---------------------------------------------------------------------------------------------------
# The engine's state


@dataclass
class Job:
    """A round a session wants verified. round 0: the prompt's answer or an `ar` step."""

    round: int
    tree: TokenTree | None
    ready_at: float = field(default_factory=time.perf_counter)


@dataclass
class RoundResult:
    """The outcome of one round, already cut at stop ids / max_new_tokens / max_context."""

    round: int
    tokens: list[int]
    accepted_nodes: list[int]
    has_bonus: bool
    committed_len: int
    verify_ms: float
    done: bool
    reason: str | None
    tree_nodes: int = 0
    accepted_depths: list[int] = field(default_factory=list)
    round_s: float = 0.0
    error: ProtocolError | None = None


class SeqStatus(enum.Enum):
    """Where a session stands with the engine. Only the event loop's thread moves it (step.py)."""

    IDLE = "idle"  # no generation running
    QUEUED = "queued"  # a generation waiting for room in the KV pool before its prefill (kv_room.py)
    WAITING = "waiting"  # a generation between rounds: the client is drafting its next tree
    READY = "ready"  # a round queued for the next step
    RUNNING = "running"  # its round is in the step now running
    CLOSING = "closing"  # closed during its step: released when the step ends
    CLOSED = "closed"  # forgotten, KV freed


# what each status may become: start/submit queue a round (IDLE, WAITING -> READY), or start finds no
# room in the KV pool and the generation waits until it is admitted (-> QUEUED -> READY); a step takes it
# (-> RUNNING) and hands back a prefill chunk or a deferred round (-> READY) or a verdict (-> WAITING,
# or IDLE when the generation ended); a cancel between rounds ends it (WAITING -> IDLE); a close
# during a step waits for the step (RUNNING -> CLOSING -> CLOSED)
TRANSITIONS: dict[SeqStatus, frozenset[SeqStatus]] = {
    SeqStatus.IDLE: frozenset({SeqStatus.READY, SeqStatus.QUEUED, SeqStatus.CLOSED}),
    SeqStatus.QUEUED: frozenset({SeqStatus.READY, SeqStatus.CLOSED}),
    SeqStatus.WAITING: frozenset({SeqStatus.READY, SeqStatus.QUEUED, SeqStatus.IDLE, SeqStatus.CLOSED}),
    SeqStatus.READY: frozenset({SeqStatus.RUNNING, SeqStatus.CLOSED}),
    SeqStatus.RUNNING: frozenset({SeqStatus.READY, SeqStatus.WAITING, SeqStatus.IDLE, SeqStatus.CLOSING}),
    SeqStatus.CLOSING: frozenset({SeqStatus.CLOSED}),
    SeqStatus.CLOSED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A session asked to move between two statuses the engine never connects (a bug)."""


@dataclass
class SeqState:
    """The engine's view of one session's generation."""

    sid: int
    on_result: Callable[[RoundResult], None]
    # the server's committed sequence: the engine extends it with each round's tokens before
    # `on_result`; a session's protocol reads this same list (ServerProtocol.share_committed)
    committed: list[int] = field(default_factory=list)
    prompt_len: int = 0
    mode: Mode = Mode.GREEDY
    params: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    generator: torch.Generator | None = None
    max_new_tokens: int = 0
    stop_ids: frozenset[int] = frozenset()
    job: Job | None = None  # the round waiting for KV room, queued or running (QUEUED, READY, RUNNING)
    status: SeqStatus = SeqStatus.IDLE
    cancelled: bool = False  # a cancel came with a round queued or running: IDLE after that round

    def move(self, to: SeqStatus) -> None:
        """Change status; IllegalTransition when TRANSITIONS does not allow it."""
        if to not in TRANSITIONS[self.status]:
            raise IllegalTransition(f"session {self.sid}: {self.status.value} -> {to.value} is not allowed")
        self.status = to

    @property
    def working(self) -> bool:
        """The engine holds a round of this session (waiting for KV room, queued or in a step)."""
        return self.status in (SeqStatus.QUEUED, SeqStatus.READY, SeqStatus.RUNNING, SeqStatus.CLOSING)


@dataclass(frozen=True)
class EngineConfig:
    token_budget: int = 512  # rows per forward
    prefill_chunk: int = 16  # prompt rows a session feeds per forward while other sessions have work
    max_context: int = 4096
    batching: bool = True  # False: one session per forward (the baseline of bench.load)
    # /readyz fails when a step runs longer than max(stall_s, stall_factor x its expected time), or
    # ready work waits stall_s with no step running (the loop is stuck)
    stall_s: float = 5.0
    stall_factor: float = 8.0
    # Before a step, wait up to this long (and at most a quarter of the last step) for sessions
    # whose verdict just went out: their next tree is usually a loopback round trip away, and
    # without the wait the clients settle into two groups that take turns (half-size batches).
    gather_ms: float = 3.0
    # tree nodes a round may carry (the sessions' limit): a tree-mode generation reserves room for
    # this many rows past its longest committed sequence when it is admitted (kv_room.py)
    max_nodes: int = 64


@dataclass
class Planned:
    """One session's part of an engine step."""

    seq: SeqState
    job: Job
    pre: list[int]  # committed tokens fed first (the last one is row 0 when final)
    final: bool  # the chunk that ends with row 0 (+ tree): verify it

    @property
    def rows(self) -> int:
        """Rows it feeds the forward: its committed tokens, then (when final) its tree's nodes."""
        return len(self.pre) + (self.job.tree.num_nodes if self.final and self.job.tree is not None else 0)


# ---------------------------------------------------------------------------------------------------
# What the stages of a step hand each other


@dataclass(frozen=True)
class StepOutcome:
    """How one planned round ended in a step: a result, an error, or neither (a prefill chunk:
    its round stays queued for a later step)."""

    planned: Planned
    result: RoundResult | None = None
    error: ProtocolError | None = None


@dataclass(frozen=True)
class Packed:
    """The packed forward: the rounds it ran with their logits ([rows wanted, vocab] each), the
    rounds left for the next step (the KV pool could not hold them all), and a round refused alone."""

    rounds: list[Planned]
    logits: list[torch.Tensor]
    deferred: list[Planned] = field(default_factory=list)
    refused: list[StepOutcome] = field(default_factory=list)


@dataclass
class StepVerdict:
    """One round's verdict: the sampled tokens and accepted nodes on the host, or (`sync_free`) still
    packed on the device until the step's one copy; `error` when verifying it failed. A prefill
    chunk has no verdict (`planned.final` is False)."""

    planned: Planned
    tokens: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    device: torch.Tensor | None = None
    error: ProtocolError | None = None


@dataclass(frozen=True)
class StepDone:
    """What `execute` hands back to the loop thread: every planned round's outcome, in plan order,
    and the rounds deferred to a later step."""

    outcomes: list[StepOutcome]
    deferred: list[Planned]
