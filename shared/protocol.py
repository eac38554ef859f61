"""The session protocol, sans I/O: bytes in, events and bytes out (DESIGN sections 3.1-3.2).

`ServerProtocol` and `ClientProtocol` accept only legal message orders; anything else becomes a
`ProtocolError` naming the field. Neither touches a socket: the FastAPI handler and the asyncio
client are thin shells that move bytes.

Rounds. The server answers every prompt with a verdict of round 0 (it verifies the tree attached to
the prompt, or sends the first token). Tree rounds are >= 1 and strictly increase within a session.
A tree is conditional: it matches the committed sequence S iff `base + len(cond) == len(S)` and
`S[base:] == cond`. Besides the one round in flight the server keeps up to `max_pending` trees;
after each verdict it starts the matching pending tree with the highest round id at once (named in
`verdict.next_round`) and sends `stale` for every tree that can no longer match.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from shared.errors import CloseCode, ErrorCode, ProtocolError
from shared.messages import (
    DEFAULT_WIRE_LIMITS,
    PROTOCOL_VERSION,
    Cancel,
    Close,
    Error,
    FrameStats,
    Hello,
    Message,
    Mode,
    Prompt,
    SessionLimits,
    Stale,
    Tree,
    Verdict,
    Welcome,
    WireLimits,
    decode,
    encode,
)
from shared.tree import TokenTree


def tree_matches(tree: TokenTree, committed: Sequence[int] | np.ndarray) -> bool:
    """DESIGN 3.1: base + len(cond) == len(S) and S[base:] == cond."""
    n = len(committed)
    if tree.committed_len != n or tree.base > n:
        return False
    return bool(
        np.array_equal(np.asarray(committed[tree.base :], dtype=np.int64), tree.cond.astype(np.int64))
    )


def can_still_match(tree: TokenTree, committed: Sequence[int] | np.ndarray, growing: bool) -> bool:
    """Whether `tree` matches S now or may match once S grows (growing: a round is in flight).

    A round in flight always adds at least one token, so while one is in flight a tree for the
    current length is already dead.
    """
    n = len(committed)
    if tree.base > n:
        return False
    known = np.asarray(committed[tree.base :], dtype=np.int64)
    cond = tree.cond.astype(np.int64)
    if known.size > cond.size or not np.array_equal(cond[: known.size], known):
        return False
    if known.size == cond.size:
        return not growing
    return True


# ---------------------------------------------------------------------------------------------------
# Server side


class ServerState(enum.Enum):
    AWAIT_HELLO = "await_hello"
    IDLE = "idle"  # welcomed, no generation active
    GENERATING = "generating"
    CLOSED = "closed"


@dataclass(frozen=True)
class HelloReceived:
    hello: Hello


@dataclass(frozen=True)
class PromptReceived:
    """Start prefill. `committed` is the full committed sequence (cached context + new tokens)."""

    prompt: Prompt
    committed: np.ndarray


@dataclass(frozen=True)
class VerifyTree:
    """Verify this tree now (it matches the committed sequence and nothing else is in flight)."""

    round: int
    tree: TokenTree


@dataclass(frozen=True)
class CancelReceived:
    in_flight: bool  # a round is being verified; its verdict will end the generation


@dataclass(frozen=True)
class ClosedByPeer:
    reason: str | None


@dataclass(frozen=True)
class ErrorSent:
    """An error frame is in the outbox; if fatal, close with `close_code` after sending it."""

    error: ProtocolError

    @property
    def close_code(self) -> CloseCode:
        return self.error.close_code


ServerEvent = HelloReceived | PromptReceived | VerifyTree | CancelReceived | ClosedByPeer | ErrorSent


@dataclass
class Generation:
    """What the server protocol tracks of the generation in progress."""

    prompt: Prompt
    committed: list[int]  # S: this protocol's own, or the verifier's list (`share_committed`)
    in_flight: int | None = 0  # round being verified (0: the prompt's answer)
    pending: dict[int, TokenTree] = field(default_factory=dict)
    cancelled: bool = False
    shared: bool = False  # `committed` is the verifier's: it extends it, verdict() only checks it


class ServerProtocol:
    """One connection, server side.

    Feed frames to `receive`; act on the events; call `welcome` after HelloReceived and `verdict`
    after every verified round; send everything `data_to_send` returns, in order.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        limits: SessionLimits,
        wire: WireLimits | None = None,
        versions: Sequence[int] = (PROTOCOL_VERSION,),
    ) -> None:
        self.vocab_size = vocab_size
        self.limits = limits
        self.wire = wire or WireLimits(max_bytes=limits.max_bytes)
        self.versions = tuple(versions)
        self.allowed_modes: frozenset[Mode] = frozenset({Mode.GREEDY, Mode.MATCH, Mode.AR})
        self.state = ServerState.AWAIT_HELLO
        self.gen: Generation | None = None
        self.context: list[int] = []  # committed sequence of the last generation (for `continue`)
        self.last_round = 0
        self.stats = FrameStats()
        self._out: list[bytes] = []

    # -- outgoing
    def data_to_send(self) -> list[bytes]:
        out, self._out = self._out, []
        return out

    def _send(self, msg: Message) -> None:
        frame = encode(msg)
        self.stats.out(msg.TYPE.value, len(frame))
        self._out.append(frame)

    def welcome(self, msg: Welcome) -> None:
        if self.state is not ServerState.AWAIT_HELLO:
            raise RuntimeError(f"welcome in state {self.state.value}")
        self.allowed_modes = frozenset(msg.allowed_modes)
        self.state = ServerState.IDLE
        self._send(msg)

    def fail(self, exc: ProtocolError) -> ErrorSent:
        """Queue an error frame (and, if fatal, move to CLOSED)."""
        self._send(Error.from_exception(exc))
        if exc.fatal:
            self.state = ServerState.CLOSED
        return ErrorSent(exc)

    def abort(self, exc: ProtocolError) -> ErrorSent:
        """The round in flight could not be verified (exc.round; e.g. BUSY: no KV room): the
        generation ends with this error alone, no verdict; pending trees go stale. A non-fatal
        BUSY with a round ends the client's generation too (ClientProtocol._on_error)."""
        gen = self.gen
        if gen is not None and not exc.fatal:
            self._stale_all(gen, "aborted")
            self.context = gen.committed
            self.gen = None
            self.state = ServerState.IDLE
        return self.fail(exc)

    def close(self, reason: str | None = None) -> None:
        if self.state is not ServerState.CLOSED:
            self._send(Close(reason))
            self.state = ServerState.CLOSED

    def share_committed(self, committed: list[int]) -> None:
        """Read the generation's committed sequence from the verifier's list from now on (one source
        of truth in the server: the engine extends it before each verdict, `verdict` checks it).
        The list must hold the sequence the prompt started (PromptReceived.committed)."""
        gen = self.gen
        if gen is None:
            raise RuntimeError("share_committed with no generation")
        if committed != gen.committed:
            raise RuntimeError(f"the shared sequence ({len(committed)} tokens) is not the generation's")
        gen.committed, gen.shared = committed, True

    def verdict(self, v: Verdict) -> VerifyTree | None:
        """Send the verdict of the round in flight; returns the pending tree to verify next, if any.

        Fills `next_round`; ends the generation when `v.done` or after a cancel.
        """
        gen = self.gen
        if self.state is not ServerState.GENERATING or gen is None or gen.in_flight is None:
            raise RuntimeError("verdict with no round in flight")
        if v.round != gen.in_flight:
            raise RuntimeError(f"verdict for round {v.round} but round {gen.in_flight} is in flight")
        if not gen.shared:
            gen.committed.extend(int(t) for t in v.tokens)
        if v.committed_len != len(gen.committed):
            raise RuntimeError(f"verdict committed_len {v.committed_len} != {len(gen.committed)}")
        done, reason = v.done, v.reason
        if gen.cancelled and not done:
            done, reason = True, "cancelled"
        nxt: VerifyTree | None = None
        if done:
            self._stale_all(gen, "done")
        elif gen.prompt.mode is Mode.AR:
            pass  # ar: the server keeps streaming round-0 verdicts
        else:
            matching = [r for r, t in gen.pending.items() if tree_matches(t, gen.committed)]
            if matching:
                best = max(matching)
                nxt = VerifyTree(best, gen.pending.pop(best))
            for r in sorted(gen.pending):
                if not can_still_match(gen.pending[r], gen.committed, growing=nxt is not None):
                    del gen.pending[r]
                    self._send(Stale(r, "superseded" if r in matching else "mismatch"))
        in_flight = None if nxt is None else nxt.round
        if gen.prompt.mode is Mode.AR and not done:
            in_flight = 0
        gen.in_flight = in_flight
        self._send(
            Verdict(
                round=v.round,
                tokens=v.tokens,
                accepted_nodes=v.accepted_nodes,
                has_bonus=v.has_bonus,
                committed_len=v.committed_len,
                next_round=nxt.round if nxt is not None else None,
                verify_ms=v.verify_ms,
                done=done,
                reason=reason,
            )
        )
        if done:
            self.context = gen.committed
            self.gen = None
            self.state = ServerState.IDLE
        return nxt

    def _stale_all(self, gen: Generation, reason: str) -> None:
        for r in sorted(gen.pending):
            self._send(Stale(r, reason))
        gen.pending.clear()

    # -- incoming
    def receive(self, data: bytes) -> list[ServerEvent]:
        """Decode one frame and advance the state machine. Errors become ErrorSent events."""
        if self.state is ServerState.CLOSED:
            return []
        self.stats.inc(len(data))
        try:
            msg = decode(data, self.wire)
            return self._dispatch(msg)
        except ProtocolError as exc:
            return [self.fail(exc)]

    def _dispatch(self, msg: Message) -> list[ServerEvent]:
        if self.state is ServerState.AWAIT_HELLO:
            if not isinstance(msg, Hello):
                raise ProtocolError(
                    ErrorCode.BAD_ORDER, "the first message must be hello", "type", fatal=True
                )
            if msg.version not in self.versions:
                raise ProtocolError(
                    ErrorCode.BAD_VERSION,
                    f"protocol version {msg.version} not spoken; use {list(self.versions)}",
                    "version",
                    fatal=True,
                )
            return [HelloReceived(msg)]
        if isinstance(msg, Close):
            self.state = ServerState.CLOSED
            return [ClosedByPeer(msg.reason)]
        if isinstance(msg, Prompt):
            return [self._on_prompt(msg)]
        if isinstance(msg, Tree):
            return self._on_tree(msg)
        if isinstance(msg, Cancel):
            return self._on_cancel()
        raise ProtocolError(
            ErrorCode.BAD_ORDER, f"a client may not send {msg.TYPE.value}", "type", fatal=True
        )

    def _on_prompt(self, p: Prompt) -> PromptReceived:
        if self.state is ServerState.GENERATING:
            raise ProtocolError(
                ErrorCode.BAD_ORDER, "a generation is already running; cancel it first", "type"
            )
        lim = self.limits
        if p.mode not in self.allowed_modes:
            raise ProtocolError(
                ErrorCode.MODE_NOT_ALLOWED,
                f"mode {p.mode.value} is not allowed for this key; allowed: "
                f"{sorted(m.value for m in self.allowed_modes)}",
                "mode",
                round=0,
            )
        if p.continue_ and not self.context:
            raise ProtocolError(
                ErrorCode.BAD_ORDER, "continue needs an earlier generation", "continue", round=0
            )
        if p.tokens.size and (int(p.tokens.min()) < 0 or int(p.tokens.max()) >= self.vocab_size):
            raise ProtocolError(
                ErrorCode.OUT_OF_RANGE, f"token ids must be in [0, {self.vocab_size})", "tokens", round=0
            )
        if p.stop_ids and (min(p.stop_ids) < 0 or max(p.stop_ids) >= self.vocab_size):
            raise ProtocolError(
                ErrorCode.OUT_OF_RANGE, f"stop ids must be in [0, {self.vocab_size})", "stop_ids", round=0
            )
        committed = (list(self.context) if p.continue_ else []) + [int(t) for t in p.tokens]
        if not committed:
            raise ProtocolError(ErrorCode.BAD_MESSAGE, "a prompt needs at least one token", "tokens", round=0)
        if len(committed) >= lim.max_context:
            raise ProtocolError(
                ErrorCode.CONTEXT_FULL,
                f"{len(committed)} tokens leave no room under max_context {lim.max_context}",
                "tokens",
                round=0,
            )
        if p.tree is not None:
            self._check_tree(p.tree, p.mode, "tree", 0)
            if not tree_matches(p.tree, committed):
                raise ProtocolError(
                    ErrorCode.BAD_TREE,
                    f"the prompt's tree must have base + len(cond) == {len(committed)} and match the prompt",
                    "tree.base",
                    round=0,
                )
        self.gen = Generation(p, committed)
        self.state = ServerState.GENERATING
        return PromptReceived(p, np.asarray(committed, dtype=np.int32))

    def _check_tree(self, tree: TokenTree, mode: Mode, fld: str, rnd: int) -> None:
        lim = self.limits
        if mode is Mode.AR:
            raise ProtocolError(ErrorCode.BAD_ORDER, "mode ar takes no trees", fld, round=rnd)
        try:
            tree.validate(
                self.vocab_size,
                lim.max_nodes,
                lim.max_depth,
                stochastic=mode.stochastic,
                without_replacement=mode is Mode.RRS,
                field=fld,
                draw_limits=lim.draws,
            )
        except ProtocolError as exc:
            exc.round = rnd
            raise
        if tree.cond.size > 4 * (lim.max_depth + 1):
            raise ProtocolError(
                ErrorCode.LIMIT_EXCEEDED,
                f"cond longer than 4 * (max_depth + 1) = {4 * (lim.max_depth + 1)}: "
                "speculation reaches at most 4 rounds ahead",
                f"{fld}.cond",
                round=rnd,
            )

    def _on_tree(self, msg: Tree) -> list[ServerEvent]:
        r = msg.round
        if r <= self.last_round:
            raise ProtocolError(
                ErrorCode.BAD_ORDER, f"round {r} is not after round {self.last_round}", "round", round=r
            )
        self.last_round = r
        gen = self.gen
        if gen is None:
            if self.state is ServerState.IDLE and self.context:
                # a tree sent before the client saw the done verdict: a race, not an error
                self._send(Stale(r, "no generation"))
                return []
            raise ProtocolError(ErrorCode.BAD_ORDER, "a tree needs a prompt first", "type", round=r)
        self._check_tree(msg.tree, gen.prompt.mode, "tree", r)
        if gen.cancelled:
            self._send(Stale(r, "cancelled"))
            return []
        committed = gen.committed
        if gen.in_flight is None and tree_matches(msg.tree, committed):
            gen.in_flight = r
            return [VerifyTree(r, msg.tree)]
        if not can_still_match(msg.tree, committed, growing=gen.in_flight is not None):
            self._send(Stale(r, "mismatch"))
            return []
        if len(gen.pending) >= self.limits.max_pending:
            raise ProtocolError(
                ErrorCode.TOO_MANY_PENDING,
                f"already {len(gen.pending)} pending trees (max_pending {self.limits.max_pending})",
                "round",
                round=r,
            )
        gen.pending[r] = msg.tree
        return []

    def _on_cancel(self) -> list[ServerEvent]:
        gen = self.gen
        if gen is None or gen.cancelled:
            return []  # nothing to cancel: a race with the done verdict
        gen.cancelled = True
        self._stale_all(gen, "cancelled")
        if gen.in_flight is None:
            gen.in_flight = 0
            self.verdict(
                Verdict(
                    0,
                    np.zeros(0, np.int32),
                    np.zeros(0, np.int32),
                    has_bonus=False,
                    committed_len=len(gen.committed),
                    done=True,
                    reason="cancelled",
                )
            )
            return [CancelReceived(in_flight=False)]
        return [CancelReceived(in_flight=True)]


