"""Session records (`edge-client generate --record DIR`): what the target committed, kept for training.

Every generation the edge runs ends with the target's own tokens (greedy: its argmax; sampled: its
samples), which the edge has anyway: recording them costs the cloud nothing. A record is one JSON
file per generation, `DIR/<UTC time>-<pid>-<n>.json`:

    {"format": 1, "model_id": ..., "vocab_fingerprint": ..., "mode": ..., "temperature": ...,
     "prompt_ids": [...], "tokens": [...], "reason": ...}

`draft-training collect --from-traces DIR` turns them into distillation records (the teacher's
distribution at every recorded position). Reading checks every file: its size, its fields, token
ids within the vocabulary; a bad file is named in the error.
"""

from __future__ import annotations

import itertools
import json
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edge_client.stats import GenerationResult

FORMAT = 1
MAX_RECORD_BYTES = 8 << 20
MAX_TOKENS = 1 << 16
_counter = itertools.count()


@dataclass(frozen=True)
class SessionRecord:
    """One recorded generation: the prompt's token ids and the tokens the target committed."""

    path: Path
    model_id: str
    vocab_fingerprint: str
    mode: str
    temperature: float
    prompt_ids: list[int]
    tokens: list[int]


class RecordError(Exception):
    """A session record cannot be written into the folder asked for; the message names it and why."""


def check_folder(folder: Path) -> None:
    """Make `folder` if it is missing and check that a record can be written in it (RecordError),
    so that a generation is not run for a record that cannot be kept."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".probe-"):
            pass
    except OSError as exc:
        raise _error(folder, exc) from None


def _error(folder: Path, exc: OSError) -> RecordError:
    why = "it is a file, not a folder" if folder.exists() and not folder.is_dir() else exc.strerror or exc
    return RecordError(f"cannot write session records into {folder}: {why}")


def write_record(
    folder: Path, gen: GenerationResult, model_id: str, fingerprint: str, mode: str, temperature: float
) -> Path:
    """Write one generation's record into `folder` (created); its path. RecordError when it cannot."""
    try:
        return _write(folder, gen, model_id, fingerprint, mode, temperature)
    except OSError as exc:
        raise _error(folder, exc) from None


def _write(
    folder: Path, gen: GenerationResult, model_id: str, fingerprint: str, mode: str, temperature: float
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = folder / f"{stamp}-{os.getpid()}-{next(_counter)}.json"
    while path.exists():  # an earlier process of the same id, in the same second: keep its record
        path = folder / f"{stamp}-{os.getpid()}-{next(_counter)}.json"
    doc = {
        "format": FORMAT,
        "model_id": model_id,
        "vocab_fingerprint": fingerprint,
        "mode": mode,
        "temperature": float(temperature),
        "prompt_ids": [int(t) for t in gen.prompt_tokens],
        "tokens": [int(t) for t in gen.tokens],
        "reason": gen.reason,
    }
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(doc) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def read_records(folder: Path, vocab_size: int) -> Iterator[SessionRecord]:
    """The records of `folder` (sorted by name), each checked; ValueError naming the bad file."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder of session records (generate --record)")
    for path in sorted(folder.glob("*.json")):
        yield _parse(path, vocab_size)


def _ids(doc: dict[str, Any], key: str, vocab_size: int, path: Path) -> list[int]:
    v = doc.get(key)
    if not isinstance(v, list) or len(v) > MAX_TOKENS:
        raise ValueError(f"{path}: {key!r} must be a list of at most {MAX_TOKENS} token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in v):
        raise ValueError(f"{path}: {key!r} holds a value that is not a token id in [0, {vocab_size})")
    return list(v)


def _parse(path: Path, vocab_size: int) -> SessionRecord:
    size = path.stat().st_size
    if size > MAX_RECORD_BYTES:
        raise ValueError(f"{path}: {size} bytes, more than a session record may hold ({MAX_RECORD_BYTES})")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a JSON session record ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{path}: not a session record of format {FORMAT}")
    prompt = _ids(doc, "prompt_ids", vocab_size, path)
    tokens = _ids(doc, "tokens", vocab_size, path)
    if not prompt:
        raise ValueError(f"{path}: 'prompt_ids' is empty")
    temperature = doc.get("temperature", 0.0)
    if not isinstance(temperature, (int, float)):
        raise ValueError(f"{path}: 'temperature' must be a number")
    return SessionRecord(
        path,
        str(doc.get("model_id", "")),
        str(doc.get("vocab_fingerprint", "")),
        str(doc.get("mode", "")),
        float(temperature),
        prompt,
        tokens,
    )
