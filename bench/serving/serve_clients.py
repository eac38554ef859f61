"""bench.serving.serve's client kinds and its open-loop schedule (`run_load`).

`ar` is a streaming POST /v1/completions (cloud-only decoding). Every other kind is an edge mode:
the names bench.end_to_end.e2e's variant table holds (the modes bench.end_to_end.network runs: sequence, tree,
tree_prespec, budget_prespec, ...; `edge_kind` maps a name to its EdgeClient configuration
through that table, `bench.end_to_end.e2e.variants`), and any mode the SDK's generate() itself takes
(`sdk_modes`: shared.messages.Mode's, and `auto`, which plans its own rounds), on the run's static
tree. An edge request is one `EdgeClient.generate` over the verifier's WebSocket /v1/session.

What the edge side shares: nothing between concurrent requests but this process (its cores and
its GIL). A drafter is not thread-safe and pre-speculation keeps its workspace from one draft step
to the next (`reuse_workspace`), so one drafter cannot serve sessions that generate at the same
time: an `EdgeFleet` holds one EdgeClient (a session of its own) with a drafter of its own per
request that may be in flight (min(requests, --max-concurrency)), each drafting on its own thread.
The drafters (`DrafterPool`) are made once and lent to each edge kind's fleet in turn; a fleet's
clients keep their session and what they learned (calibration, outcome models, round trip) from one
request and rate to the next, as a device would, and each is warmed up before the kind's first run.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import re
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from tqdm import tqdm

from bench.end_to_end.e2e import ALL_MODES, STOCHASTIC_MODES, Variant, variants
from bench.lib.procs import Proxy
from bench.serving.serve_metrics import (
    RequestResult,
    SpecDecode,
    arrival_times,
    identical_outputs,
    spec_decode_figures,
    summarize,
    timing,
)
from edge_client.client import EdgeClient, GenerationError, Timeouts, TreeSpec
from edge_client.drafters.base import Drafter
from edge_client.drafters.registry import create_drafter
from edge_client.session import ResumeConfig
from shared.messages import Mode
from shared.tree import ExpansionConfig


@dataclass(frozen=True)
class RequestSpec:
    """What every client kind sends for one request."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    ignore_eos: bool


Send = Callable[[RequestSpec], Awaitable[RequestResult]]
# an edge session's wait for a verdict: as ar's HTTP requests (no read timeout), a loaded verifier's
# slow answer is a measurement, not a failure (the SDK's default, 60 s, cut prefills off on a CPU)
VERDICT_S = 1800.0
# a session opened per request waits for room as a patient user would: refused ("try again later")
# while every replica is at its cap, it tries again for about two minutes before the request fails
PATIENT = ResumeConfig(attempts=64, backoff_s=0.2, max_backoff_s=2.0)
BUSY = "specdec_verify_forward_seconds_sum"  # seconds of engine forwards, every session's
PREEMPTIONS = "cloud_verifier_preemptions_total"
REPORT_S = 1.5  # a fleet's replicas report their metrics every second: its scrape waits this long


