"""The edge client: an async session with the verifier, a sync wrapper, streaming text.

    async with EdgeClient("ws://127.0.0.1:8000/v1/session", drafter) as client:
        async for chunk in client.generate("Why is the sky blue?", max_new_tokens=64):
            print(chunk, end="")
        print(client.last.stats)

Each round the drafter (on its own thread, off the event loop) builds a token tree below the
committed sequence; the verifier answers with the accepted path plus its bonus token. The text is
exactly what the target alone would produce. Pre-speculation (edge_client.prespec) drafts
conditional trees for the likely outcomes while a round is in flight.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import statistics
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from edge_client.budget import AcceptanceCalibration, choose_budget, geometric_gains
from edge_client.drafters.base import Drafter
from edge_client.text import IncrementalDetokenizer, Message, as_messages, find_stop
from edge_client.tokenizer import EdgeTokenizer
from edge_client.transport import LinkShape, ShapedTransport, Transport, TransportClosed, WebSocketTransport
from edge_client.trees import DraftResult, Sampling, draft_dynamic, draft_sequence, draft_static
from shared.errors import ErrorCode, ProtocolError
from shared.messages import Error, Hello, Mode, Prompt, Stale, Tree, Verdict, Welcome
from shared.protocol import ClientProtocol, ClientState
from shared.tree import ExpansionConfig


class GenerationError(RuntimeError):
    """The verifier refused the request or the session broke; `code`/`field` say what was wrong."""

    def __init__(self, message: str, code: ErrorCode | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.field = field


@dataclass(frozen=True)
class TreeSpec:
    """The shape of the trees the edge drafts.

    static:   SpecInfer expansion <k1..km> (`expansion`)
    budget:   best-first tree of `budget` nodes (0: chosen each round from the server's cost curve)
    sequence: a chain of `depth` tokens (default: as deep as the static tree)
    """

    kind: Literal["static", "budget", "sequence"] = "static"
    expansion: ExpansionConfig = field(default_factory=ExpansionConfig)
    budget: int = 0
    depth: int = 0

    @property
    def chain_depth(self) -> int:
        return self.depth or self.expansion.depth


@dataclass
class GenerationStats:
    """Per-generation figures. tau = tokens per verdict (bonus included)."""

    rounds: int = 0
    tokens: int = 0
    accepted_counts: list[int] = field(default_factory=list)  # rounds that accepted depth d+1
    rtt_ms: list[float] = field(default_factory=list)  # send -> verdict, minus the server's verify ms
    verify_ms: list[float] = field(default_factory=list)
    draft_ms: list[float] = field(default_factory=list)
    round_ms: list[float] = field(default_factory=list)
    tree_nodes: list[int] = field(default_factory=list)
    bytes_up: int = 0
    bytes_down: int = 0
    prespec_sent: int = 0
    prespec_hits: int = 0
    prespec_hits_by_depth: dict[int, int] = field(default_factory=dict)
    prespec_guesses_by_depth: dict[int, int] = field(default_factory=dict)
    wall_s: float = 0.0
    first_token_s: float = 0.0

    @property
    def tau(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0

    @property
    def accepted_per_depth(self) -> list[float]:
        return [c / self.rounds for c in self.accepted_counts] if self.rounds else []

    @property
    def ms_per_token(self) -> float:
        return self.wall_s * 1e3 / self.tokens if self.tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        def med(x: list[float]) -> float:
            return round(statistics.median(x), 3) if x else 0.0

        return {
            "rounds": self.rounds,
            "tau": round(self.tau, 4),
            "accepted_per_depth": [round(a, 4) for a in self.accepted_per_depth],
            "rtt_ms": med(self.rtt_ms),
            "verify_ms": med(self.verify_ms),
            "draft_ms": med(self.draft_ms),
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "tokens": self.tokens,
            "ms_per_token": round(self.ms_per_token, 3),
            "prespec_sent": self.prespec_sent,
            "prespec_hits": self.prespec_hits,
        }


@dataclass
class Generation:
    """The outcome of one `generate` call (also filled while streaming)."""

    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    stats: GenerationStats = field(default_factory=GenerationStats)
    reason: str | None = None


@dataclass(frozen=True)
class _Request:
    mode: Mode
    sampling: Sampling | None
    rng: np.random.Generator | None
    tree: TreeSpec


class EdgeClient:
    """An async session with the verifier (see the module docstring).

    drafter:   the draft model; None only for mode "ar" (then `tokenizer` is required)
    tree:      the tree shape drafted each round
    link:      emulate a network link in-process (delay per direction, jitter, bandwidth)
    prespec:   pre-speculate conditional trees while a round is in flight (edge_client.prespec)
    """

    def __init__(
        self,
        server: str,
        drafter: Drafter | None,
        *,
        tokenizer: EdgeTokenizer | None = None,
        api_key: str | None = None,
        tree: TreeSpec = TreeSpec(),
        link: LinkShape | None = None,
        prespec: bool = False,
        transport_factory: Callable[[], Any] | None = None,
        wire_top_k: int = 48,
    ) -> None:
        self.server = server
        self.drafter = drafter
        tok = tokenizer or (drafter.tokenizer if drafter is not None else None)
        if tok is None:
            raise ValueError("EdgeClient needs a drafter or a tokenizer")
        self.tokenizer: EdgeTokenizer = tok
        self.api_key = api_key
        self.tree = tree
        self.link = link
        self.prespec = prespec
        self.wire_top_k = wire_top_k
        self._transport_factory = transport_factory
        self._transport: Transport | None = None
        self.proto = ClientProtocol()
        self.welcome: Welcome | None = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="drafter")
        self._round = 0
        self._calibration = AcceptanceCalibration()
        self._last_draft: DraftResult | None = None
        self._rtt_estimate_ms = 0.0
        self.last: Generation | None = None
        self._conversation: list[int] | None = None

    # ------------------------------------------------------------------ connection
    async def connect(self) -> Welcome:
        if self._transport_factory is not None:
            inner = await self._transport_factory()
        else:
            inner = await WebSocketTransport.connect(self.server, self.api_key)
        self._transport = ShapedTransport(inner, self.link) if self.link is not None else inner
        fp = self.drafter.vocab_fingerprint() if self.drafter is not None else self.tokenizer.fingerprint
        await self._send(
            self.proto.hello(Hello(vocab_fingerprint=fp, api_key=self.api_key, client="edge-client/0.1"))
        )
        msg = await self._recv()
        if isinstance(msg, Error):
            raise self._refused(msg)
        if not isinstance(msg, Welcome):
            raise GenerationError(f"expected welcome, got {msg.TYPE.value}")
        if msg.vocab_fingerprint and msg.vocab_fingerprint != fp:
            raise GenerationError(
                f"vocabulary mismatch: the draft model's tokenizer is not the target's ({msg.model_id}); "
                "use a draft model built on the target's vocabulary",
                ErrorCode.VOCAB_MISMATCH,
                "vocab_fingerprint",
            )
        self.welcome = msg
        return msg

    async def close(self) -> None:
        if self._transport is not None:
            if self.proto.state is not ClientState.CLOSED:
                try:
                    await self._send(self.proto.close())
                except (TransportClosed, ProtocolError):
                    pass
            await self._transport.close()
            self._transport = None
        self._pool.shutdown(wait=True)

    async def __aenter__(self) -> EdgeClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _send(self, frame: bytes) -> None:
        assert self._transport is not None, "connect() first"
        await self._transport.send(frame)

    async def _recv(self) -> Any:
        assert self._transport is not None, "connect() first"
        try:
            data = await self._transport.recv()
        except TransportClosed as exc:
            raise GenerationError(f"the verifier closed the connection: {exc.reason or exc.code}") from exc
        return self.proto.receive(data)

    def _refused(self, e: Error) -> GenerationError:
        where = f" (field {e.field})" if e.field else ""
        return GenerationError(f"verifier refused: {e.code.value}{where}: {e.message}", e.code, e.field)

    # ------------------------------------------------------------------ drafting (drafter thread)
    async def _draft(self, fn: Callable[[], DraftResult]) -> DraftResult:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn)

    def _build(self, req: _Request, committed: Sequence[int]) -> DraftResult:
        assert self.drafter is not None and self.welcome is not None
        lim = self.welcome.limits
        spec = req.tree
        if spec.kind == "sequence":
            return draft_sequence(
                self.drafter, committed, min(spec.chain_depth, lim.max_depth), mode=req.mode
            )
        if spec.kind == "budget":
            return draft_dynamic(
                self.drafter, committed, self._budget(spec), max_depth=lim.max_depth, mode=req.mode
            )
        return draft_static(
            self.drafter, committed, spec.expansion, mode=req.mode, sampling=req.sampling, rng=req.rng
        )

    def _budget(self, spec: TreeSpec) -> int:
        assert self.welcome is not None and self.drafter is not None
        cap = min(self.welcome.limits.max_nodes, self.drafter.max_nodes)
        if spec.budget:
            return min(spec.budget, cap)
        gains = self._last_draft.gains() if self._last_draft is not None else geometric_gains(0.7, cap)
        st = self.drafter.stats
        per_node = st.extend_ms / st.extend_nodes if st.extend_nodes else 0.0
        return choose_budget(
            self.welcome.verify_cost_ms,
            gains,
            rtt_ms=self._rtt_estimate_ms,
            draft_ms_per_node=per_node,
            max_nodes=cap,
            calibration=self._calibration.factor,
        )

    # ------------------------------------------------------------------ generation
    async def generate(
        self,
        prompt: str | Sequence[Message] | Sequence[int],
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int = 0,
        mode: str | Mode = Mode.GREEDY,
        raw: bool = False,
        stop: Sequence[str] = (),
        stop_ids: Sequence[int] = (),
        tree: TreeSpec | None = None,
    ) -> AsyncIterator[str]:
        """Stream the target's text for `prompt` (text, chat messages, or token ids).

        A plain prompt becomes one user turn of the model's chat template unless `raw`. Generation
        ends on an EOS id, a stop id, a stop string (cut from the text) or max_new_tokens. The
        Generation record is `self.last` (tokens, text, stats).
        """
        if self.welcome is None:
            await self.connect()
        assert self.welcome is not None
        mode = Mode(mode)
        if mode not in self.welcome.allowed_modes:
            raise GenerationError(
                f"mode {mode.value} is not allowed for this key (allowed: "
                f"{', '.join(m.value for m in self.welcome.allowed_modes)}); mss/rrs need a trusted key",
                ErrorCode.MODE_NOT_ALLOWED,
                "mode",
            )
        if mode is not Mode.AR and self.drafter is None:
            raise GenerationError(f"mode {mode.value} needs a drafter")
        if mode is Mode.GREEDY:
            temperature = 0.0
        spec = tree or self.tree
        sampling = None
        rng = None
        if mode.stochastic:
            if temperature <= 0:
                raise GenerationError(f"mode {mode.value} samples: give a temperature > 0 (or use greedy)")
            if spec.kind != "static":
                spec = TreeSpec("static", spec.expansion)
            sampling = Sampling(temperature, top_k, top_p, self.wire_top_k)
            rng = np.random.default_rng(seed)
        req = _Request(mode, sampling, rng, spec)
        prompt_tokens = self._encode(prompt, raw)
        gen = Generation(prompt_tokens=list(prompt_tokens))
        self.last = gen
        st = gen.stats
        detok = IncrementalDetokenizer(lambda t: self.tokenizer.token_bytes(t))
        up0, down0 = self.proto.stats.bytes_out, self.proto.stats.bytes_in
        t_start = time.perf_counter()

        committed = list(prompt_tokens)
        first = None
        if mode is not Mode.AR:
            first = await self._draft(lambda: self._build(req, committed))
            st.draft_ms.append(first.draft_ms)
        await self._send(
            self.proto.prompt(
                Prompt(
                    tokens=np.asarray(prompt_tokens, dtype=np.int32),
                    mode=mode,
                    temperature=temperature,
                    top_k=top_k,
                    top_p=top_p,
                    seed=seed,
                    max_new_tokens=max_new_tokens,
                    stop_ids=tuple(int(t) for t in stop_ids),
                    tree=first.tree if first is not None else None,
                )
            )
        )
        inflight: dict[int, tuple[DraftResult | None, float]] = {0: (first, time.perf_counter())}
        cancelled = False
        emitted = 0  # characters of gen.text already yielded
        while True:
            msg = await self._recv()
            if isinstance(msg, Error):
                if msg.fatal or msg.round == 0:
                    raise self._refused(msg)
                raise self._refused(msg)
            if isinstance(msg, Stale):
                inflight.pop(msg.round, None)
                continue
            if not isinstance(msg, Verdict):
                continue
            now = time.perf_counter()
            draft, sent_at = inflight.pop(msg.round, (None, now))
            self._account(st, msg, draft, now - sent_at)
            if not st.first_token_s:
                st.first_token_s = now - t_start
            new = msg.tokens.tolist()
            gen.tokens.extend(new)
            detok.push(new)
            if msg.done:
                detok.flush()
            text = detok.text
            cut = find_stop(text, stop, emitted) if stop else None
            if cut is not None:
                text = text[:cut]
            if len(text) > emitted:
                yield text[emitted:]
                emitted = len(text)
            gen.text = text
            if msg.done:
                gen.reason = "stop_string" if cut is not None else msg.reason
                break
            if cut is not None and not cancelled:
                cancelled = True
                await self._send(self.proto.cancel())
                continue
            if cancelled or mode is Mode.AR:
                continue
            if msg.next_round is not None:
                continue  # a pre-speculated tree is already being verified
            committed = list(self.proto.committed)
            dr = await self._draft(functools.partial(self._build, req, committed))
            st.draft_ms.append(dr.draft_ms)
            self._last_draft = dr
            self._round += 1
            rid = max(self._round, self.proto.last_round + 1)
            self._round = rid
            await self._send(self.proto.tree(Tree(round=rid, tree=dr.tree)))
            inflight[rid] = (dr, time.perf_counter())
        st.wall_s = time.perf_counter() - t_start
        st.bytes_up = self.proto.stats.bytes_out - up0
        st.bytes_down = self.proto.stats.bytes_in - down0
        if gen.reason == "stop_string":
            gen.text = text

    def _encode(self, prompt: str | Sequence[Message] | Sequence[int], raw: bool) -> list[int]:
        if not isinstance(prompt, str) and prompt and isinstance(prompt[0], (int, np.integer)):
            return [int(t) for t in prompt]  # type: ignore[arg-type]
        if raw:
            if not isinstance(prompt, str):
                raise ValueError("raw=True takes a string prompt")
            return self.tokenizer.encode(prompt, add_special=True, parse_special=False)
        text = self.tokenizer.render_chat(as_messages(prompt), add_generation_prompt=True)  # type: ignore[arg-type]
        return self.tokenizer.encode(text, add_special=False, parse_special=True)

    def _account(self, st: GenerationStats, v: Verdict, draft: DraftResult | None, elapsed_s: float) -> None:
        st.rounds += 1
        st.tokens += len(v.tokens)
        st.verify_ms.append(v.verify_ms)
        rtt = max(0.0, elapsed_s * 1e3 - v.verify_ms)
        st.rtt_ms.append(rtt)
        self._rtt_estimate_ms = 0.8 * self._rtt_estimate_ms + 0.2 * rtt if self._rtt_estimate_ms else rtt
        if draft is not None:
            tree = draft.tree
            st.tree_nodes.append(tree.num_nodes)
            acc = v.accepted_nodes.tolist()
            for i in acc:
                d = int(tree.depth[i])
                while len(st.accepted_counts) < d:
                    st.accepted_counts.append(0)
                st.accepted_counts[d - 1] += 1
            self._calibration.update(draft.expected_accepted, len(acc))


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

    def generate(self, prompt: str | Sequence[Message] | Sequence[int], **kwargs: Any) -> Iterator[str]:
        agen = self.client.generate(prompt, **kwargs)
        while True:
            try:
                yield self._call(agen.__anext__())
            except StopAsyncIteration:
                return

    def complete(self, prompt: str | Sequence[Message] | Sequence[int], **kwargs: Any) -> Generation:
        for _ in self.generate(prompt, **kwargs):
            pass
        assert self.client.last is not None
        return self.client.last

    @property
    def last(self) -> Generation | None:
        return self.client.last

    def close(self) -> None:
        self._call(self.client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    def __enter__(self) -> SyncEdgeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
