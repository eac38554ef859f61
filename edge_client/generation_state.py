"""The state of one generation on an EdgeClient (edge_client.client): the rounds' driver open on
the session (RunningGeneration), its text as verdicts come (GenerationOutput), and the connection
drops it survived (DropCount)."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass

from edge_client.errors import GenerationError
from edge_client.speculation import RoundExecutor
from edge_client.stats import GenerationResult
from edge_client.tokenizer import IncrementalDetokenizer, find_stop
from shared.messages import Verdict


@dataclass
class RunningGeneration:
    """The generation open on a session: its rounds' driver and their verdict stream (both replaced
    on a resume), whether its consumer holds it at a yield, and whether a later generate took over."""

    driver: RoundExecutor | None = None
    verdicts: AsyncGenerator[Verdict, None] | None = None
    at_yield: bool = False
    abandoned: bool = False


@dataclass
class GenerationOutput:
    """One generation as its verdicts come: its record (`gen`), the detokenized text cut at the first
    stop string (`cut`, once found), how many characters of it were yielded (`emitted`), the round
    the server took up with no round trip (`next_round`), and the start of its clock and traffic."""

    gen: GenerationResult
    detok: IncrementalDetokenizer
    stop: Sequence[str]
    on_verdict: Callable[[Verdict, bool], None] | None
    bytes_up0: int
    bytes_down0: int
    t_start: float
    emitted: int = 0
    cut: int | None = None
    next_round: int | None = None

    def push(self, v: Verdict) -> str:
        """Take a verdict (the first token's time, `on_verdict`, its tokens); the text so far, cut
        at a stop string."""
        st = self.gen.stats
        if not st.first_token_s:
            st.first_token_s = time.perf_counter() - self.t_start
        if self.on_verdict is not None:
            self.on_verdict(v, v.round != 0 and v.round == self.next_round)
        self.next_round = v.next_round
        new = v.tokens.tolist()
        self.gen.tokens.extend(new)
        self.detok.push(new)
        if v.done:
            self.detok.flush()
        text = self.detok.text
        if self.cut is None and self.stop:
            self.cut = find_stop(text, self.stop, self.emitted)
        if self.cut is not None:
            text = text[: self.cut]
        return text

    def finish(self, bytes_out: int, bytes_in: int) -> None:
        """The generation ended: its wall time and the bytes it sent and received."""
        st = self.gen.stats
        st.wall_s = time.perf_counter() - self.t_start
        st.bytes_up = bytes_out - self.bytes_up0
        st.bytes_down = bytes_in - self.bytes_down0


@dataclass
class DropCount:
    """The connection drops of one generation: tokens committed at the last drop (`progress`) and
    drops in a row with no new token since (`stalls`)."""

    progress: int = 0
    stalls: int = 0

    def dropped(self, committed: int) -> int:
        """A drop with `committed` tokens generated; the drops in a row with no new token."""
        self.stalls = 1 if committed > self.progress else self.stalls + 1
        self.progress = committed
        return self.stalls


def check_not_abandoned(running: RunningGeneration) -> None:
    """Back from a yield: refuse to go on if a later generate() took the session over meanwhile."""
    if running.abandoned:
        raise GenerationError(
            "this generation was abandoned: another generate() started on this client before it ended"
        )


__all__ = ["DropCount", "GenerationOutput", "RunningGeneration", "check_not_abandoned"]
