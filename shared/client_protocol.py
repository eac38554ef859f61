"""The session protocol's client side, sans I/O (shared/protocol.py has the rules): checks the
server's frames against what the client sent and tracks the committed sequence it reports, and
which round the server is verifying (the edge's one in-flight marker)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from shared.errors import ErrorCode, ProtocolError
from shared.messages import (
    DEFAULT_WIRE_LIMITS,
    Cancel,
    Close,
    Error,
    FrameStats,
    Hello,
    Message,
    Mode,
    Prompt,
    Stale,
    Stream,
    Tree,
    Verdict,
    Welcome,
    WireLimits,
    decode,
    encode,
)
from shared.tree import TokenTree
from shared.tree_match import reroot, tree_matches

# ---------------------------------------------------------------------------------------------------
# Client side


class ClientState(enum.Enum):
    START = "start"
    AWAIT_WELCOME = "await_welcome"
    IDLE = "idle"
    GENERATING = "generating"
    CANCELLING = "cancelling"
    CLOSED = "closed"


@dataclass(frozen=True)
class Snapshot:
    """The committed sequence and whether a generation runs, as of the frames decoded so far: an
    immutable value the protocol replaces (never mutates), so another thread (the edge's drafting
    thread, checking whether a verdict ruled its draft out) reads a consistent one."""

    committed: tuple[int, ...] = ()
    generating: bool = False


class ClientProtocol:
    """One connection, client side: checks the server's frames against what the client sent.

    `committed` is the committed sequence as the server reported it (prompt + accepted tokens).

    `in_flight` is the round the server is verifying as far as the client knows: the prompt's
    (0), a tree sent while none was in flight that matches `committed`, a verdict's `next_round`,
    or, when a verdict names none, the latest outstanding tree that matches the new committed
    sequence (`matching_outstanding`: still on its way, the server verifies it on arrival).
    A frame moves it when it is acknowledged: at once by `receive`, or, for a reader that decodes
    ahead of the code acting on the frames (the edge's pump and its speculation core),
    `receive(data, acknowledge=False)` and later `acknowledge(msg)`, in order. The committed
    sequence, the outstanding rounds and the state always follow the frames decoded, and so does
    `snapshot` (an immutable copy of the committed sequence and whether a generation runs).
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
        self.in_flight: int | None = None  # the round the server is verifying (class docstring)
        self._trees: dict[int, TokenTree] = {}  # the trees of the outstanding rounds
        self._streams: set[int] = set()  # the outstanding rounds that are streams (0: the prompt's)
        self.streaming: int | None = None  # the stream round whose verdicts are coming, one a token
        self._named: int | None = None  # the round the last verdict named as verified next
        self._prompt_tree: TokenTree | None = None  # the tree the prompt carried (round 0)
        self._max_new_tokens = 0  # of the generation running
        self._generated = 0  # tokens the verdicts of the generation running committed
        self.stats = FrameStats()
        self._context: list[int] = []
        self.snapshot = Snapshot()

    def _publish(self) -> None:
        """Replace `snapshot` after the committed sequence or the state changed."""
        self.snapshot = Snapshot(tuple(self.committed), self.state is ClientState.GENERATING)

    @property
    def context(self) -> list[int]:
        """The session's context after its last generation (what a `continue` prompt extends)."""
        return list(self._context)

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
        self._prompt_tree = msg.tree
        self._streams = {0} if msg.stream else set()
        self.streaming = None
        self._max_new_tokens = msg.max_new_tokens
        self._generated = 0
        self.in_flight = 0
        self.state = ClientState.GENERATING
        self._publish()
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
        self._trees[msg.round] = msg.tree
        if self.in_flight is None and self.usable(msg.tree) is not None:
            self.in_flight = msg.round
        return frame

    def usable(self, tree: TokenTree) -> TokenTree | None:
        """What the server verifies for `tree` against the committed sequence: the tree when it
        matches; in greedy and match also its re-rooted subtree (shared.tree_match.reroot); else None."""
        if self.mode in (Mode.GREEDY, Mode.MATCH):
            rooted = reroot(tree, self.committed)
            return None if rooted is None else rooted[0]
        return tree if tree_matches(tree, self.committed) else None

    def stream(self, msg: Stream) -> bytes:
        """A stream round (PROTOCOL.md `stream`): in flight at once when nothing is, else it waits
        at the server for a miss (replacing a waiting one, which the server answers stale)."""
        self._require(ClientState.GENERATING)
        if self.mode is Mode.AR:
            raise ProtocolError(ErrorCode.BAD_ORDER, "mode ar takes no streams", "round")
        if msg.round <= self.last_round:
            raise ProtocolError(
                ErrorCode.BAD_ORDER, f"round {msg.round} is not after {self.last_round}", "round"
            )
        frame = self._send(msg)
        self.last_round = msg.round
        self.outstanding.add(msg.round)
        self._streams.add(msg.round)
        if self.in_flight is None:
            self.in_flight = msg.round
        return frame

    def is_stream(self, rnd: int | None) -> bool:
        """Round `rnd` is a stream round (0: the prompt's, when it streams)."""
        return rnd is not None and rnd in self._streams

    def waiting_stream(self) -> int | None:
        """The outstanding stream round not yet started (the server's fallback for a miss)."""
        waiting = [r for r in self._streams if r in self.outstanding and r != self.streaming]
        return max(waiting) if waiting else None

    def cancel(self) -> bytes:
        self._require(ClientState.GENERATING)
        frame = self._send(Cancel())
        self.state = ClientState.CANCELLING
        self._publish()
        return frame

    def close(self, reason: str | None = None) -> bytes:
        frame = self._send(Close(reason))
        self.state = ClientState.CLOSED
        self._publish()
        return frame

    # -- incoming
    def receive(self, data: bytes, *, acknowledge: bool = True) -> Message:
        """Decode and check one server frame; raises ProtocolError if the server broke the protocol.

        acknowledge=False: `in_flight` waits for `acknowledge(msg)` (see the class docstring)."""
        self.stats.inc(len(data))
        try:
            msg = self._apply(decode(data, self.wire))
        finally:
            self._publish()
        if acknowledge:
            self.acknowledge(msg)
        return msg

    def acknowledge(self, msg: Message) -> None:
        """Move `in_flight` past a frame `receive` decoded (call once per frame, in order)."""
        if isinstance(msg, Verdict):
            nxt = msg.next_round
            if msg.streaming:
                nxt = msg.round
            elif nxt is None and not msg.done:
                nxt = self.matching_outstanding()
            self.in_flight = None if msg.done else 0 if self.mode is Mode.AR else nxt
        elif isinstance(msg, Stale):
            if msg.round == self.in_flight:
                self.in_flight = None
        elif isinstance(msg, Error) and not msg.fatal and msg.round is not None:
            if msg.code is ErrorCode.BUSY or msg.round == self.in_flight:
                self.in_flight = None

    def matching_outstanding(self) -> int | None:
        """The latest outstanding tree that matches `committed` (shared.tree_match.tree_matches)."""
        found = [r for r in self.outstanding if r in self._trees and self.usable(self._trees[r]) is not None]
        return max(found) if found else None

    def _apply(self, msg: Message) -> Message:
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
            self._settle(msg.round)
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
            self._trees.clear()
            self._streams.clear()
            self.streaming = None
            self.state = ClientState.IDLE
        elif e.round == 0 and self.awaiting_prompt:
            self.awaiting_prompt = False
            self.state = ClientState.IDLE
        elif e.round is not None:
            self._settle(e.round)

    def _settle(self, rnd: int) -> None:
        """Round `rnd` was answered (verdict, stale or error): no longer outstanding."""
        self.outstanding.discard(rnd)
        self._trees.pop(rnd, None)
        self._streams.discard(rnd)

    def _on_verdict(self, v: Verdict) -> None:
        """Check a verdict against what the client sent before anything of it is committed: a
        verifier that breaks the protocol must not leave a token in the client's output."""
        self._require(ClientState.GENERATING, ClientState.CANCELLING)
        tree: TokenTree | None = None
        stream = v.round in self._streams and (v.round == 0 or v.round in self.outstanding)
        if v.streaming and (v.done or not stream):
            why = "a verdict that ends the generation" if v.done else f"round {v.round}, not a stream"
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"streaming on {why}", "streaming")
        if stream and (len(v.accepted_nodes) or (len(v.tokens) != 1 and not v.done)):
            raise ProtocolError(
                ErrorCode.BAD_MESSAGE, "a stream's verdict holds one token and no nodes", "tokens"
            )
        if v.round != 0 and v.round == self.streaming:
            pass  # the next token of the stream in progress
        elif v.round == 0:
            legal = self.awaiting_prompt or self.mode is Mode.AR or self.state is ClientState.CANCELLING
            if not legal:
                raise ProtocolError(ErrorCode.BAD_ORDER, "unexpected round-0 verdict", "round")
            if self.awaiting_prompt:
                tree = self._prompt_tree
        else:
            # a waiting stream starts after later trees (the fallback for a miss): rounds of trees
            # are verified in order, a stream whenever a miss needs it
            # a pending tree that re-roots may be verified after a later one: the verdict before
            # it names it (next_round)
            late = v.round <= self.last_verdict_round and not stream and v.round != self._named
            if v.round not in self.outstanding or late:
                raise ProtocolError(
                    ErrorCode.BAD_ORDER, f"verdict for round {v.round} not outstanding", "round"
                )
            tree = self._trees.get(v.round)
            if tree is not None and (tree := self.usable(tree)) is None:
                raise ProtocolError(
                    ErrorCode.BAD_ORDER,
                    f"verdict for round {v.round}, whose tree does not match the committed sequence",
                    "round",
                )
        self._check_tokens(v, tree)
        if v.committed_len != len(self.committed) + len(v.tokens):
            raise ProtocolError(
                ErrorCode.BAD_MESSAGE,
                f"committed_len {v.committed_len} but the client holds "
                f"{len(self.committed) + len(v.tokens)} tokens",
                "committed_len",
            )
        if v.next_round is not None and (v.next_round not in self.outstanding or v.next_round == v.round):
            raise ProtocolError(
                ErrorCode.BAD_ORDER, f"next_round {v.next_round} was never sent", "next_round"
            )
        # the verdict is consistent with what was sent: commit it
        self.streaming = v.round if v.streaming else None
        self._named = v.next_round
        if v.streaming:
            pass  # the round goes on
        elif v.round == 0:
            self.awaiting_prompt = False
            self._streams.discard(0)
        else:
            self._settle(v.round)
            self.last_verdict_round = max(self.last_verdict_round, v.round)
        self.committed.extend(int(t) for t in v.tokens)
        self._generated += len(v.tokens)
        if v.done:
            self._context = list(self.committed)
            self.state = ClientState.IDLE

    def _check_tokens(self, v: Verdict, tree: TokenTree | None) -> None:
        """The verdict's tokens are in the vocabulary and within max_new_tokens, and its accepted
        nodes are a root-to-leaf path of `tree` (the tree the round sent; None: no tree) whose tokens
        start the verdict's, the bonus after them."""
        tokens = v.tokens.astype(np.int64)
        w = self.welcome_msg
        if w is not None and tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= w.vocab_size):
            raise ProtocolError(
                ErrorCode.OUT_OF_RANGE,
                f"a token id outside the vocabulary [0, {w.vocab_size}): {tokens.tolist()[:16]}",
                "tokens",
            )
        room = self._max_new_tokens - self._generated
        if len(tokens) > room:
            raise ProtocolError(
                ErrorCode.LIMIT_EXCEEDED,
                f"{len(tokens)} tokens but max_new_tokens {self._max_new_tokens} leaves room for {room}",
                "tokens",
            )
        if not v.done and (len(tokens) == 0 or len(tokens) == room):
            why = "no token" if len(tokens) == 0 else "max_new_tokens reached"
            raise ProtocolError(ErrorCode.BAD_MESSAGE, f"a verdict with {why} must be done", "done")
        if w is not None and len(self.committed) + len(tokens) > w.limits.max_context:
            raise ProtocolError(
                ErrorCode.LIMIT_EXCEEDED,
                f"{len(tokens)} tokens take the context over max_context {w.limits.max_context}",
                "tokens",
            )
        acc = v.accepted_nodes.astype(np.int64)
        n = 0 if tree is None else tree.num_nodes
        if len(acc) and (int(acc.min()) < 0 or int(acc.max()) >= n):
            raise ProtocolError(
                ErrorCode.BAD_MESSAGE,
                f"accepted nodes {acc.tolist()[:16]} not in the tree of {n} nodes",
                "accepted_nodes",
            )
        if tree is not None:
            parent = -1
            for i in acc.tolist():
                if int(tree.parents[i]) != parent:
                    raise ProtocolError(
                        ErrorCode.BAD_MESSAGE,
                        "the accepted nodes are not a root-to-leaf path of the tree",
                        "accepted_nodes",
                    )
                parent = i
            if not np.array_equal(tokens[: len(acc)], tree.tokens[acc].astype(np.int64)):
                raise ProtocolError(
                    ErrorCode.BAD_MESSAGE, "the tokens are not the accepted nodes' tokens", "tokens"
                )
        if not len(acc) <= len(tokens) <= len(acc) + 1:
            raise ProtocolError(
                ErrorCode.BAD_MESSAGE,
                f"{len(tokens)} tokens for {len(acc)} accepted nodes (at most one bonus token)",
                "tokens",
            )
        if v.has_bonus != (len(tokens) == len(acc) + 1):
            raise ProtocolError(ErrorCode.BAD_MESSAGE, "has_bonus disagrees with the tokens", "has_bonus")
