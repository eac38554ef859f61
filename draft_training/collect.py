"""`collect`: the teacher's continuations of the train prompts, with its distribution at every position.

The teacher is the exact fp32 target the verifier runs (`load_target(model)`, weights fp32). Each
train prompt (Spec-Bench turns in the chat template, HumanEval raw) is continued at each
temperature: 0 greedy (argmax), else sampled with the verifier's own sampler (`sample_next`, the
keyed uniform of a per-record seed), so a record is reproducible on its own. Several sequences
share each forward (`--batch`); on a CPU a row's logits do not depend on the rows beside it, so a
record is the same whatever the batch.

At every generated position a record keeps the token, the teacher's top-k (default 32) token ids and
probabilities at temperature 1 (softmax of the logits: the distribution a draft is distilled
towards, whatever temperature chose the token) and the probability mass outside them.

Layout of the output folder:

    manifest.json                 the settings; a resumed run must match them
    records/<category>__<id>__t<T>.npz
        prompt int32 [P], tokens int32 [n], top_ids int32 [n, k], top_probs float32 [n, k],
        rest float32 [n]

Each record is written to a temporary file and renamed, so an interrupted run leaves whole records
only, and running the same command again continues with the missing ones. Records are read with
numpy's `allow_pickle=False`.

From traces (`collect --from-traces DIR`, `collect_traces`): the sessions `edge-client generate
--record DIR` logged already hold the target's tokens, so the teacher only reads them (one
teacher-forced forward per session, no generation) and keeps its distribution at every recorded
position; the records are `records/trace__<session file>.npz`, in the same layout.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from shared.prompts import BenchPrompt

MANIFEST = "manifest.json"
RECORDS = "records"
FORMAT = 1
MAX_TOP_K = 256
MAX_TOKENS = 4096


@dataclass(frozen=True)
class CollectConfig:
    model: str
    tokens: int = 128
    temperatures: tuple[float, ...] = (0.0, 1.0)
    top_k: int = 32
    seed: int = 0

    def check(self) -> None:
        if not 1 <= self.tokens <= MAX_TOKENS:
            raise ValueError(f"--tokens must be in [1, {MAX_TOKENS}], got {self.tokens}")
        if not 1 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"--top-k must be in [1, {MAX_TOP_K}], got {self.top_k}")
        if not self.temperatures or any(t < 0 or t > 4 for t in self.temperatures):
            raise ValueError(f"--temperatures must be in [0, 4], got {list(self.temperatures)}")


@dataclass(frozen=True)
class Job:
    prompt: BenchPrompt
    temperature: float

    @property
    def name(self) -> str:
        pid = re.sub(r"[^A-Za-z0-9_.-]", "_", str(self.prompt.question_id))
        return f"{self.prompt.category}__{pid}__t{self.temperature:g}"

    def seed(self, base: int) -> int:
        """The record's sampling seed: from the run's seed and the record's name alone."""
        h = hashlib.sha256(f"{base}/{self.name}".encode()).digest()
        return int.from_bytes(h[:4], "little")


def prompt_ids(target: Any, p: BenchPrompt) -> list[int]:
    """The tokens the teacher reads: HumanEval raw, a Spec-Bench turn in the chat template."""
    text = p.text if p.raw else target.tokenizer.apply_chat_template([{"role": "user", "content": p.text}])
    return list(target.tokenizer.encode(text))


def manifest(config: CollectConfig, target: Any) -> dict[str, Any]:
    return {
        "format": FORMAT,
        **asdict(config),
        "temperatures": list(config.temperatures),
        "vocab_size": int(target.config.vocab_size),
        "vocab_fingerprint": target.vocab_fingerprint,
        "teacher": "fp32 target (load_target), top-k probabilities of softmax(logits) at temperature 1",
    }


def set_aside_if_stale(out: Path, want: dict[str, Any]) -> Path | None:
    """A folder collected with other settings than `want` (a recipe changed since) is renamed to
    `<out>.stale-<UTC time>` beside it, so that a resumed build collects afresh instead of
    stopping on open_output's check; where it went (None: nothing to set aside)."""
    path = out / MANIFEST
    if not path.exists() or json.loads(path.read_text(encoding="utf-8")) == want:
        return None
    aside = out.with_name(f"{out.name}.stale-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
    out.rename(aside)
    return aside


def open_output(out: Path, want: dict[str, Any]) -> Path:
    """Create the folder or check that a resumed one was made with the same settings."""
    records = out / RECORDS
    path = out / MANIFEST
    if path.exists():
        have = json.loads(path.read_text(encoding="utf-8"))
        diff = sorted(k for k in set(have) | set(want) if have.get(k) != want.get(k))
        if diff:
            raise ValueError(
                f"{out} holds records collected with other settings ({', '.join(diff)} differ): "
                "use another --out folder, or the same settings to resume"
            )
    else:
        records.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(want, indent=1) + "\n", encoding="utf-8")
    records.mkdir(parents=True, exist_ok=True)
    return records


