"""The edge client: drafting and streaming text on a session with the verifier, a sync wrapper.

    async with EdgeClient("ws://127.0.0.1:8000/v1/session", drafter, prespec=True) as client:
        async for chunk in client.generate("Why is the sky blue?", max_new_tokens=64):
            print(chunk, end="")
        print(client.last.stats.as_dict())

EdgeClient's settings are an EdgeConfig, a generation's sampling a SamplingOptions
(edge_client.client_config); both also take their fields as keyword arguments, as above.

Each round the drafter (on its own thread, off the event loop) builds a token tree below the
committed sequence; the verifier answers with the accepted path plus its bonus token. The text is
exactly what the target alone would produce. With `prespec` the edge drafts conditional trees for
the likely outcomes while a round is in flight: edge_client.speculation holds that logic
without I/O (SpeculationCore) and the asyncio shell that runs it (RoundExecutor); this module is
drafting, streaming and text; edge_client.session the connection and resuming (the client holds a
Session and delegates the connection's methods to it); edge_client.generation_state one generation's
state.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from typing import Any, Self

import numpy as np

from edge_client.client_config import ConfiguredSession, EdgeConfig, SamplingOptions, with_keywords
from edge_client.drafters.base import Drafter
from edge_client.generation_state import DropCount, GenerationOutput, RunningGeneration, check_not_abandoned
from edge_client.session import (
    RESUMABLE_CLOSES,
    ConnectionLost,
    GenerationError,
    ProtocolViolation,
    ResumeConfig,
    Session,
    Timeouts,
    VerifierTimeout,
)
from edge_client.speculation import (
    DrafterProfile,
    DraftStep,
    Learned,
    PrespecConfig,
    Refused,
    Request,
    RoundExecutor,
    SpeculationCore,
    TreeSpec,
)
from edge_client.speculation.auto import Plan
from edge_client.stats import GenerationResult, GenerationStats, RoundTrace
from edge_client.tokenizer import ChatMessage, EdgeTokenizer, IncrementalDetokenizer, as_messages
from edge_client.trees import Coupling, Sampling
from shared.errors import ErrorCode, ProtocolError
from shared.messages import Mode, Prompt, Verdict, Welcome
from shared.protocol import ClientProtocol, ClientState

__all__ = [
    "RESUMABLE_CLOSES",
    "ConnectionLost",
    "EdgeClient",
    "EdgeConfig",
    "GenerationError",
    "GenerationResult",
    "GenerationStats",
    "PrespecConfig",
    "ProtocolViolation",
    "ResumeConfig",
    "SamplingOptions",
    "SyncEdgeClient",
    "Timeouts",
    "TreeSpec",
    "VerifierTimeout",
]


class EdgeClient:
    """An async client of the verifier (see the module docstring): it holds a session with the
    verifier (`session`, edge_client.session.Session) and drafts, streams and detokenizes on it.

    server:    a URL, or several (replicas with no shared state): a dropped connection fails over
               to the next
    drafter:   the draft model; None only for mode "ar" (then `tokenizer` is required). Several
               (a sequence): each drafts its own tree every round and the trees are merged into one
               (SpecInfer Definition 3.2, edge_client.trees.merged); they must share one vocabulary
    config:    the settings but sampling (edge_client.client_config.EdgeConfig); its fields may also
               be keyword arguments (`EdgeClient(url, drafter, prespec=True)`), replacing the config's
    """

    def __init__(
        self,
        server: str | Sequence[str],
        drafter: Drafter | Sequence[Drafter] | None,
        config: EdgeConfig | None = None,
        *,
        tokenizer: EdgeTokenizer | None = None,
        **settings: Any,
    ) -> None:
        self.config = with_keywords(config or EdgeConfig(), settings, "EdgeClient()")
        self.drafters: tuple[Drafter, ...] = (
            () if drafter is None else tuple(drafter) if isinstance(drafter, Sequence) else (drafter,)
        )
        self.drafter: Drafter | None = self.drafters[0] if self.drafters else None
        self._check_vocabularies()
        tok = tokenizer or (self.drafter.tokenizer if self.drafter is not None else None)
        if tok is None:
            raise ValueError("EdgeClient needs a drafter or a tokenizer")
        self.tokenizer: EdgeTokenizer = tok
        self.session: Session = ConfiguredSession(server, self.vocab_fingerprint, self.config)
        trees = self.config.trees
        if len(trees) not in (1, max(1, len(self.drafters))):
            raise ValueError(
                f"{len(self.drafters)} drafters but {len(trees)} tree shapes: give one, or one per drafter"
            )
        self.trees: tuple[TreeSpec, ...] = tuple(t or TreeSpec() for t in trees)
        self.tree = self.trees[0]
        self.prespec: PrespecConfig | None = self.config.prespec_config
        # llama.cpp contexts are single-threaded: one drafting thread, off the event loop
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="drafter")
        self.parallel: concurrent.futures.ThreadPoolExecutor | None = None
        if self.config.parallel_drafters and len(self.drafters) > 1:
            n = len(self.drafters) - 1  # the first drafter stays on the drafting thread
            self.parallel = concurrent.futures.ThreadPoolExecutor(n, thread_name_prefix="drafter-more")
        # calibration, outcome models, round trip, last tree: learned across generations
        self.learned = Learned()
        self.last: GenerationResult | None = None
        self._running: RunningGeneration | None = None  # the generation on the session, if one is open
        self._gen_lock = asyncio.Lock()  # generations begin and end one at a time

    # ------------------------------------------------------------------ the session's, delegated
    @property
    def welcome(self) -> Welcome | None:
        """The verifier's welcome on the open session (None: not connected)."""
        return self.session.welcome

    @welcome.setter
    def welcome(self, welcome: Welcome | None) -> None:
        self.session.welcome = welcome

    @property
    def proto(self) -> ClientProtocol:
        """The session's protocol state (shared.protocol.ClientProtocol)."""
        return self.session.proto

    @property
    def server(self) -> str:
        """The verifier URL in use."""
        return self.session.server

    @property
    def servers(self) -> list[str]:
        return self.session.servers

    @property
    def resume(self) -> ResumeConfig | None:
        return self.session.resume

    @property
    def timeouts(self) -> Timeouts:
        return self.session.timeouts

    @property
    def resumes(self) -> list[float]:
        """Seconds each resume took (a drop to the new session's welcome)."""
        return self.session.resumes

    async def connect(self) -> Welcome:
        """Open the session (hello, the verifier's welcome); Session.connect."""
        return await self.session.connect()

    async def send(self, frame: bytes) -> None:
        await self.session.send(frame)

    async def recv(self) -> Any:
        return await self.session.recv()

    async def drop_connection(self) -> None:
        """Give the connection up; the next generation opens a new session (Session.drop_connection)."""
        await self.session.drop_connection()

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _check_vocabularies(self) -> None:
        """Merged trees need one vocabulary: every drafter's fingerprint must be the first's."""
        if len(self.drafters) < 2:
            return
        fp = self.drafters[0].vocab_fingerprint()
        for i, d in enumerate(self.drafters[1:], 1):
            if d.vocab_fingerprint() != fp:
                raise ValueError(
                    f"drafter {i} ({d.name}) has another vocabulary than drafter 0 "
                    f"({self.drafters[0].name}): trees can only be merged from drafters that share the "
                    "target's tokenizer; use draft models of the same family"
                )

    def vocab_fingerprint(self) -> str:
        return self.drafter.vocab_fingerprint() if self.drafter is not None else self.tokenizer.fingerprint

    async def close(self) -> None:
        """End a generation left open (cancelled at the verifier), close the session, stop drafting."""
        old = self._running
        if old is not None and old.at_yield:  # a generation left open: cancel it first
            self._running, old.abandoned = None, True
            await self._end(old, None)
        await self.session.close()
        self.pool.shutdown(wait=True)
        if self.parallel is not None:
            self.parallel.shutdown(wait=True)

    # ------------------------------------------------------------------ generation
    async def generate(
        self,
        prompt: str | Sequence[ChatMessage] | Sequence[int],
        sampling: SamplingOptions | None = None,
        *,
        mode: str | Mode = Mode.GREEDY,
        objective: str = "latency",
        raw: bool = False,
        tree: TreeSpec | None = None,
        continue_: bool = False,
        on_verdict: Callable[[Verdict, bool], None] | None = None,
        **options: Any,
    ) -> AsyncGenerator[str, None]:
        """Stream the target's text for `prompt` (text, chat messages, or token ids).

        `sampling` (edge_client.client_config.SamplingOptions: max_new_tokens, temperature, top_p,
        top_k, seed, stop, stop_ids) may also be given field by field as keyword arguments
        (`generate(prompt, temperature=0.7)`), which replace its fields. A plain prompt becomes one
        user turn of the model's chat template unless `raw`. Generation ends on an EOS id, a stop
        id, a stop string (cut from the text) or max_new_tokens; `continue_` adds the prompt as a
        new turn to the session's cached context. The GenerationResult is `self.last` (tokens,
        text, stats). `on_verdict(verdict, prespeculated)` sees every verdict before its text is
        yielded; prespeculated: its tree was already at the server when the previous verdict came
        (a pre-speculation hit, no round trip).

        Every failure is a GenerationError (ConnectionLost, ProtocolViolation, VerifierTimeout, a
        refusal); `self.last` keeps the tokens committed before it. Stopping early cancels the
        generation at the verifier. mode "auto" streams or speculates round by round for the
        `objective` ("latency" or "cost"), verified greedy (match at a temperature).
        """
        s = with_keywords(sampling or SamplingOptions(), options, "generate()")
        await self._settle()
        mode, req = self._planned(mode, objective, s, tree)
        prompt_tokens = self._encode(prompt, raw)
        out = self._begin(prompt_tokens, s.stop, on_verdict)
        msg = self._prompt(prompt_tokens, mode, s, continue_)
        running = self._running = RunningGeneration()
        failure: BaseException | None = None
        try:
            async with contextlib.aclosing(self._stream(req, msg, out, running, s.max_new_tokens)) as texts:
                async for text in texts:
                    yield text
        except ProtocolError as exc:  # a frame of this client's broke the protocol (e.g. over max_bytes)
            failure = exc
            raise GenerationError(f"the client could not go on: {exc}", exc.code, exc.field) from exc
        except BaseException as exc:
            failure = exc
            raise
        finally:
            if self._running is running:
                self._running = None
                await self._end(running, failure)
        self.session._lost_context = []  # the generation went on: no context left to send again
        out.finish(self.proto.stats.bytes_out, self.proto.stats.bytes_in)

    async def _stream(
        self,
        req: Request,
        msg: Prompt,
        out: GenerationOutput,
        running: RunningGeneration,
        max_new_tokens: int,
    ) -> AsyncGenerator[str, None]:
        """The new text of each verdict, the rounds run again from the committed tokens after a
        drop (while `resume` allows) and a refusal raised as a GenerationError."""
        drops = DropCount()
        while True:
            driver = running.driver = self._rounds(req, msg, out.gen.stats)
            try:
                async with contextlib.aclosing(self._texts(driver, msg, out, running)) as texts:
                    async for text in texts:
                        yield text
                return
            except Refused as exc:
                raise self.session.refused(exc.error) from None
            except ConnectionLost as exc:
                if self.resume is None or out.cut is not None:
                    raise
                resumed = await self._resume(msg, out.gen, drops, max_new_tokens, exc)
                if resumed is None:  # max_new_tokens already committed
                    return
                msg = resumed

    async def _texts(
        self, driver: RoundExecutor, msg: Prompt, out: GenerationOutput, running: RunningGeneration
    ) -> AsyncGenerator[str, None]:
        """One run of the rounds from `msg`: the text each verdict adds, past a stop string none."""
        verdicts = running.verdicts = driver.run(msg)
        async with contextlib.aclosing(verdicts):
            async for v in verdicts:
                text = out.push(v)
                if len(text) > out.emitted:
                    running.at_yield = True
                    yield text[out.emitted :]
                    running.at_yield = False
                    check_not_abandoned(running)
                    out.emitted = len(text)
                out.gen.text = text
                await self._after_text(v, out, driver)

    def _begin(
        self,
        prompt_tokens: list[int],
        stop: Sequence[str],
        on_verdict: Callable[[Verdict, bool], None] | None,
    ) -> GenerationOutput:
        """A new generation's record (`self.last`, traced if `trace`), its text and its clock."""
        gen = GenerationResult(prompt_tokens=list(prompt_tokens))
        self.last = gen
        if self.config.trace:
            gen.stats.trace = RoundTrace()
        detok = IncrementalDetokenizer(lambda t: self.tokenizer.token_bytes(t))
        up0, down0 = self.proto.stats.bytes_out, self.proto.stats.bytes_in
        return GenerationOutput(gen, detok, stop, on_verdict, up0, down0, time.perf_counter())

    def _prompt(self, prompt_tokens: list[int], mode: Mode, s: SamplingOptions, continue_: bool) -> Prompt:
        """The generation's Prompt message (greedy: at temperature 0); a continuation whose context
        was lost with a dropped session sends that context again, as a new prompt."""
        tokens = prompt_tokens
        lost = self.session._lost_context
        if continue_ and not self.proto.context and lost:
            # the session that held the context was dropped: send the context again
            tokens, continue_ = lost + prompt_tokens, False
        return Prompt(
            tokens=np.asarray(tokens, dtype=np.int32),
            mode=mode,
            temperature=0.0 if mode is Mode.GREEDY else s.temperature,
            top_k=s.top_k,
            top_p=s.top_p,
            seed=s.seed,
            max_new_tokens=s.max_new_tokens,
            stop_ids=tuple(int(t) for t in s.stop_ids),
            continue_=continue_,
        )

    async def _after_text(self, v: Verdict, out: GenerationOutput, driver: RoundExecutor) -> None:
        """After a verdict's text: on the last verdict record why the generation ended; once a stop
        string cut the text, stop the rounds and cancel the generation at the verifier."""
        if v.done:
            out.gen.reason = "stop_string" if out.cut is not None else v.reason
        elif out.cut is not None and not driver.cancelled:
            driver.cancel()
            if self.proto.state is ClientState.GENERATING:  # else its end is decoded
                await self.send(self.proto.cancel())

    async def _resume(
        self, msg: Prompt, gen: GenerationResult, drops: DropCount, max_new_tokens: int, exc: ConnectionLost
    ) -> Prompt | None:
        """The connection dropped: reconnect (with backoff after drops with no new token) and return
        the prompt that goes on from the committed tokens; None (the generation ends, reason
        "length") when max_new_tokens were already committed. ConnectionLost when the verifier keeps
        dropping with no new token."""
        assert self.resume is not None
        # resume: a new session, the whole committed sequence as its prompt (the keyed
        # sampler depends only on seed and position, so match goes on exactly too);
        # conditional trees in flight are gone and get drafted again
        committed = list(self.proto.committed)
        if len(gen.tokens) >= max_new_tokens:
            gen.reason = "length"
            return None
        # a verifier that drops every session before a new token: give up, with backoff
        stalls = drops.dropped(len(gen.tokens))
        if stalls > self.resume.attempts:
            raise ConnectionLost(
                f"the verifier dropped the connection {stalls} times in a row with no new "
                f"token ({len(gen.tokens)} committed): giving up; last: {exc}"
            ) from exc
        if stalls > 1:
            await asyncio.sleep(self.resume.delay(stalls - 1))
        await self.session._reconnect()
        gen.stats.resumes += 1
        return dataclasses.replace(
            msg,
            tokens=np.asarray(committed, dtype=np.int32),
            max_new_tokens=max_new_tokens - len(gen.tokens),
            continue_=False,
            tree=None,
        )

    async def _end(self, running: RunningGeneration, failure: BaseException | None) -> None:
        """A generation is over: if the verifier still generates (the consumer stopped early, the
        client failed), cancel it there; if the connection cannot be trusted any more (the verifier
        broke the protocol, timed out, closed), drop it: the next generate opens a new session."""
        async with self._gen_lock:
            if running.driver is not None:
                running.driver.cancel()  # drafts still running for it stop at their next check
            if running.verdicts is not None:
                with contextlib.suppress(RuntimeError):  # (already running: closed by its owner)
                    await running.verdicts.aclose()  # its frame pump stops reading
            broken = isinstance(failure, (ProtocolViolation, VerifierTimeout, ConnectionLost))
            if broken or self.session._transport is None or self.proto.state is ClientState.CLOSED:
                await self.drop_connection()
            elif self.proto.state is ClientState.GENERATING:
                try:
                    await asyncio.wait_for(self.send(self.proto.cancel()), self.timeouts.close_s)
                except (GenerationError, ProtocolError, TimeoutError):
                    await self.drop_connection()
            # the verdict that ends the cancelled generation is read by the next generate (_settle)

    async def _settle(self) -> None:
        """Before a generation: end one abandoned without being closed, read what a cancelled one
        still sends (up to its done verdict, Timeouts.cancel_s), and connect if needed."""
        async with self._gen_lock:
            old = self._running
            if old is not None:
                if not old.at_yield:
                    raise GenerationError(
                        "a generation is already running on this client: one at a time (use another "
                        "EdgeClient, or close the first generation)"
                    )
                self._running = None
                old.abandoned = True
        if old is not None:
            await self._end(old, None)
        async with self._gen_lock:
            if self.welcome is not None and self.proto.state is ClientState.CANCELLING:
                try:
                    async with asyncio.timeout(self.timeouts.cancel_s):
                        while self.proto.state is ClientState.CANCELLING:
                            self.proto.acknowledge(await self.recv())
                except TimeoutError:
                    await self.drop_connection()
                except GenerationError:
                    await self.drop_connection()
            if self.welcome is not None and self.proto.state is not ClientState.IDLE:
                await self.drop_connection()
            if self.welcome is None:
                await self.session.connect_when_room()

    def _rounds(self, req: Request, msg: Prompt, st: GenerationStats) -> RoundExecutor:
        """The speculation core of one generation and the shell that runs it on this session."""
        assert self.welcome is not None
        step: DraftStep | None = None
        profile: DrafterProfile | None = None
        if self.drafter is not None and req.mode is not Mode.AR:
            shapes = self.trees if len(self.trees) == len(self.drafters) else (req.tree,) * len(self.drafters)
            if req.mode.stochastic:  # draw counts must be fixed before drawing (see _request)
                shapes = tuple(TreeSpec("static", t.expansion) if t.kind == "budget" else t for t in shapes)
            costs = self.learned.drafter_costs(len(self.drafters))
            step = DraftStep(
                self.drafters, req, self.welcome.limits, (req.tree, *shapes[1:]), self.parallel, costs
            )
            profile = DrafterProfile(step.max_nodes, step.ms_per_node, step.eval_ms)
        prespec = self.prespec or (PrespecConfig() if req.plan is not None else None)
        core = SpeculationCore(
            self.proto, self.welcome, req, prespec, self.learned, st, profile, msg.temperature
        )
        timeout = self.timeouts.verdict_timeout(self.welcome)
        return RoundExecutor(core, step, self.send, self.recv, self.pool, timeout)

    def _planned(
        self, mode: str | Mode, objective: str, s: SamplingOptions, tree: TreeSpec | None
    ) -> tuple[Mode, Request]:
        """The verification mode and the core's request of a generation; mode auto verifies as
        `auto_mode` says, drafts budgeted trees unless given a shape, and carries its plan."""
        plan: Plan | None = None
        if mode == "auto":
            plan = Plan(objective)
            mode, tree = self.auto_mode(s.temperature), tree or TreeSpec("budget")
        mode = Mode(mode)
        req = self._request(mode, s.temperature, s.top_k, s.top_p, s.seed, tree or self.tree)
        if plan is not None and mode is not Mode.AR:
            req = dataclasses.replace(req, plan=plan)
        return mode, req

    def auto_mode(self, temperature: float) -> Mode:
        """The verification mode auto runs: greedy at temperature 0, match above (each the target's
        own output), or ar where the key allows neither or there is no drafter."""
        assert self.welcome is not None
        want = Mode.GREEDY if temperature <= 0 else Mode.MATCH
        if want in self.welcome.allowed_modes and self.drafter is not None:
            return want
        return Mode.AR

    def _request(
        self, mode: Mode, temperature: float, top_k: int, top_p: float, seed: int, spec: TreeSpec
    ) -> Request:
        assert self.welcome is not None
        if mode not in self.welcome.allowed_modes:
            raise GenerationError(
                f"mode {mode.value} is not allowed for this key (allowed: "
                f"{', '.join(m.value for m in self.welcome.allowed_modes)}); mss/rrs need a trusted key",
                ErrorCode.MODE_NOT_ALLOWED,
                "mode",
            )
        if mode is not Mode.AR and self.drafter is None:
            raise GenerationError(f"mode {mode.value} needs a drafter")
        if not mode.stochastic:
            if mode is Mode.MATCH and temperature > 0 and self.config.couple:
                return Request(mode, spec, coupling=Coupling(seed, temperature, top_k, top_p))
            return Request(mode, spec)
        if temperature <= 0:
            raise GenerationError(f"mode {mode.value} samples: give a temperature > 0 (or use greedy)")
        if spec.kind == "budget":
            spec = TreeSpec("static", spec.expansion)  # draw counts must be fixed before drawing
        saguaro = self.prespec.saguaro if self.prespec is not None else None  # --saguaro-c
        return Request(
            mode,
            spec,
            Sampling(temperature, top_k, top_p, self.config.wire_top_k, saguaro),
            np.random.default_rng(seed),
        )

    def encode_prompt(
        self, prompt: str | Sequence[ChatMessage] | Sequence[int], raw: bool = False
    ) -> list[int]:
        """The token ids `generate` would send for `prompt` (chat template unless raw)."""
        return self._encode(prompt, raw)

    def _encode(self, prompt: str | Sequence[ChatMessage] | Sequence[int], raw: bool) -> list[int]:
        if not isinstance(prompt, str) and prompt and isinstance(prompt[0], (int, np.integer)):
            return [int(t) for t in prompt]  # type: ignore[arg-type]
        if raw:
            if not isinstance(prompt, str):
                raise ValueError("raw=True takes a string prompt")
            return self.tokenizer.encode(prompt, add_special=True, parse_special=False)
        text = self.tokenizer.render_chat(as_messages(prompt), add_generation_prompt=True)  # type: ignore[arg-type]
        return self.tokenizer.encode(text, add_special=False, parse_special=True)


