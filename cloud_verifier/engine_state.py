"""The engine's state as plain dataclasses: a session's generation (`SeqState`), the round it wants
verified (`Job`), a round's outcome (`RoundResult`), the engine's config, and one session's part of
a step (`Planned`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cloud_verifier.sampling import SamplingParams
from shared.errors import ProtocolError
from shared.messages import Mode
from shared.tree import TokenTree


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
    job: Job | None = None
    busy: bool = False
    closed: bool = False
    active: bool = False  # a generation is running (its next round may come any moment)


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


# a planned round and how it ended: a result, nothing yet (a prefill chunk), or an error
Outcome = tuple[Planned, RoundResult | None, ProtocolError | None]