def read_record(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in ("prompt", "tokens", "top_ids", "top_probs", "rest")}


RECORD_NAME = re.compile(r"^(?P<category>.+?)__(?P<id>.+)__t(?P<t>[0-9.]+)$")  # Job.name


def load_positions(folders: Sequence[Path]) -> list[dict[str, Any]]:
    """Every record of the collect folders: name, category, temperature, prompt and tokens (what
    bench.agreement --records and bench.speculators measure drafts on)."""
    out = []
    for folder in folders:
        paths = sorted(p for p in (folder / RECORDS).glob("*.npz") if not p.name.startswith("."))
        if not paths:
            raise FileNotFoundError(
                f"no records in {folder / RECORDS}: run `make drafts` or `draft-training collect`"
            )
        for path in paths:
            m = RECORD_NAME.match(path.stem)
            if m is None:
                raise ValueError(f"{path}: not a collect record name (<category>__<id>__t<T>)")
            r = read_record(path)
            out.append(
                {
                    "name": path.stem,
                    "category": m["category"],
                    "temperature": float(m["t"]),
                    "prompt": r["prompt"].tolist(),
                    "tokens": r["tokens"].tolist(),
                }
            )
    return out


def _write(records: Path, name: str, arrays: dict[str, np.ndarray]) -> None:
    tmp = records / f".{name}.tmp.npz"
    np.savez(tmp, **arrays)  # type: ignore[arg-type]
    os.replace(tmp, records / f"{name}.npz")


class _Seq:
    def __init__(self, job: Job, ids: list[int], sid: int, seed: int) -> None:
        self.job, self.ids, self.sid, self.seed = job, ids, sid, seed
        self.tokens: list[int] = []
        self.top_ids: list[np.ndarray] = []
        self.top_probs: list[np.ndarray] = []
        self.rest: list[float] = []


