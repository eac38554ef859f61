"""The pure parts of `python -m bench serve`, in vLLM's `benchmark_serving` definitions: when each
request is sent (`arrival_times`), what one streamed request measured (`RequestResult`, from its
send time and chunk times: `timing`), the run's figures (`summarize`: TTFT, TPOT, ITL, E2EL,
throughputs, goodput), the long prompts built from shorter ones (`build_long_prompts`), the
verifier's spec-decode counters as vLLM's benchmark reads them (`SpecDecode`, `spec_decode_figures`)
and whether a client kind's outputs are the target-only ones (`identical_outputs`).

Definitions (per request, times from the request's send):
  TTFT  the first streamed chunk that carries text
  TPOT  (E2EL - TTFT) / (output tokens - 1), for requests of more than one output token
  ITL   each gap between consecutive chunks that carry text (every gap of every request)
  E2EL  the last byte of the response
A chunk is one SSE event for `ar`, one piece of text the edge SDK's generate() yields for an edge
client (one verdict: a verdict that commits several tokens is one chunk).
A run's goodput is the requests that completed and met every SLO given, per second of the run."""

from __future__ import annotations

import itertools
import math
import random
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")  # what --goodput may bound, in milliseconds
PIECE_SEPARATOR = "\n\n"  # between the prompts joined into a long one


# ------------------------------------------------------------------------------- arrivals
def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds from the run's start at which each of n requests is sent: the first at 0, then
    gaps drawn from a gamma distribution of shape `burstiness` and scale 1 / (rate * burstiness)
    (mean 1 / rate; burstiness 1 is a Poisson process, lower is burstier, higher is steadier).
    rate inf sends every request at 0. Seeded: the same arguments give the same times."""
    if n < 0 or not rate > 0 or not burstiness > 0:
        raise ValueError(f"need n >= 0, rate > 0 and burstiness > 0; got {n}, {rate}, {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=max(n - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:n]


# ------------------------------------------------------------------------------- one request
@dataclass
class RequestResult:
    """One request as the client saw it (seconds; `ok` False: `error` says why)."""

    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0  # E2EL
    itl: list[float] = field(default_factory=list)  # gaps between chunks with text
    error: str = ""
    output_ids: list[int] | None = None  # the generated token ids, when the client kind reports them
    sent_at: float = 0.0  # when it was sent (time.time())

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None for a request of one token or none."""
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def timing(send: float, chunk_times: Sequence[float], end: float) -> tuple[float, list[float], float]:
    """(TTFT, ITL gaps, E2EL) of a request sent at `send` whose chunks with text arrived at
    `chunk_times` (ascending) and whose response ended at `end` (all on one clock). A response
    without text has TTFT = E2EL and no gaps."""
    if not chunk_times:
        return end - send, [], end - send
    gaps = [b - a for a, b in itertools.pairwise(chunk_times)]
    return chunk_times[0] - send, gaps, end - send


# ------------------------------------------------------------------------------- a run's figures
def stats_ms(values: Sequence[float]) -> dict[str, float]:
    """mean, p50, p90 and p99 of values in seconds, in milliseconds (linear interpolation, as
    numpy's and vLLM's); NaN for none."""
    if not values:
        return {"mean": math.nan, **{f"p{p}": math.nan for p in PERCENTILES}}
    ms = np.asarray(values, dtype=np.float64) * 1000.0
    return {"mean": float(ms.mean()), **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}}


def meets(r: RequestResult, slos_ms: Mapping[str, float]) -> bool:
    """Whether a completed request meets every SLO given (ms); a one-token request's TPOT is 0."""
    got = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return r.ok and all(got[k] * 1000.0 <= v for k, v in slos_ms.items())


def summarize(
    results: Sequence[RequestResult], duration: float, slos_ms: Mapping[str, float] | None = None
) -> dict[str, object]:
    """A run's figures: completed and failed requests (with the first distinct error messages),
    token totals, request and output throughput (per second of `duration`), goodput (None when
    no SLO is given) and each latency's mean and percentiles in ms (ttft_ms_p50, ...)."""
    done = [r for r in results if r.ok]
    errors: list[str] = []
    for r in results:
        if not r.ok and r.error not in errors and len(errors) < 3:
            errors.append(r.error)
    out_tokens = sum(r.output_tokens for r in done)
    per_s = 1.0 / duration if duration > 0 else math.nan
    row: dict[str, object] = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": errors,
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_tokens for r in done),
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) * per_s,
        "output_throughput": out_tokens * per_s,
        "goodput": sum(meets(r, slos_ms) for r in done) * per_s if slos_ms else None,
    }
    figures = {
        "ttft": [r.ttft for r in done],
        "tpot": [t for r in done if (t := r.tpot) is not None],
        "itl": [g for r in done for g in r.itl],
        "e2el": [r.latency for r in done],
    }
    for name, values in figures.items():
        row.update({f"{name}_ms_{k}": v for k, v in stats_ms(values).items()})
    return row


