"""One client connection on the server: the sans-I/O protocol, the engine and an outbox.

Frames in go through `ServerProtocol`; its events start generations and rounds in the engine. The
engine calls `on_result` on the event-loop thread after each step; the verdict goes through the
protocol, which may name a pending conditional tree to verify next, and that tree is submitted at
once, so it runs in the very next engine step with no round trip.

The gap of a round is the time from the session's previous verdict to its tree being submitted: ~0
for a pending tree started at once, the edge's drafting and the round trip after a miss. It goes to
`/metrics` (specdec_round_gap_seconds) and into the round's verdict (`gap_ms`, for a client that
asked for it in hello.features).

Every protocol decision lives in `shared.protocol` (through `ServerSession`). The WebSocket around
a session (origin and readiness checks, its reader and writer) is `cloud_verifier.ws_endpoint`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import numpy as np

from cloud_verifier.admission import Admission, AdmissionRefused, Ticket
from cloud_verifier.auth import AuthError, KeyStore, Principal
from cloud_verifier.engine import Engine
from cloud_verifier.metrics import Metrics
from cloud_verifier.resume import ParkedSessions
from cloud_verifier.step import RoundResult, SeqState
from shared.errors import CloseCode, ErrorCode, ProtocolError
from shared.messages import FEATURE_RESUME, Mode, SessionLimits, Verdict, Welcome
from shared.protocol import (
    CancelReceived,
    ClosedByPeer,
    ErrorSent,
    HelloReceived,
    PromptReceived,
    ServerProtocol,
    ServerState,
    VerifyTree,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelInfo:
    """What a welcome tells the client about the target."""

    model_id: str
    vocab_size: int
    vocab_fingerprint: str
    eos_ids: tuple[int, ...]
    verify_cost_ms: dict[int, float]


@dataclass(frozen=True)
class CloseRequest:
    code: int
    reason: str


# Outgoing frames a client may leave unread. Above OUTBOX_HIGH the session stops reading the
# client's frames and pauses its `ar` stream until the writer has drained to OUTBOX_LOW (TCP then
# pushes back on the client); OUTBOX_MAX is a safety net that should never be reached.
OUTBOX_HIGH = 64
OUTBOX_LOW = 16
OUTBOX_MAX = 1024


def _ignore(result: RoundResult) -> None:
    return None


class ServerSession:
    """Glue between one WebSocket, the protocol state machine and the engine."""

    def __init__(
        self,
        engine: Engine,
        info: ModelInfo,
        limits: SessionLimits,
        keys: KeyStore,
        metrics: Metrics,
        bearer: str | None = None,
        admission: Admission | None = None,
        parked: ParkedSessions | None = None,
        direct: str | None = None,
        offers: dict[str, ServerSession] | None = None,
    ) -> None:
        self.engine = engine
        self.parked = parked  # where a dropped session waits for its resume (resume.py)
        # this verifier's own address (a fleet replica's), offered in the welcome to a client that
        # asked (session.direct); `offers` holds the sessions offered it, by resume token, until
        # their first prompt: a connection to that address may take the session over (direct.py)
        self.direct = direct
        self.offers = offers
        self.credential = ""  # the API key or bearer token the session was opened with
        self.moved = asyncio.Event()  # set when another connection took the session over
        self.done = asyncio.Event()  # set when the connection holding the session let it go
        self.writer: asyncio.Task[None] | None = None  # the task putting the outbox on its socket
        self.resume_token: str | None = None  # this session's (its welcome's `resume`)
        self._donor: SeqState | None = None  # the parked sequence a resume claimed, until its prompt
        self.info = info
        self.keys = keys
        self.metrics = metrics
        self.bearer = bearer
        self.proto = ServerProtocol(vocab_size=info.vocab_size, limits=limits)
        self.admission = admission
        self.ticket: Ticket | None = None
        self.outbox: asyncio.Queue[bytes | CloseRequest] = asyncio.Queue()
        self.writable = asyncio.Event()  # set while the outbox is below OUTBOX_HIGH
        self.writable.set()
        self.seq: SeqState | None = None
        self.principal: Principal | None = None
        self.last_activity = time.monotonic()
        self.closed = False
        self._stale_seen = 0
        self._ar_paused = False
        self._stream_round = 0  # the round of the ar or stream token queued next (0: ar's)
        self._gen_start = 0.0  # the generation in progress: start, time to its first token, tokens
        self._gen_first: float | None = None
        self._gen_tokens = 0
        self._reserved = 0  # tokens per minute held for the generation in progress, not yet used
        self._verdict_at: float | None = None  # when the last verdict of this generation was sent
        self._gap: tuple[int, float] | None = None  # (round, its gap in ms) of the round submitted

    @property
    def generating(self) -> bool:
        return self.proto.state is ServerState.GENERATING

    @property
    def sid(self) -> int | None:
        """The session id of the welcome (None before it)."""
        return self.seq.sid if self.seq is not None else None

    @property
    def admitted(self) -> bool:
        """Welcomed: authenticated and holding a session slot and an engine sequence."""
        return self.seq is not None

    @property
    def pending_trees(self) -> int:
        """Conditional trees waiting for the outcome they assume."""
        gen = self.proto.gen
        return len(gen.pending) if gen is not None else 0

    @property
    def working(self) -> bool:
        """The engine holds a round of this session (queued or in a step): not idle."""
        return self.seq is not None and self.seq.working

    # ------------------------------------------------------------------ frames in
    def receive(self, data: bytes) -> None:
        self.last_activity = time.monotonic()
        for ev in self.proto.receive(data):
            try:
                self._handle(ev)
            except ProtocolError as exc:
                self._error(self.proto.fail(exc))
        self._flush()

    def _reserve(self, ev: PromptReceived) -> bool:
        """Hold the generation's whole cost against the key's tokens per minute, prompt (the
        prefill counts) + max_new_tokens, as an HTTP request does; what it does not generate is
        given back when it ends. False (and the error sent) when the key cannot pay for it."""
        assert self.admission is not None and self.principal is not None
        self._settle_reservation()
        who, prompt = self.principal, ev.prompt
        room = max(0, self.engine.config.max_context - len(ev.committed))
        cost = len(prompt.tokens) + min(prompt.max_new_tokens, room)
        err: ProtocolError | None = None
        if who.tokens_per_min is not None and cost > who.tokens_per_min:
            err = ProtocolError(
                ErrorCode.LIMIT_EXCEEDED,
                f"{len(prompt.tokens)} prompt tokens + max_new_tokens {min(prompt.max_new_tokens, room)} "
                f"is more than this key's {who.tokens_per_min} tokens per minute: ask for fewer",
                "max_new_tokens",
                round=0,
            )
        else:
            try:
                self.admission.check_tokens(who, cost)
            except AdmissionRefused as exc:
                msg = f"{exc.reason}; retry in {exc.retry_after_s} s"
                err = ProtocolError(ErrorCode.RATE_LIMITED, msg, round=0)
        if err is not None:
            self._error(self.proto.abort(err))
            return False
        self.admission.spend(who, cost)
        self._reserved = cost - len(prompt.tokens)
        return True

    def _settle_reservation(self) -> None:
        """Give back the reserved tokens the last generation did not use."""
        if self._reserved and self.admission is not None and self.principal is not None:
            self.admission.refund(self.principal, self._reserved)
        self._reserved = 0

    def _handle(self, ev: object) -> None:
        if isinstance(ev, HelloReceived):
            self._on_hello(ev)
        elif isinstance(ev, PromptReceived):
            assert self.seq is not None and self.principal is not None
            if self.admission is not None and not self._reserve(ev):
                return
            self._gen_start, self._gen_first, self._gen_tokens = time.perf_counter(), None, 0
            log.info(
                "generation started",
                extra={"session": self.sid, "mode": ev.prompt.mode.value, "prompt_tokens": len(ev.committed)},
            )
            self._verdict_at, self._gap = None, None
            self._withdraw()
            self._adopt()
            assert self.seq is not None
            self.engine.start(self.seq, ev.prompt, ev.committed)
            self.proto.share_committed(self.seq.committed)  # the engine's list is the one sequence
        elif isinstance(ev, VerifyTree):
            assert self.seq is not None
            self._submit(ev)
        elif isinstance(ev, CancelReceived):
            # the protocol ends the generation at the in-flight round's verdict, or already did
            if not ev.in_flight and self.seq is not None:
                self.engine.end(self.seq)
                self._settle_reservation()
        elif isinstance(ev, ClosedByPeer):
            self.close(CloseCode.NORMAL, "client closed")
        elif isinstance(ev, ErrorSent):
            self._error(ev)

    def _submit(self, ev: VerifyTree) -> None:
        """Hand a tree round to the engine, noting its gap (the wait since the last verdict)."""
        assert self.seq is not None
        if self._verdict_at is not None:
            gap_s = max(0.0, time.perf_counter() - self._verdict_at)
            self.metrics.round_gap_seconds.observe(gap_s)
            self._gap = (ev.round, gap_s * 1e3)
        self.engine.submit(self.seq, ev.round, ev.tree)

    def _gap_ms(self, round_: int) -> float | None:
        """The gap before round `round_` (None: round 0, not measured, or a stream round's verdicts
        after its first): read once."""
        gap = self._gap
        if gap is None or gap[0] != round_ or round_ == 0:
            return None
        self._gap = None
        return gap[1]

    def _cost_curve(self) -> dict[int, float]:
        """The welcome's verify cost curve: the live one (live_cost.py), else the start-up one."""
        live = self.engine.live_cost
        return live.curve() if live is not None else self.info.verify_cost_ms

    def _cost_maps(self) -> tuple[dict[int, float] | None, dict[int, float] | None]:
        """A verdict's forward_ms and marginal_ms (filled always; the protocol sends them only to a
        client that asked, hello.features verdict.cost_ms): this session's next round with N nodes
        beside the rows the engine expects from the other sessions (`Engine.other_rows`: each other
        running generation's last round again)."""
        live = self.engine.live_cost
        if live is None or self.seq is None:
            return None, None
        return live.verdict_maps(self.engine.other_rows(self.seq.sid))

    def _on_hello(self, ev: HelloReceived) -> None:
        hello = ev.hello
        if hello.vocab_fingerprint != self.info.vocab_fingerprint:
            raise ProtocolError(
                ErrorCode.VOCAB_MISMATCH,
                f"the draft vocabulary (fingerprint {hello.vocab_fingerprint[:12]}...) is not the target's "
                f"({self.info.vocab_fingerprint[:12]}..., model {self.info.model_id}); "
                "use a draft model with the target's tokenizer",
                "vocab_fingerprint",
                fatal=True,
            )
        self.credential = hello.api_key or self.bearer or ""
        try:
            self.principal = self.keys.authenticate(hello.api_key or self.bearer)
        except AuthError as exc:
            raise ProtocolError(ErrorCode.UNAUTHORIZED, str(exc), "api_key", fatal=True) from exc
        if self.admission is not None:
            try:
                self.ticket = self.admission.try_acquire(self.principal)
            except AdmissionRefused as exc:
                self.metrics.rejected_sessions.inc()
                self.close(
                    CloseCode.TRY_AGAIN_LATER, f"try again later ({exc.retry_after_s} s): {exc.reason}"
                )
                return
        self.seq = self.engine.open(self._on_result)
        log.info("session welcomed", extra={"session": self.seq.sid, "principal": self.principal.name})
        if self.parked is not None and FEATURE_RESUME in self.proto.features:
            if hello.resume is not None:
                self._donor = self.parked.claim(hello.resume, self.principal.name)
                if self._donor is None:
                    self.metrics.resumes.labels(kv="gone").inc()
            self.resume_token = self.parked.new_token()
        self.proto.welcome(
            Welcome(
                session_id=f"{self.seq.sid}",
                model_id=self.info.model_id,
                vocab_size=self.info.vocab_size,
                eos_ids=self.info.eos_ids,
                allowed_modes=self.principal.allowed_modes,
                limits=self.proto.limits,
                verify_cost_ms=self._cost_curve(),
                vocab_fingerprint=self.info.vocab_fingerprint,
                resume=self.resume_token,
                direct=self.direct,
            )
        )
        welcomed = self.proto.welcomed
        if welcomed is not None and welcomed.direct and welcomed.resume and self.offers is not None:
            self.offers[welcomed.resume] = self

    def _withdraw(self) -> None:
        """No connection may take this session over any more (its first prompt came, or it ends)."""
        if self.offers is not None and self.resume_token is not None:
            if self.offers.get(self.resume_token) is self:
                del self.offers[self.resume_token]

    def _adopt(self) -> None:
        """A resumed session's first prompt: take over the parked sequence it claimed if that is
        idle (its KV cache then serves the prompt's common prefix), else free it and prefill."""
        donor, self._donor = self._donor, None
        if donor is None or self.seq is None:
            return
        if donor.working or donor.sid not in self.engine.seqs:  # its last round still runs
            self.engine.close(donor)
            self.metrics.resumes.labels(kv="busy").inc()
            return
        if self.engine.kv.cached_len(donor.sid) == 0:  # its cache was reclaimed for other rounds
            self.engine.close(donor)
            self.metrics.resumes.labels(kv="gone").inc()
            return
        fresh, self.seq = self.seq, donor
        fresh.on_result = _ignore
        donor.on_result = self._on_result
        self.engine.close(fresh)
        self.metrics.resumes.labels(kv="reused").inc()
        log.info("session resumed on its KV cache", extra={"session": donor.sid})

    def park(self) -> bool:
        """The connection dropped: end the generation (as a cancel does) and keep the engine's
        sequence for a resume under this session's token; then close as `close` does. False (and
        nothing done) when there is nothing to keep."""
        if self.closed or self.seq is None or self.resume_token is None or self.parked is None:
            return False
        assert self.principal is not None
        seq, self.seq = self.seq, None
        self.engine.end(seq)
        seq.on_result = _ignore
        if self._donor is not None:  # claimed and never used: nobody will resume it now
            self.engine.close(self._donor)
            self._donor = None
        self.parked.park(self.resume_token, seq, self.engine, self.principal.name)
        self.close(CloseCode.GOING_AWAY, "connection dropped: kept for a resume")
        return True

    def _error(self, ev: ErrorSent) -> None:
        self.metrics.errors.labels(code=ev.error.code.value).inc()
        log.info(
            "error sent: %s",
            ev.error.message[:200],
            extra={"session": self.sid, "code": ev.error.code.value, "round": ev.error.round},
        )
        if ev.error.fatal:
            self.close(ev.close_code, ev.error.message[:120])

    # ------------------------------------------------------------------ engine results
    def _on_result(self, r: RoundResult) -> None:
        if self.closed or self.seq is None:
            return
        self.last_activity = time.monotonic()
        m = self.metrics
        if r.error is not None:
            # the round failed (BUSY: no KV room; INTERNAL): the generation ends with the error alone
            self._settle_reservation()
            self._error(self.proto.abort(r.error))
            self._flush()
            return
        if r.tree_nodes:
            m.record_round(r.tree_nodes, r.accepted_depths)
        m.emitted_tokens.inc(len(r.tokens))
        self._reserved = max(0, self._reserved - len(r.tokens))  # paid for when it was reserved
        if self._gen_first is None:
            self._gen_first = time.perf_counter() - self._gen_start
        self._gen_tokens += len(r.tokens)
        if r.done:
            m.record_generation(self._gen_first, self._gen_tokens, time.perf_counter() - self._gen_start)
            log.info(
                "generation ended",
                extra={"session": self.sid, "tokens": self._gen_tokens, "reason": r.reason},
            )
        m.round_seconds.observe(r.round_s)
        forward_ms, marginal_ms = self._cost_maps()
        nxt = self.proto.verdict(
            Verdict(
                round=r.round,
                tokens=np.asarray(r.tokens, dtype=np.int32),
                accepted_nodes=np.asarray(r.accepted_nodes, dtype=np.int32),
                has_bonus=r.has_bonus,
                committed_len=r.committed_len,
                verify_ms=r.verify_ms,
                done=r.done,
                reason=r.reason,
                gap_ms=self._gap_ms(r.round),
                forward_ms=forward_ms,
                marginal_ms=marginal_ms,
            )
        )
        self._verdict_at = time.perf_counter() if self.generating else None
        if not self.generating:  # done, or the in-flight round of a cancelled generation
            self._settle_reservation()
        if nxt is not None and nxt.continues:  # a stream round's next token
            self._stream_round = nxt.round
            self._next_token()
        elif nxt is not None:
            if nxt.tree is not None:
                m.cond_hits.inc()
            self._submit(nxt)
        elif self.generating and self.seq.mode is Mode.AR:
            self._stream_round = 0
            self._next_token()
        self._flush()

    def _next_token(self) -> None:
        """Queue the next token of an `ar` generation or a stream round (`_stream_round`), or, while
        the client is not reading, pause until the writer has drained (sent())."""
        assert self.seq is not None
        if self.writable.is_set():
            self.engine.submit(self.seq, self._stream_round, None)
        else:
            self._ar_paused = True

    def sent(self) -> None:
        """The writer put one frame on the socket."""
        if self.outbox.qsize() <= OUTBOX_LOW and not self.writable.is_set():
            self.writable.set()
            if self._ar_paused and not self.closed and self.generating and self.seq is not None:
                self._ar_paused = False
                self.engine.submit(self.seq, self._stream_round, None)

    # ------------------------------------------------------------------ frames out
    def _flush(self) -> None:
        stale = self.proto.stats.frames_by_type_out.get("stale", 0)
        if stale > self._stale_seen:
            self.metrics.cond_stale.inc(stale - self._stale_seen)
            self._stale_seen = stale
        for frame in self.proto.data_to_send():
            self._put(frame)

    def _put(self, frame: bytes) -> None:
        if self.closed:
            return
        self.outbox.put_nowait(frame)
        if self.outbox.qsize() >= OUTBOX_HIGH:
            self.writable.clear()
        if self.outbox.qsize() >= OUTBOX_MAX:
            self.close(CloseCode.POLICY_VIOLATION, f"the client left {OUTBOX_MAX} replies unread")

    def close(self, code: int, reason: str) -> None:
        """Stop the session: free its KV now (or after its step) and ask the writer to close."""
        if self.closed:
            return
        self._flush()  # frames already produced (e.g. the fatal error) go out before the close
        self.closed = True
        self._withdraw()
        log.info("session closed (%d): %s", code, reason, extra={"session": self.sid, "code": code})
        self.writable.set()  # a reader waiting for the writer must see the close
        self._settle_reservation()
        if self.ticket is not None and self.admission is not None:
            self.admission.release(self.ticket)
            self.ticket = None
        if self._donor is not None:
            self.engine.close(self._donor)
            self._donor = None
        if self.seq is not None:
            self.engine.close(self.seq)
            # the engine's sequence pointed back at this session (on_result): break the cycle so
            # a closed session is freed at once, not at the next run of the cycle collector
            self.seq.on_result = _ignore
        self.outbox.put_nowait(CloseRequest(int(code), reason))