# --------------------------------------------------------------------------------------- ar
async def ar_request(http: httpx.AsyncClient, base: str, spec: RequestSpec) -> RequestResult:
    """Kind `ar`: one streaming /v1/completions request (cloud-only decoding), with its output
    token ids (return_token_ids). Output tokens are the final chunk's usage
    (stream_options.include_usage), else the ids' count."""
    body = {
        "prompt": spec.prompt_ids,
        "max_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": spec.ignore_eos,
        "return_token_ids": True,
    }
    chunks: list[float] = []
    ids: list[int] = []
    used: dict[str, Any] | None = None
    failed = RequestResult(False, len(spec.prompt_ids))
    send = time.perf_counter()
    try:
        async with http.stream("POST", base + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                failed.error = f"HTTP {r.status_code}: {message(await r.aread())}"
                return failed
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                doc = json.loads(line[6:])
                if "error" in doc:
                    failed.error = f"mid-stream: {message(line[6:].encode())}"
                    return failed
                choice = (doc.get("choices") or [{}])[0]
                if choice.get("text"):
                    chunks.append(time.perf_counter())
                ids.extend(int(t) for t in choice.get("token_ids") or ())
                used = doc.get("usage") or used
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        failed.error = f"{type(exc).__name__}: {exc}"
        return failed
    end = time.perf_counter()
    ttft, itl, latency = timing(send, chunks, end)
    n = int(used["completion_tokens"]) if used is not None else len(ids)
    return RequestResult(True, len(spec.prompt_ids), n, ttft, latency, itl, output_ids=ids)


def message(raw: bytes) -> str:
    """An error body's message (OpenAI's {"error": {"message"}}), else its text, on one line."""
    try:
        doc = json.loads(raw)
        msg = str(doc["error"]["message"])
    except (ValueError, KeyError, TypeError):
        msg = raw.decode("utf-8", "replace")
    return " ".join(msg.split())[:300]


# --------------------------------------------------------------------------------------- edge kinds
def sdk_modes() -> list[str]:
    """The modes EdgeClient.generate takes besides ar: shared.messages.Mode's values, and `auto`
    where the SDK plans its rounds itself (edge_client.speculation.auto: mode="auto")."""
    names = [m.value for m in Mode if m is not Mode.AR]
    if "auto" not in names and importlib.util.find_spec("edge_client.speculation.auto") is not None:
        names.append("auto")
    return names


def edge_kinds() -> list[str]:
    """Every edge mode name: bench.end_to_end.e2e's variants (what bench.end_to_end.network runs), then the
    SDK's own
    modes not among them (ar is the HTTP kind, not an edge one)."""
    names = [m for m in ALL_MODES if m != "ar"]
    return names + [m for m in sdk_modes() if m not in names]


def kinds() -> list[str]:
    """Every client kind --clients accepts."""
    return ["ar", *edge_kinds()]


def edge_kind(name: str, tree: ExpansionConfig, temperature: float) -> tuple[Variant, dict[str, Any]]:
    """The EdgeClient configuration of edge kind `name` and what its generations ask generate()
    for (mode, and objective for auto): bench.end_to_end.e2e's variant of that name (`Variant.generate_args`:
    the run's verification mode, greedy or match at temperature > 0, unless the variant has its
    own), else the SDK's mode `name` on the run's static tree. ValueError naming the kinds."""
    spec_mode = Mode.GREEDY if temperature == 0 else Mode.MATCH
    if name in ALL_MODES and name != "ar":
        v = variants([name], tree)[name]
        return v, v.generate_args(spec_mode)
    if name in sdk_modes():
        return Variant(tree=TreeSpec("static", tree)), {"mode": name}
    raise ValueError(f"unknown kind {name}; available: {', '.join(kinds())}")


def stochastic(name: str) -> bool:
    """Whether edge kind `name` verifies stochastically (mss / rrs: a trusted key, sampled only)."""
    return name in STOCHASTIC_MODES or (name in {m.value for m in Mode} and Mode(name).stochastic)


class DrafterPool:
    """Drafters made by `factory` on demand, lent out and given back (never two borrowers at once)."""

    def __init__(self, factory: Callable[[], Drafter]) -> None:
        self.factory = factory
        self.free: list[Drafter] = []
        self.made: list[Drafter] = []

    async def take(self, n: int) -> list[Drafter]:
        while len(self.free) < n:
            try:
                d = await asyncio.to_thread(self.factory)  # loading a model: off the event loop
            except Exception as exc:  # a missing model, backend or file: one line, the run stops
                raise ServeBenchError(f"the edge kinds' drafter could not be made: {exc}") from None
            self.made.append(d)
            self.free.append(d)
        out, self.free = self.free[:n], self.free[n:]
        return out

    def give(self, drafters: Sequence[Drafter]) -> None:
        self.free.extend(drafters)

    def close(self) -> None:
        for d in self.made:
            d.close()
        self.made, self.free = [], []


class EdgeFleet:
    """`size` EdgeClients of one edge kind, each with a drafter of the pool's and a session of its
    own to `url`; `send(spec)` generates on a free one (see the module docstring)."""

    def __init__(
        self,
        url: str,
        pool: DrafterPool,
        variant: Variant,
        generate_args: dict[str, Any],
        size: int,
        api_key: str | None,
        per_request: bool = False,
    ) -> None:
        self.url, self.pool, self.variant, self.size = url, pool, variant, size
        self.per_request = per_request
        self.generate_args = generate_args
        self.api_key = api_key
        self.idle: asyncio.Queue[EdgeClient] = asyncio.Queue()
        self.clients: list[EdgeClient] = []
        self.drafters: list[Drafter] = []

    async def __aenter__(self) -> EdgeFleet:
        self.drafters = await self.pool.take(self.size)
        try:
            for d in self.drafters:
                c = EdgeClient(
                    self.url,
                    d,
                    tree=self.variant.tree,
                    prespec=self.variant.prespec,
                    api_key=self.api_key,
                    timeouts=Timeouts(verdict_s=VERDICT_S),
                    resume=PATIENT if self.per_request else True,
                )
                self.clients.append(c)
                if not self.per_request:  # else each generation opens its session (when room)
                    await c.connect()
                self.idle.put_nowait(c)
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def warm_up(self, spec: RequestSpec) -> RequestResult:
        """One short generation on every client at once (not measured): the first failure, else ok."""
        results = await asyncio.gather(*(self.send(spec) for _ in self.clients))
        return next((r for r in results if not r.ok), results[0])

    async def send(self, spec: RequestSpec) -> RequestResult:
        client = await self.idle.get()
        try:
            return await edge_request(client, spec, self.generate_args)
        finally:
            if self.per_request:  # the session ends with its request; the next opens its own
                await client.drop_connection()
            self.idle.put_nowait(client)

    async def __aexit__(self, *exc: object) -> None:
        for c in self.clients:
            try:
                await c.close()
            except Exception:  # a session already broken: its drafter goes back all the same
                pass
        self.clients = []
        self.pool.give(self.drafters)
        self.drafters = []


async def edge_request(client: EdgeClient, spec: RequestSpec, generate_args: dict[str, Any]) -> RequestResult:
    """One generation on an EdgeClient: a chunk is each piece of text generate() yields (one per
    verdict that adds text), the output ids its GenerationResult's tokens."""
    chunks: list[float] = []
    failed = RequestResult(False, len(spec.prompt_ids))
    send = time.perf_counter()
    try:
        async for _ in client.generate(
            spec.prompt_ids, max_new_tokens=spec.max_tokens, temperature=spec.temperature, **generate_args
        ):
            chunks.append(time.perf_counter())
    except (GenerationError, OSError) as exc:
        failed.error = f"{type(exc).__name__}: {exc}"
        return failed
    end = time.perf_counter()
    ttft, itl, latency = timing(send, chunks, end)
    assert client.last is not None
    ids = [int(t) for t in client.last.tokens]
    return RequestResult(True, len(spec.prompt_ids), len(ids), ttft, latency, itl, output_ids=ids)


# --------------------------------------------------------------------------------------- a run
class ServeBenchError(RuntimeError):
    """A run that cannot go on (a server that refuses, a prompt that cannot be built): one line."""


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


async def run_load(
    send: Send,
    specs: Sequence[RequestSpec],
    arrivals: Sequence[float],
    max_concurrency: int | None,
    bar: tqdm[Any],
) -> tuple[list[RequestResult], float]:
    """Send specs[i] at arrivals[i] seconds from the start (open loop: whether or not earlier ones
    have answered), at most max_concurrency in flight; the results and the run's seconds."""
    gate = asyncio.Semaphore(max_concurrency or len(specs))
    start = time.perf_counter()

    async def one(i: int) -> RequestResult:
        await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
        async with gate:
            sent = time.time()
            r = await send(specs[i])
            r.sent_at = sent
        bar.update(1)
        return r

    results = await asyncio.gather(*(one(i) for i in range(len(specs))))
    return list(results), time.perf_counter() - start


# --------------------------------------------------------------------------------------- runs
@dataclass
class Endpoints:
    """Where the runs go: `base` (the verifier itself: /metrics, /tokenize, the warm-up), `http`
    and `ws` (what the measured requests use: through the delay proxy with --rtt-ms)."""

    base: str
    http: str
    ws: str
    headers: dict[str, str]
    api_key: str | None


@dataclass
class Run:
    """One (client, rate) run: its row and its requests' results (their output ids)."""

    row: dict[str, Any]
    results: list[RequestResult]


async def measure(
    args: argparse.Namespace,
    ends: Endpoints,
    client: str,
    rate: float,
    specs: Sequence[RequestSpec],
    send: Send,
) -> Run:
    """One (client, rate) run and its row, with the verifier's cost and spec-decode counters read
    from /metrics around it."""
    arrivals = arrival_times(len(specs), rate, args.burstiness, args.seed)
    before, sd0 = await asyncio.to_thread(_scrape, ends.base)
    wall_start = time.time()
    bar = tqdm(total=len(specs), desc=f"{client} @ {rate:g} req/s", file=sys.stderr, disable=args.no_progress)
    with bar:
        results, duration = await run_load(send, specs, arrivals, args.max_concurrency, bar)
    wall_end = time.time()
    if args.fleet:  # the replicas report their metrics each second
        await asyncio.sleep(REPORT_S)
    after, sd1 = await asyncio.to_thread(_scrape, ends.base)
    row: dict[str, Any] = {
        "client": client,
        "request_rate": rate,
        "rtt_ms": args.rtt_ms,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "wall_start": wall_start,
        "wall_end": wall_end,
    }
    row.update(summarize(results, duration, args.goodput))
    busy = grown(before, after, BUSY)
    tokens = row["total_output_tokens"]
    row["verifier_busy_s"] = busy
    row["verifier_busy_s_per_token"] = busy / tokens if tokens else math.nan
    row["preemptions"] = int(grown(before, after, PREEMPTIONS))
    row["identical_to_ar"] = None  # filled in once the ar run of the same prompts is in (same_as_ar)
    row.update(spec_decode_figures(sd1 - sd0))
    return Run(row, results)


Counters = dict[str, dict[str, float]]  # a counter's value by replica ("": a lone verifier's)


def _scrape(base: str) -> tuple[Counters, SpecDecode]:
    """The verifier's cost counters (BUSY, PREEMPTIONS) by replica, and its spec-decode counters,
    now. A fleet's /metrics labels every sample with its `replica`."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    counters: Counters = {BUSY: {}, PREEMPTIONS: {}}
    for m in _COUNTER.finditer(text):
        replica = _REPLICA.search(m.group(2) or "")
        key = replica.group(1) if replica else ""
        counters[m.group(1)][key] = counters[m.group(1)].get(key, 0.0) + float(m.group(3))
    return counters, SpecDecode.parse(text)


_COUNTER = re.compile(rf"^({BUSY}|{PREEMPTIONS})(\{{[^}}]*\}})? ([0-9.eE+-]+)$", re.M)
_REPLICA = re.compile(r'replica="([^"]*)"')


def grown(before: Counters, after: Counters, name: str) -> float:
    """How much counter `name` grew between two scrapes, replica by replica: a replica that came
    up in between counts from 0; one stopped in between takes its counts with it (not counted)."""
    was = before.get(name, {})
    return sum(v - was.get(k, 0.0) for k, v in after.get(name, {}).items())


async def run_kind(
    args: argparse.Namespace,
    ends: Endpoints,
    client: str,
    specs: Sequence[RequestSpec],
    pool: DrafterPool,
    done: Callable[[Run], None],
) -> None:
    """Every rate of one client kind, `done(run)` after each: ar over one HTTP connection pool,
    an edge kind on an EdgeFleet (warmed up first, not measured)."""
    limit = args.max_concurrency or len(specs)
    if client == "ar":
        timeout = httpx.Timeout(None, connect=30.0)
        limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
        async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=ends.headers) as http:

            def send_ar(spec: RequestSpec) -> Awaitable[RequestResult]:
                return ar_request(http, ends.http, spec)

            for rate in args.request_rate:
                done(await measure(args, ends, client, rate, specs, send_ar))
        return
    variant, gen_args = edge_kind(client, ExpansionConfig.parse(args.tree), args.temperature)
    size = min(limit, len(specs))
    fleet = EdgeFleet(ends.ws, pool, variant, gen_args, size, ends.api_key, args.session_per_request)
    try:
        await fleet.__aenter__()
    except ServeBenchError:
        raise
    except Exception as exc:  # refused, unreachable, a protocol error: one line, the run stops
        raise ServeBenchError(
            f"{client}: the edge sessions did not open: {type(exc).__name__}: {exc}"
        ) from None
    try:
        warm = RequestSpec(specs[0].prompt_ids, min(8, args.max_tokens), args.temperature, False)
        r = await fleet.warm_up(warm)
        if not r.ok:
            raise ServeBenchError(f"{client}: the warm-up generation failed: {r.error}")
        for rate in args.request_rate:
            done(await measure(args, ends, client, rate, specs, fleet.send))
    finally:
        await fleet.__aexit__()


def same_as_ar(runs: Sequence[Run], deterministic: bool) -> None:
    """Set each run's identical_to_ar: its outputs against ar's for the same prompts, at the same
    rate if ar ran there, else at ar's first rate (ar's own rows: against that first rate)."""
    ar = {r.row["request_rate"]: r.results for r in runs if r.row["client"] == "ar"}
    first = next(iter(ar.values()), None)
    for r in runs:
        ref = ar.get(r.row["request_rate"], first) if r.row["client"] != "ar" else first
        r.row["identical_to_ar"] = identical_outputs(r.results, ref, deterministic)


@contextmanager
def endpoints(args: argparse.Namespace, base: str) -> Iterator[Endpoints]:
    """The run's endpoints: through a delay proxy process (bench.end_to_end.network.Proxy) with --rtt-ms >
    0."""
    parts = urllib.parse.urlsplit(base)
    ws = f"{'wss' if parts.scheme == 'https' else 'ws'}://{parts.netloc}/v1/session"
    if not args.rtt_ms:
        yield Endpoints(base, base, ws, auth_headers(args.api_key), args.api_key)
        return
    if parts.hostname not in ("127.0.0.1", "localhost") or parts.port is None:
        raise ServeBenchError(f"--rtt-ms: the delay proxy reaches a verifier on this machine, not {base}")
    proxy = Proxy(parts.port, args.rtt_ms, 0.0, 0.0, ())
    try:
        proxy.__enter__()
    except RuntimeError as exc:
        raise ServeBenchError(f"--rtt-ms: {exc}") from None
    try:
        near = f"{parts.scheme}://127.0.0.1:{proxy.port}"
        ws = f"{ws.split(':', 1)[0]}://127.0.0.1:{proxy.port}/v1/session"
        yield Endpoints(base, near, ws, auth_headers(args.api_key), args.api_key)
    finally:
        proxy.__exit__()


def run_all(
    args: argparse.Namespace,
    ends: Endpoints,
    specs: Sequence[RequestSpec],
    save: Callable[[list[Run]], object],
) -> list[Run]:
    """Every client kind at every rate, `save(runs so far)` after each run."""
    runs: list[Run] = []

    def done(run: Run) -> None:
        runs.append(run)
        same_as_ar(runs, args.temperature == 0)
        save(runs)

    pool = DrafterPool(lambda: create_drafter(args.drafter, args.draft, n_threads=1))

    async def go() -> None:
        for client in args.clients:
            await run_kind(args, ends, client, specs, pool, done)

    try:
        asyncio.run(go())
    finally:
        pool.close()
    return runs