# ------------------------------------------------------------------------------- long prompts
def build_long_prompts(
    pieces: Sequence[str], n: int, lo: int, hi: int, seed: int, count: Callable[[str], int]
) -> list[str]:
    """n prompts of between lo and hi tokens (`count` gives a text's tokens). Their lengths are
    drawn uniformly from [lo, hi] (`prompt_targets`); each prompt joins `pieces` in a seeded random
    order up to its length, the piece that would pass it cut at a word, so it ends at most a word
    short. Deterministic for the same pieces, seed and counter. ValueError when a prompt cannot
    end within [lo, hi]."""
    usable = [p for p in pieces if p.strip()]
    if not usable or not 1 <= lo <= hi:
        raise ValueError(f"need some text and 1 <= MIN <= MAX; got {len(usable)} pieces, {lo}:{hi}")
    rng = random.Random(seed + 1)
    out = []
    for i, want in enumerate(prompt_targets(n, lo, hi, seed)):
        order = rng.sample(usable, len(usable))
        text, tokens, k = "", 0, 0
        while tokens < want:
            piece = order[k % len(order)]
            k += 1
            longer = f"{text}{PIECE_SEPARATOR}{piece}" if text else piece
            got = count(longer)
            if got > want:
                text, tokens = _cut(text, piece, want, count)
                break
            if got <= tokens and k > len(order):  # the pieces add nothing (a counter of 0s)
                break
            text, tokens = longer, got
        if not lo <= tokens <= hi:
            raise ValueError(f"prompt {i}: {tokens} tokens, not within {lo}:{hi} (widen the range)")
        out.append(text)
    return out


def prompt_targets(n: int, lo: int, hi: int, seed: int) -> list[int]:
    """The lengths build_long_prompts aims at: n seeded uniform draws from [lo, hi]."""
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


def _cut(text: str, piece: str, hi: int, count: Callable[[str], int]) -> tuple[str, int]:
    """`text` with the longest word prefix of `piece` that keeps it within `hi` tokens (binary
    search: a text's count grows with its words), and its count."""
    words = piece.split(" ")
    best, best_n = text, count(text) if text else 0
    a, b = 1, len(words) - 1  # all the words pass hi: the caller checked
    while a <= b:
        m = (a + b) // 2
        part = " ".join(words[:m])
        cand = f"{text}{PIECE_SEPARATOR}{part}" if text else part
        got = count(cand)
        if got <= hi:
            best, best_n, a = cand, got, m + 1
        else:
            b = m - 1
    return best, best_n


# ------------------------------------------------------------------------------- spec decode
SPEC_DECODE = "vllm:spec_decode_num_"  # the counters' prefix (cloud_verifier.metrics record_round)
_SPEC_SAMPLE = re.compile(
    r"^vllm:spec_decode_num_(drafts|draft_tokens|accepted_tokens|accepted_tokens_per_pos)_total"
    r"(?:\{([^}]*)\})? ([0-9.eE+-]+)$",
    re.M,
)
_POSITION = re.compile(r'position="(\d+)"')


@dataclass(frozen=True)
class SpecDecode:
    """The verifier's spec-decode counters at one moment, summed over their model label: rounds
    verified with a draft (`drafts`), draft tokens (tree nodes) verified, draft tokens accepted, and
    accepted tokens by draft position (0: the first token after the committed end)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_pos: tuple[float, ...] = ()

    @classmethod
    def parse(cls, text: str) -> SpecDecode:
        """From a Prometheus text exposition (the counters' `_total` samples; none: all 0)."""
        got = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0}
        pos: dict[int, float] = {}
        for m in _SPEC_SAMPLE.finditer(text):
            name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
            if name == "accepted_tokens_per_pos":
                p = _POSITION.search(labels)
                if p is not None:
                    pos[int(p.group(1))] = pos.get(int(p.group(1)), 0.0) + value
            else:
                got[name] += value
        per_pos = tuple(pos.get(i, 0.0) for i in range(max(pos) + 1)) if pos else ()
        return cls(got["drafts"], got["draft_tokens"], got["accepted_tokens"], per_pos)

    def __sub__(self, before: SpecDecode) -> SpecDecode:
        n = max(len(self.per_pos), len(before.per_pos))
        a = self.per_pos + (0.0,) * (n - len(self.per_pos))
        b = before.per_pos + (0.0,) * (n - len(before.per_pos))
        return SpecDecode(
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted - before.accepted,
            tuple(x - y for x, y in zip(a, b, strict=True)),
        )


def spec_decode_figures(d: SpecDecode) -> dict[str, object]:
    """A run's counter deltas and what vLLM's benchmark prints of them: the acceptance rate
    (accepted / draft tokens: for a tree, of every node verified), the mean acceptance length
    (1 + accepted / drafts: tokens a round commits, its bonus token included) and the acceptance
    rate per position (accepted there / drafts). None where nothing was drafted (ar)."""
    return {
        "spec_decode_num_drafts": int(d.drafts),
        "spec_decode_num_draft_tokens": int(d.draft_tokens),
        "spec_decode_num_accepted_tokens": int(d.accepted),
        "spec_decode_num_accepted_tokens_per_pos": [int(x) for x in d.per_pos],
        "acceptance_rate": d.accepted / d.draft_tokens if d.draft_tokens > 0 else None,
        "mean_acceptance_length": 1.0 + d.accepted / d.drafts if d.drafts > 0 else None,
        "acceptance_rate_per_pos": [x / d.drafts for x in d.per_pos] if d.drafts > 0 else None,
    }


# ------------------------------------------------------------------------------- exactness
def identical_outputs(
    results: Sequence[RequestResult], reference: Sequence[RequestResult] | None, deterministic: bool
) -> bool | None:
    """Whether every request's output ids equal the reference run's for the same prompt (request
    i against reference i), over the requests that completed in both runs with their ids (a failed
    one is counted in `failed`, not here). None when there is no reference, the sampling is not
    deterministic, or no request could be compared."""
    if reference is None or not deterministic or len(reference) != len(results):
        return None
    pairs = [
        (r.output_ids, ref.output_ids)
        for r, ref in zip(results, reference, strict=True)
        if r.ok and ref.ok and r.output_ids is not None and ref.output_ids is not None
    ]
    return all(a == b for a, b in pairs) if pairs else None