# ---------------------------------------------------------------------------------------------------
# Client side


class ClientState(enum.Enum):
    START = "start"
    AWAIT_WELCOME = "await_welcome"
    IDLE = "idle"
    GENERATING = "generating"
    CANCELLING = "cancelling"
    CLOSED = "closed"


class ClientProtocol:
    """One connection, client side: checks the server's frames against what the client sent.

    `committed` is the committed sequence as the server reported it (prompt + accepted tokens).
    """

    def __init__(self, wire: WireLimits = DEFAULT_WIRE_LIMITS) -> None:
        self.wire = wire
        self.state = ClientState.START
        self.welcome_msg: Welcome | None = None
        self.committed: list[int] = []
        self.mode: Mode = Mode.GREEDY
        self.outstanding: set[int] = set()  # tree rounds sent, not yet answered
        self.awaiting_prompt = False
        self.last_round = 0
        self.last_verdict_round = 0
        self.in_flight: int | None = None  # the round the server is verifying, as far as we know
        self.stats = FrameStats()
        self._context: list[int] = []

    def _send(self, msg: Message) -> bytes:
        frame = encode(msg)
        if self.welcome_msg is not None and len(frame) > self.welcome_msg.limits.max_bytes:
            raise ProtocolError(
                ErrorCode.TOO_LARGE,
                f"{msg.TYPE.value} of {len(frame)} bytes is over the server's limit "
                f"{self.welcome_msg.limits.max_bytes}",
                "frame",
            )
        self.stats.out(msg.TYPE.value, len(frame))
        return frame

    def _require(self, *states: ClientState) -> None:
        if self.state not in states:
            raise ProtocolError(ErrorCode.BAD_ORDER, f"not allowed in state {self.state.value}", "state")

    # -- outgoing
    def hello(self, msg: Hello) -> bytes:
        self._require(ClientState.START)
        self.state = ClientState.AWAIT_WELCOME
        return self._send(msg)

    def prompt(self, msg: Prompt) -> bytes:
        self._require(ClientState.IDLE)
        frame = self._send(msg)
        self.mode = msg.mode
        self.committed = self.committed_for(msg)
        self.awaiting_prompt = True
        self.in_flight = 0
        self.state = ClientState.GENERATING
        return frame

    def committed_for(self, msg: Prompt) -> list[int]:
        """The committed sequence a prompt starts from: the context if it continues, then its tokens."""
        return (list(self._context) if msg.continue_ else []) + [int(t) for t in msg.tokens]

    def tree(self, msg: Tree) -> bytes:
        self._require(ClientState.GENERATING)
        if self.mode is Mode.AR:
            raise ProtocolError(ErrorCode.BAD_ORDER, "mode ar takes no trees", "round")
        if msg.round <= self.last_round:
            raise ProtocolError(
                ErrorCode.BAD_ORDER, f"round {msg.round} is not after {self.last_round}", "round"
            )
        w = self.welcome_msg
        if w is not None and len(self.outstanding) >= w.limits.max_pending + 1:
            raise ProtocolError(
                ErrorCode.TOO_MANY_PENDING, f"{len(self.outstanding)} trees already outstanding", "round"
            )
        frame = self._send(msg)
        self.last_round = msg.round
        self.outstanding.add(msg.round)
        if self.in_flight is None and tree_matches(msg.tree, self.committed):
            self.in_flight = msg.round
        return frame

    def cancel(self) -> bytes:
        self._require(ClientState.GENERATING)
        self.state = ClientState.CANCELLING
        return self._send(Cancel())

    def close(self, reason: str | None = None) -> bytes:
        frame = self._send(Close(reason))
        self.state = ClientState.CLOSED
        return frame

    # -- incoming
    def receive(self, data: bytes) -> Message:
        """Decode and check one server frame; raises ProtocolError if the server broke the protocol."""
        self.stats.inc(len(data))
        msg = decode(data, self.wire)
        if isinstance(msg, Error):
            self._on_error(msg)
            return msg
        if isinstance(msg, Close):
            self.state = ClientState.CLOSED
            return msg
        if isinstance(msg, Welcome):
            self._require(ClientState.AWAIT_WELCOME)
            self.welcome_msg = msg
            self.state = ClientState.IDLE
            return msg
        if isinstance(msg, Verdict):
            self._on_verdict(msg)
            return msg
        if isinstance(msg, Stale):
            if msg.round not in self.outstanding:
                raise ProtocolError(ErrorCode.BAD_ORDER, f"stale for round {msg.round} never sent", "round")
            self.outstanding.discard(msg.round)
            return msg
        raise ProtocolError(ErrorCode.BAD_ORDER, f"a server may not send {msg.TYPE.value}", "type")

    def _on_error(self, e: Error) -> None:
        if e.fatal:
            self.state = ClientState.CLOSED
            return
        if e.code is ErrorCode.BUSY and e.round is not None and self.state is not ClientState.IDLE:
            # the server could not verify a round (ServerProtocol.abort): the generation is over
            self._context = list(self.committed)
            self.awaiting_prompt = False
            self.outstanding.clear()
            self.in_flight = None
            self.state = ClientState.IDLE
        elif e.round == 0 and self.awaiting_prompt:
            self.awaiting_prompt = False
            self.in_flight = None
            self.state = ClientState.IDLE
        elif e.round is not None:
            self.outstanding.discard(e.round)
            if self.in_flight == e.round:
                self.in_flight = None

    def _on_verdict(self, v: Verdict) -> None:
        self._require(ClientState.GENERATING, ClientState.CANCELLING)
        if v.round == 0:
            legal = self.awaiting_prompt or self.mode is Mode.AR or self.state is ClientState.CANCELLING
            if not legal:
                raise ProtocolError(ErrorCode.BAD_ORDER, "unexpected round-0 verdict", "round")
            self.awaiting_prompt = False
        else:
            if v.round not in self.outstanding or v.round <= self.last_verdict_round:
                raise ProtocolError(
                    ErrorCode.BAD_ORDER, f"verdict for round {v.round} not outstanding", "round"
                )
            self.outstanding.discard(v.round)
            self.last_verdict_round = v.round
        self.committed.extend(int(t) for t in v.tokens)
        if v.committed_len != len(self.committed):
            raise ProtocolError(
                ErrorCode.BAD_MESSAGE,
                f"committed_len {v.committed_len} but the client holds {len(self.committed)} tokens",
                "committed_len",
            )
        if v.next_round is not None and v.next_round not in self.outstanding:
            raise ProtocolError(
                ErrorCode.BAD_ORDER, f"next_round {v.next_round} was never sent", "next_round"
            )
        self.in_flight = v.next_round
        if v.done:
            self._context = list(self.committed)
            self.in_flight = None
            self.state = ClientState.IDLE
        elif self.mode is Mode.AR:
            self.in_flight = 0


__all__ = [
    "CancelReceived",
    "ClientProtocol",
    "ClientState",
    "ClosedByPeer",
    "ErrorSent",
    "Generation",
    "HelloReceived",
    "PromptReceived",
    "ServerEvent",
    "ServerProtocol",
    "ServerState",
    "VerifyTree",
    "can_still_match",
    "tree_matches",
]