class SyncEdgeClient:
    """A blocking wrapper: runs an EdgeClient on an event loop in a background thread."""

    def __init__(self, server: str, drafter: Drafter | None, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="edge-client-loop", daemon=True)
        self._thread.start()
        self.client = EdgeClient(server, drafter, **kwargs)
        self._call(self.client.connect())

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(self, prompt: str | Sequence[ChatMessage] | Sequence[int], **kwargs: Any) -> Iterator[str]:
        """Yield text chunks as they arrive (blocking)."""
        agen = self.client.generate(prompt, **kwargs)
        try:
            while True:
                try:
                    chunk = self._call(agen.__anext__())
                except StopAsyncIteration:
                    return
                yield chunk
        finally:  # stopped early: cancel the generation at the verifier now, not when collected
            if self._loop.is_running():
                self._call(agen.aclose())

    def complete(
        self, prompt: str | Sequence[ChatMessage] | Sequence[int], **kwargs: Any
    ) -> GenerationResult:
        """Run a whole generation; returns its record (text, tokens, stats)."""
        for _ in self.generate(prompt, **kwargs):
            pass
        assert self.client.last is not None
        return self.client.last

    @property
    def last(self) -> GenerationResult | None:
        return self.client.last

    def close(self) -> None:
        self._call(self.client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self) -> SyncEdgeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