def _blocks(n: int, block: int = 16) -> int:
    return -(-n // block) + 1


@torch.inference_mode()
def run_batch(target: Any, jobs: Sequence[Job], config: CollectConfig, bar: Any) -> list[_Seq]:
    """Continue `jobs` together: each prefilled on its own, then one decode forward for all of them a step."""
    from cloud_verifier.sampling import SamplingParams, sample_next
    from shared.model import decode_step, prefill

    seqs = [_Seq(j, prompt_ids(target, j.prompt), i, j.seed(config.seed)) for i, j in enumerate(jobs)]
    kv = target.new_kv_cache(sum(_blocks(len(s.ids) + config.tokens) for s in seqs) + 1, 16)
    eos = set(target.eos_ids)
    logits: dict[int, torch.Tensor] = {}
    for s in seqs:
        kv.add(s.sid)
        logits[s.sid] = prefill(target.model, kv, s.sid, s.ids)
    active = list(seqs)
    while active:
        for s in active:
            row = logits[s.sid].float()
            p = torch.softmax(row, dim=-1)
            top = torch.topk(p, config.top_k)
            s.top_ids.append(top.indices.to(torch.int32).numpy())
            s.top_probs.append(top.values.numpy().astype(np.float32))
            s.rest.append(max(0.0, 1.0 - float(top.values.double().sum())))
            params = SamplingParams(temperature=s.job.temperature)
            s.tokens.append(sample_next(row, params, s.seed, len(s.ids) + len(s.tokens)))
        bar.update(len(active))
        done = [s for s in active if s.tokens[-1] in eos or len(s.tokens) >= config.tokens]
        for s in done:
            bar.update(config.tokens - len(s.tokens))  # the budget it did not need
            kv.free(s.sid)
        active = [s for s in active if s not in done]
        if not active:
            break
        inputs = [decode_step(s.sid, s.tokens[-1], kv.cached_len(s.sid)) for s in active]
        rows = target.model.forward_packed(inputs, kv)
        for s, r in zip(active, rows, strict=True):
            kv.commit_rows(s.sid, [0])
            logits[s.sid] = r[0]
    return seqs


def collect(
    out: Path,
    prompts: Sequence[BenchPrompt],
    config: CollectConfig,
    batch: int = 4,
    target: Any = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Collect the records of `prompts` x the temperatures missing from `out`; a summary."""
    config.check()
    if batch < 1:
        raise ValueError(f"--batch must be >= 1, got {batch}")
    if target is None:
        from shared.model import load_target

        target = load_target(config.model, progress=progress)
    records = open_output(out, manifest(config, target))
    jobs = [Job(p, t) for p in prompts for t in config.temperatures]
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        raise ValueError("two prompts share a category and id: records would overwrite each other")
    todo = [j for j in jobs if not (records / f"{j.name}.npz").exists()]
    t0 = time.perf_counter()
    generated = 0
    bar = tqdm(
        total=len(todo) * config.tokens, desc="collect", unit="tok", file=sys.stderr, disable=not progress
    )
    for a in range(0, len(todo), batch):
        for s in run_batch(target, todo[a : a + batch], config, bar):
            _write(
                records,
                s.job.name,
                {
                    "prompt": np.asarray(s.ids, dtype=np.int32),
                    "tokens": np.asarray(s.tokens, dtype=np.int32),
                    "top_ids": np.stack(s.top_ids),
                    "top_probs": np.stack(s.top_probs),
                    "rest": np.asarray(s.rest, dtype=np.float32),
                },
            )
            generated += len(s.tokens)
        bar.set_postfix_str(f"{generated / (time.perf_counter() - t0):.1f} teacher tok/s")
    bar.close()
    return {
        "records": len(jobs),
        "collected_now": len(todo),
        "skipped_existing": len(jobs) - len(todo),
        "tokens_now": generated,
        "seconds": round(time.perf_counter() - t0, 1),
    }


@torch.inference_mode()
def teacher_forced(
    target: Any, prompt: Sequence[int], tokens: Sequence[int], top_k: int
) -> dict[str, np.ndarray]:
    """The teacher's top-k at every position of `tokens` after `prompt` (one forward, the prompt's
    head prefilled first): a record's arrays."""
    from shared.model import prefill
    from shared.model.inputs import SeqInput

    kv = target.new_kv_cache(_blocks(len(prompt) + len(tokens)) + 1, 16)
    kv.add(0)
    if len(prompt) > 1:
        prefill(target.model, kv, 0, list(prompt[:-1]))
    rows = [int(prompt[-1]), *map(int, tokens[:-1])]
    start = len(prompt) - 1
    x = SeqInput(
        0,
        torch.tensor(rows, dtype=torch.int64),
        torch.arange(start, start + len(rows), dtype=torch.int64),
        None,
        torch.arange(len(rows), dtype=torch.int64),
    )
    (logits,) = target.model.forward_packed([x], kv)
    p = torch.softmax(logits.float(), dim=-1)
    top = torch.topk(p, top_k, dim=-1)
    rest = (1.0 - top.values.double().sum(dim=-1)).clamp(min=0.0)
    return {
        "prompt": np.asarray(prompt, dtype=np.int32),
        "tokens": np.asarray(tokens, dtype=np.int32),
        "top_ids": top.indices.to(torch.int32).numpy(),
        "top_probs": top.values.numpy().astype(np.float32),
        "rest": rest.numpy().astype(np.float32),
    }


def collect_traces(
    out: Path, folder: Path, config: CollectConfig, target: Any = None, progress: bool = True
) -> dict[str, Any]:
    """Records from the session records in `folder` (edge_client.record) that `out` lacks: each
    session's tokens (at most config.tokens) with the teacher's distribution; a summary. A session
    recorded against another vocabulary is refused by name."""
    from edge_client.record import read_records

    config.check()
    if target is None:
        from shared.model import load_target

        target = load_target(config.model, progress=progress)
    records = open_output(out, {**manifest(config, target), "source": "traces"})
    sessions = list(read_records(folder, int(target.config.vocab_size)))
    for r in sessions:
        if r.vocab_fingerprint and r.vocab_fingerprint != target.vocab_fingerprint:
            raise ValueError(
                f"{r.path} was recorded against another vocabulary (fingerprint {r.vocab_fingerprint[:12]}, "
                f"the teacher's {target.vocab_fingerprint[:12]}): record with this target's verifier"
            )
    todo = [r for r in sessions if r.tokens and not (records / f"trace__{r.path.stem}.npz").exists()]
    t0 = time.perf_counter()
    done = 0
    for r in tqdm(todo, desc="collect (traces)", unit="session", file=sys.stderr, disable=not progress):
        tokens = r.tokens[: config.tokens]
        _write(records, f"trace__{r.path.stem}", teacher_forced(target, r.prompt_ids, tokens, config.top_k))
        done += len(tokens)
    return {
        "sessions": len(sessions),
        "collected_now": len(todo),
        "skipped": len(sessions) - len(todo),
        "tokens_now": done,
        "seconds": round(time.perf_counter() - t0, 1),
    }
