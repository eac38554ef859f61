"""The session protocol's server side, sans I/O (shared/protocol.py has the rules): frames in,
events out (`HelloReceived`, `PromptReceived`, `VerifyTree`, ...), verdicts and errors in, frames
out. Anything out of order becomes a `ProtocolError` naming the field."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from shared.errors import ErrorCode, ProtocolError
from shared.messages import (
    FEATURE_COST,
    FEATURE_DIRECT,
    FEATURE_GAP_MS,
    FEATURE_PENDING_BYTES,
    FEATURE_RESUME,
    FEATURE_WELCOME_FEATURES,
    FEATURES,
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
    Stream,
    Tree,
    Verdict,
    Welcome,
    WireLimits,
    decode,
    encode,
)
from shared.server_events import (
    CancelReceived,
    ClosedByPeer,
    ErrorSent,
    HelloReceived,
    PromptReceived,
    ServerEvent,
    ServerState,
    VerifyTree,
)
from shared.tree import TokenTree
from shared.tree_match import can_grow_into, can_still_match, reroot, tree_matches


@dataclass
class ServerGeneration:
    """What the server protocol tracks of the generation in progress."""

    prompt: Prompt
    # S, read-only here: the verifier's sequence once it shares one (`share_committed`; its owner
    # extends it before each verdict), else `owned`
    committed: Sequence[int]
    in_flight: int | None = 0  # round being verified (0: the prompt's answer)
    pending: dict[int, TokenTree] = field(default_factory=dict)
    pending_bytes: dict[int, int] = field(default_factory=dict)  # each pending tree's frame bytes
    cancelled: bool = False
    owned: list[int] | None = None  # the protocol's own sequence while no verifier shares one
    stream_wait: tuple[int, int] | None = None  # a stream round waiting for a miss: (round, k)
    streaming: int | None = None  # the round in flight is this stream round ...
    stream_left: int = 0  # ... which may send this many tokens after the one being decoded

    def unpend(self, r: int) -> TokenTree:
        """Take pending tree `r` out (verified next, or gone stale)."""
        self.pending_bytes.pop(r, None)
        return self.pending.pop(r)


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
        self.gen: ServerGeneration | None = None
        self.context: list[int] = []  # committed sequence of the last generation (for `continue`)
        self.last_round = 0
        self.stats = FrameStats()
        self.features: frozenset[str] = frozenset()  # what the client's hello asked for
        self.welcomed: Welcome | None = None  # the welcome sent
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
        """Send the welcome. Its optional limits go out only to a client that asked for them
        (hello.features): a decoder of an earlier release refuses fields it does not know."""
        if self.state is not ServerState.AWAIT_HELLO:
            raise RuntimeError(f"welcome in state {self.state.value}")
        if msg.limits.max_pending_bytes is not None and FEATURE_PENDING_BYTES not in self.features:
            msg = dataclasses.replace(msg, limits=dataclasses.replace(msg.limits, max_pending_bytes=None))
        if FEATURE_RESUME not in self.features:
            msg = dataclasses.replace(msg, resume=None)
        if FEATURE_DIRECT not in self.features or msg.resume is None:  # (it moves by its token)
            msg = dataclasses.replace(msg, direct=None)
        honoured = None
        if FEATURE_WELCOME_FEATURES in self.features:
            honoured = tuple(f for f in FEATURES if f in self.features)
        msg = dataclasses.replace(msg, features=honoured)
        self.allowed_modes = frozenset(msg.allowed_modes)
        self.state = ServerState.IDLE
        self.welcomed = msg  # (sent again to the connection the session moves to)
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
            self.context = list(gen.committed)
            self.gen = None
            self.state = ServerState.IDLE
        return self.fail(exc)

    def close(self, reason: str | None = None) -> None:
        if self.state is not ServerState.CLOSED:
            self._send(Close(reason))
            self.state = ServerState.CLOSED

    def share_committed(self, committed: Sequence[int]) -> None:
        """Read the generation's committed sequence from the verifier's from now on: one owner in
        the server (the engine's SeqState extends it before each verdict), which this protocol only
        reads (`verdict` checks each verdict's committed_len against it). It must hold the sequence
        the prompt started (PromptReceived.committed)."""
        gen = self.gen
        if gen is None:
            raise RuntimeError("share_committed with no generation")
        if list(committed) != list(gen.committed):
            raise RuntimeError(f"the shared sequence ({len(committed)} tokens) is not the generation's")
        gen.committed, gen.owned = committed, None

    def verdict(self, v: Verdict) -> VerifyTree | None:
        """Send the verdict of the round in flight; returns the pending tree to verify next, if any.

        Fills `next_round`; ends the generation when `v.done` or after a cancel. `v.gap_ms` goes
        out only to a client that asked for it (hello.features), and never for round 0.
        """
        gen = self.gen
        if self.state is not ServerState.GENERATING or gen is None or gen.in_flight is None:
            raise RuntimeError("verdict with no round in flight")
        if v.round != gen.in_flight:
            raise RuntimeError(f"verdict for round {v.round} but round {gen.in_flight} is in flight")
        if gen.owned is not None:
            gen.owned.extend(int(t) for t in v.tokens)
        if v.committed_len != len(gen.committed):
            raise RuntimeError(f"verdict committed_len {v.committed_len} != {len(gen.committed)}")
        done, reason = v.done, v.reason
        if gen.cancelled and not done:
            done, reason = True, "cancelled"
        nxt: VerifyTree | None = None
        streaming = False
        if done:
            self._stale_all(gen, "done")
        elif gen.prompt.mode is Mode.AR:
            pass  # ar: the server keeps streaming round-0 verdicts
        else:
            usable = {r: u for r, t in gen.pending.items() if (u := self._usable(gen, t)) is not None}
            matching = list(usable)
            if matching:
                best = max(matching)
                gen.unpend(best)
                nxt = VerifyTree(best, usable[best])
            elif gen.streaming == v.round and gen.stream_left > 0:
                streaming = True  # the stream goes on: the same round, one more token
                gen.stream_left -= 1
                nxt = VerifyTree(v.round, None, continues=True)
            elif gen.stream_wait is not None:  # a miss: the waiting stream starts
                sr, k = gen.stream_wait
                gen.stream_wait = None
                gen.stream_left = k - 1
                nxt = VerifyTree(sr, None)
            for r in sorted(gen.pending):
                if not self._alive(gen, gen.pending[r], growing=nxt is not None):
                    gen.unpend(r)
                    self._send(Stale(r, "superseded" if r in matching else "mismatch"))
        gen.streaming = nxt.round if nxt is not None and nxt.tree is None else None
        in_flight = None if nxt is None else nxt.round
        if gen.prompt.mode is Mode.AR and not done:
            in_flight = 0
        gen.in_flight = in_flight
        cost = FEATURE_COST in self.features
        self._send(
            Verdict(
                round=v.round,
                tokens=v.tokens,
                accepted_nodes=v.accepted_nodes,
                has_bonus=v.has_bonus,
                committed_len=v.committed_len,
                next_round=nxt.round if nxt is not None and not streaming else None,
                verify_ms=v.verify_ms,
                done=done,
                reason=reason,
                gap_ms=v.gap_ms if FEATURE_GAP_MS in self.features and v.round != 0 else None,
                streaming=streaming,
                forward_ms=v.forward_ms if cost else None,
                marginal_ms=v.marginal_ms if cost else None,
            )
        )
        if done:
            self.context = list(gen.committed)
            self.gen = None
            self.state = ServerState.IDLE
        return nxt

    @staticmethod
    def _usable(gen: ServerGeneration, tree: TokenTree) -> TokenTree | None:
        """The tree to verify for `tree` now: itself when it matches; in greedy and match also its
        subtree below the committed tokens past its assumption (shared.tree_match.reroot)."""
        if gen.prompt.mode in (Mode.GREEDY, Mode.MATCH):
            rooted = reroot(tree, gen.committed)
            return None if rooted is None else rooted[0]
        return tree if tree_matches(tree, gen.committed) else None

    @staticmethod
    def _alive(gen: ServerGeneration, tree: TokenTree, growing: bool) -> bool:
        """Whether a pending tree may still be verified (else it goes stale)."""
        if can_still_match(tree, gen.committed, growing):
            return True
        deterministic = gen.prompt.mode in (Mode.GREEDY, Mode.MATCH)
        return deterministic and growing and can_grow_into(tree, gen.committed)

    def _stale_all(self, gen: ServerGeneration, reason: str) -> None:
        waiting = {} if gen.stream_wait is None else {gen.stream_wait[0]: None}
        for r in sorted({**gen.pending, **waiting}):
            self._send(Stale(r, reason))
        gen.pending.clear()
        gen.pending_bytes.clear()
        gen.stream_wait = None

    # -- incoming
    def receive(self, data: bytes) -> list[ServerEvent]:
        """Decode one frame and advance the state machine. Errors become ErrorSent events."""
        if self.state is ServerState.CLOSED:
            return []
        self.stats.inc(len(data))
        try:
            msg = decode(data, self.wire)
            return self._dispatch(msg, len(data))
        except ProtocolError as exc:
            return [self.fail(exc)]

    def _dispatch(self, msg: Message, size: int) -> list[ServerEvent]:
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
            self.features = frozenset(msg.features)
            return [HelloReceived(msg)]
        if isinstance(msg, Close):
            self.state = ServerState.CLOSED
            return [ClosedByPeer(msg.reason)]
        if isinstance(msg, Prompt):
            return [self._on_prompt(msg)]
        if isinstance(msg, Tree):
            return self._on_tree(msg, size)
        if isinstance(msg, Stream):
            return self._on_stream(msg)
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
        if p.stream and (p.tree is not None or p.mode is Mode.AR):
            why = "a tree" if p.tree is not None else "mode ar (it streams anyway)"
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"stream does not go with {why}", "stream", round=0)
        if p.tree is not None:
            self._check_tree(p.tree, p.mode, "tree", 0)
            if not tree_matches(p.tree, committed):
                raise ProtocolError(
                    ErrorCode.BAD_TREE,
                    f"the prompt's tree must have base + len(cond) == {len(committed)} and match the prompt",
                    "tree.base",
                    round=0,
                )
        self.gen = ServerGeneration(p, committed, owned=committed)
        if p.stream:
            self.gen.streaming, self.gen.stream_left = 0, p.stream - 1
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

    def _round_of(self, r: int, kind: str) -> ServerGeneration | None:
        """A tree or stream round `r`: after every earlier round, of the generation running (None:
        answered stale, sent before the client saw the done verdict: a race, not an error)."""
        if r <= self.last_round:
            raise ProtocolError(
                ErrorCode.BAD_ORDER, f"round {r} is not after round {self.last_round}", "round", round=r
            )
        self.last_round = r
        if self.gen is None:
            if self.state is ServerState.IDLE and self.context:
                self._send(Stale(r, "no generation"))
                return None
            raise ProtocolError(ErrorCode.BAD_ORDER, f"a {kind} needs a prompt first", "type", round=r)
        return self.gen

    def _on_tree(self, msg: Tree, size: int) -> list[ServerEvent]:
        """A tree frame of `size` bytes: verified at once, kept pending, stale or refused."""
        r = msg.round
        gen = self._round_of(r, "tree")
        if gen is None:
            return []
        self._check_tree(msg.tree, gen.prompt.mode, "tree", r)
        if gen.cancelled:
            self._send(Stale(r, "cancelled"))
            return []
        now = self._usable(gen, msg.tree) if gen.in_flight is None else None
        if now is not None:
            gen.in_flight = r
            return [VerifyTree(r, now)]
        if not self._alive(gen, msg.tree, growing=gen.in_flight is not None):
            self._send(Stale(r, "mismatch"))
            return []
        if len(gen.pending) + (gen.stream_wait is not None) >= self.limits.max_pending:
            raise ProtocolError(
                ErrorCode.TOO_MANY_PENDING,
                f"already {len(gen.pending)} pending trees (max_pending {self.limits.max_pending})",
                "round",
                round=r,
            )
        held, budget = sum(gen.pending_bytes.values()), self.limits.max_pending_bytes
        if budget is not None and held + size > budget:
            raise ProtocolError(
                ErrorCode.TOO_MANY_PENDING,
                f"this {size}-byte tree would make the pending trees {held + size} bytes, over "
                f"max_pending_bytes {budget}",
                "round",
                round=r,
            )
        gen.pending[r] = msg.tree
        gen.pending_bytes[r] = size
        return []

    def _on_stream(self, msg: Stream) -> list[ServerEvent]:
        """A stream round: started at once when nothing is in flight, else the one waiting for a
        miss (a later one replaces it)."""
        r = msg.round
        gen = self._round_of(r, "stream")
        if gen is None:
            return []
        if gen.prompt.mode is Mode.AR:
            raise ProtocolError(ErrorCode.BAD_ORDER, "mode ar takes no streams: it streams", "type", round=r)
        if gen.cancelled:
            self._send(Stale(r, "cancelled"))
            return []
        if gen.in_flight is None:
            gen.in_flight, gen.streaming, gen.stream_left = r, r, msg.k - 1
            return [VerifyTree(r, None)]
        if gen.stream_wait is not None:
            self._send(Stale(gen.stream_wait[0], "superseded"))
        elif len(gen.pending) >= self.limits.max_pending:
            raise ProtocolError(
                ErrorCode.TOO_MANY_PENDING,
                f"already {len(gen.pending)} pending trees (max_pending {self.limits.max_pending})",
                "round",
                round=r,
            )
        gen.stream_wait = (r, msg.k)
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
