"""`--drafter auto`: draft with whichever backend is faster on this device, measured once.

On first use of a draft alias, `choose_backend` makes the ONNX int8 export of its GGUF (into the
model cache, `edge_client.onnx.export.ensure_export`, with a progress bar), loads the GGUF in
llama.cpp and the export in ONNX Runtime, and times both with the same short micro-benchmark:
after a fixed prompt of PROMPT_TOKENS tokens, one evaluation of 1 row (a decode step) and one of 8
rows (a tree level of 8 children of the committed end), WARMUP untimed rounds then REPEATS timed
ones, the backends interleaved round by round so that a change in the machine's load hits both.
Each figure is the median ms of its evaluations.

The rule (`pick_backend`): the decisive figure of a backend is ms(1 row) + ms(8 rows), the cost of
one decode step plus one wide tree level; a round of drafting is made of both (syncing the bonus
token and the narrow levels of the main tree are 1-2 rows, the levels of conditional trees drafted
together are many). The backend with the lower figure wins; one within TIE of llama.cpp's figure
does not, so noise never switches a device to the backend that needs a second copy of the model.

The decision and the figures are written beside the export, in a file keyed by what they depend
on (`device_key`: the CPU's model name and flags, the core count, the drafter's thread count, the
versions of llama-cpp-python, onnxruntime and numpy, the benchmark's version); another machine or
an upgrade measures again. The decision is printed once, when it is measured. Without onnxruntime,
or when the export fails, auto drafts with llama.cpp and says why in one line (a failed export is
remembered under the same key, so it is not tried at every start).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from edge_client.drafters.base import Drafter
from shared.gguf_check import GGUFError
from shared.model_store.verify import locked

log = logging.getLogger(__name__)

AUTO = "auto"
LLAMA_CPP = "llama_cpp"
ONNX = "onnx"
ROWS = (1, 8)  # rows per evaluation that are timed
WARMUP = 2  # untimed rounds (the first evaluations of a session allocate and page weights in)
REPEATS = 7  # timed rounds; each figure is the median of REPEATS
TIE = 0.03  # ONNX must beat llama.cpp's figure by more than 3% to be chosen
PROMPT_TOKENS = 96
BENCH_VERSION = 1  # bump when the micro-benchmark or the rule changes: every device measures again
PROMPT = (
    "def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:\n"
    '    """Merge overlapping closed intervals and return them sorted by start."""\n'
    "    result: list[tuple[int, int]] = []\n"
    "    for start, end in sorted(intervals):\n"
    "        if result and start <= result[-1][1]:\n"
    "            result[-1] = (result[-1][0], max(result[-1][1], end))\n"
    "        else:\n"
    "            result.append((start, end))\n"
    "    return result\n\n\n"
    "def test_merge_intervals() -> None:\n"
    "    assert merge_intervals([(1, 3), (2, 6), (8, 10), (15, 18)]) == [(1, 6), (8, 10), (15, 18)]\n"
)

Figures = dict[str, dict[int, float]]  # backend -> rows -> median ms of one evaluation


def decisive_ms(ms: Mapping[int, float]) -> float:
    """The figure the rule compares: ms of a 1-row evaluation plus ms of an 8-row evaluation."""
    return ms[1] + ms[8]


def pick_backend(figures: Mapping[str, Mapping[int, float]], *, prefer: str = LLAMA_CPP) -> str:
    """The backend with the lowest `decisive_ms`; `prefer` (when measured) keeps the choice unless
    another is faster by more than TIE."""
    if not figures:
        raise ValueError("no backend was measured")
    best = min(figures, key=lambda name: decisive_ms(figures[name]))
    if prefer in figures and decisive_ms(figures[best]) >= (1 - TIE) * decisive_ms(figures[prefer]):
        return prefer
    return best


@dataclass(frozen=True)
class Choice:
    """What auto decided for one draft: the backend, why, and the figures (None: not measured)."""

    backend: str
    reason: str
    threads: int
    figures: Figures | None = None
    cached: bool = False
    options: dict[str, Any] = field(default_factory=dict)  # extra constructor options of `backend`


def device_key(threads: int) -> dict[str, str]:
    """What the measured figures depend on besides the model: the CPU, the threads, the versions."""
    cpu, flags = "", ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
        for line in f:  # the first processor's model name and flags (Features on ARM)
            name, _, value = line.partition(":")
            if name.strip() == "model name" and not cpu:
                cpu = value.strip()
            elif name.strip() in ("flags", "Features") and not flags:
                flags = " ".join(sorted(value.split()))
    cpu = cpu or platform.processor() or platform.machine()
    return {
        "cpu": cpu,
        "cpu_flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
        "cores": str(os.cpu_count() or 1),
        "threads": str(threads),
        "machine": platform.machine(),
        "llama_cpp_python": _version("llama_cpp_python"),
        "onnxruntime": _version("onnxruntime"),
        "numpy": _version("numpy"),
        "bench": str(BENCH_VERSION),
    }


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "none"


def decision_path(export_folder: Path, key: Mapping[str, str]) -> Path:
    """The file beside `export_folder` holding the decision measured under `key`."""
    digest = hashlib.sha256(json.dumps(dict(key), sort_keys=True).encode()).hexdigest()[:16]
    return export_folder.with_name(f"{export_folder.name}.auto-{digest}.json")


def read_decision(path: Path, key: Mapping[str, str]) -> dict[str, Any] | None:
    """The cached decision at `path` if it was measured under exactly `key`, else None."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if (
        not isinstance(raw, dict)
        or raw.get("key") != dict(key)
        or raw.get("backend") not in (LLAMA_CPP, ONNX)
    ):
        return None
    return raw


def write_decision(path: Path, record: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(dict(record), indent=1), encoding="utf-8")
    os.replace(tmp, path)


def time_evaluations(
    drafters: Mapping[str, Drafter],
    *,
    rows: Sequence[int] = ROWS,
    warmup: int = WARMUP,
    repeats: int = REPEATS,
    clock: Callable[[], float] = time.perf_counter,
) -> Figures:
    """Median ms of one evaluation of each row count, per drafter (the micro-benchmark).

    Every drafter is synced to the same prompt (PROMPT, cut to PROMPT_TOKENS tokens of its own
    tokenizer); an evaluation of n rows is `extend` of n children of the committed end (its n
    likeliest tokens), timed alone, then dropped. Rounds interleave the drafters."""
    prompts: dict[str, list[int]] = {}
    tops: dict[str, list[int]] = {}
    for name, d in drafters.items():
        ids = d.tokenizer.encode(PROMPT)[:PROMPT_TOKENS]
        prompts[name] = ids
        tops[name] = [int(t) for t in np.argsort(-d.sync(ids))[: max(rows)]]
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in rows} for name in drafters}
    for r in range(warmup + repeats):
        for name, d in drafters.items():
            for n in rows:
                d.sync(prompts[name])  # drops the last level; the prompt stays cached
                t0 = clock()
                d.extend([-1] * n, tops[name][:n])
                if r >= warmup:
                    times[name][n].append((clock() - t0) * 1e3)
    return {
        name: {n: round(statistics.median(ts), 3) for n, ts in per.items()} for name, per in times.items()
    }


def measure_backends(model: str, export_folder: Path, threads: int) -> Figures:
    """Load `model` in llama.cpp and its export in ONNX Runtime, time both (`time_evaluations`)."""
    from edge_client.drafters.llama_cpp import LlamaCppDrafter
    from edge_client.drafters.onnx_drafter import OnnxDrafter

    drafters: dict[str, Drafter] = {}
    try:
        drafters[LLAMA_CPP] = LlamaCppDrafter(
            model, n_threads=threads, max_context=256, max_nodes=16, max_leaves=8
        )
        drafters[ONNX] = OnnxDrafter(
            export_folder, int8=True, n_threads=threads, max_context=256, max_nodes=16, max_leaves=8
        )
        return time_evaluations(drafters)
    finally:
        for d in drafters.values():
            d.close()


def _export_int8(model: str) -> Path:
    from edge_client.onnx.export import ensure_export

    return ensure_export(model, int8=True, progress=True)


def _int8_folder(model: str) -> Path:
    from edge_client.onnx.export import cache_folder

    return cache_folder(model, int8=True)


def _say(line: str) -> None:
    print(f"edge-client: --drafter auto: {line}", file=sys.stderr, flush=True)


def _default_threads() -> int:
    from edge_client.drafters.llama_cpp import default_threads

    return default_threads()


def _summary(figures: Mapping[str, Mapping[int, float]]) -> str:
    names = {LLAMA_CPP: "llama.cpp", ONNX: "ONNX int8"}
    return ", ".join(
        f"{names.get(b, b)} {ms[1]:.1f} + {ms[8]:.1f} = {decisive_ms(ms):.1f}" for b, ms in figures.items()
    )


def choose_backend(
    model: str,
    *,
    n_threads: int | None = None,
    import_module: Callable[[str], ModuleType] = importlib.import_module,
    export: Callable[[str], Path] = _export_int8,
    folder_of: Callable[[str], Path] = _int8_folder,
    measure: Callable[[str, Path, int], Figures] = measure_backends,
    key: Callable[[int], dict[str, str]] = device_key,
    say: Callable[[str], None] = _say,
) -> Choice:
    """The backend `auto` drafts `model` with (see the module docstring).

    model: a draft alias is exported, measured and decided (cached); an `export-onnx` folder can
    only be run by ONNX Runtime; anything else (a GGUF path) drafts with llama.cpp.
    n_threads: the drafter's threads, measured with (default: llama.cpp's default for this CPU).
    The other parameters replace the steps (for tests): importing a package, making the export,
    where the export lives, the micro-benchmark, the device key, and where the one line goes."""
    unmeasured = _unmeasured_choice(model, n_threads, import_module, say)
    if unmeasured is not None:
        return unmeasured
    threads = n_threads or _default_threads()
    k = key(threads)
    path = decision_path(folder_of(model), k)
    cached = read_decision(path, k)
    if cached is not None:
        figures = _figures(cached.get("figures"))
        log.info(
            "--drafter auto: %s for %s (%s, cached in %s)", cached["backend"], model, cached["reason"], path
        )
        return _choice(cached["backend"], str(cached["reason"]), threads, figures, cached=True)
    try:
        folder = export(model)
    except GGUFError:  # the file itself is malformed: no backend can draft with it, nothing to remember
        raise
    except ImportError as exc:  # torch or onnx missing: nothing to remember, installing fixes it
        reason = f"the ONNX export needs torch and onnx ({exc}): pip install 'treespec[cloud,onnx]'"
        say(f"drafting with llama.cpp: {reason}")
        return Choice(LLAMA_CPP, reason, threads)
    except Exception as exc:  # any failure: an unsupported model, no memory, no disk space
        reason = f"the ONNX export of {model} failed ({type(exc).__name__}: {exc})"
        return _remember_llama_cpp(path, k, reason, threads, say)
    return _measure_and_decide(model, folder, threads, k, measure, say)


def _unmeasured_choice(
    model: str, n_threads: int | None, import_module: Callable[[str], ModuleType], say: Callable[[str], None]
) -> Choice | None:
    """The choice when there is nothing to measure: an export folder (ONNX), not a draft alias
    (llama.cpp), onnxruntime or llama-cpp-python missing (the other); None: measure (or read the
    decision measured before)."""
    from edge_client.models import DRAFT_ALIASES

    if Path(model).is_dir():
        return Choice(ONNX, f"{model} is an ONNX export folder", n_threads or 1)
    if model not in DRAFT_ALIASES:
        return Choice(LLAMA_CPP, f"{model} is not a draft alias (auto exports only aliases)", 0)
    try:
        import_module("onnxruntime")
    except ImportError as exc:
        reason = f"onnxruntime is not installed ({exc}); pip install 'treespec[onnx]' to let auto try it"
        say(f"drafting with llama.cpp: {reason}")
        return Choice(LLAMA_CPP, reason, 0)
    try:
        import_module("llama_cpp")
    except ImportError as exc:
        reason = f"llama-cpp-python is not installed ({exc}): nothing to compare ONNX Runtime with"
        say(f"drafting with ONNX Runtime: {reason}")
        return Choice(ONNX, reason, n_threads or 1, options={"int8": True})
    return None


def _remember_llama_cpp(
    path: Path, k: dict[str, str], reason: str, threads: int, say: Callable[[str], None]
) -> Choice:
    """Draft with llama.cpp because the export failed or could not be run, and remember it in the
    decision file `path` (so it is not tried at every start)."""
    say(f"drafting with llama.cpp: {reason}; remembered in {path} (delete it to try again)")
    write_decision(path, {"key": k, "backend": LLAMA_CPP, "reason": reason, "figures": None})
    return Choice(LLAMA_CPP, reason, threads)


def _measure_and_decide(
    model: str,
    folder: Path,
    threads: int,
    k: dict[str, str],
    measure: Callable[[str, Path, int], Figures],
    say: Callable[[str], None],
) -> Choice:
    """Time both backends on the export in `folder` and decide (`pick_backend`), once for every
    process starting at once (a lock on the decision file); the decision written beside the export
    and said in one line."""
    path = decision_path(folder, k)
    with locked(path):  # two processes starting at once: one measures, the other reads its result
        cached = read_decision(path, k)
        if cached is not None:
            return _choice(
                cached["backend"], str(cached["reason"]), threads, _figures(cached["figures"]), cached=True
            )
        say(f"timing llama.cpp against ONNX Runtime on this device ({threads} thread(s), a few seconds)")
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        try:
            figures = measure(model, folder, threads)
        except Exception as exc:  # e.g. an onnxruntime too old for the export's 8-bit MatMulNBits
            reason = f"the ONNX export of {model} could not be run ({type(exc).__name__}: {exc})"
            return _remember_llama_cpp(path, k, reason, threads, say)
        backend = pick_backend(figures)
        reason = f"median ms of a 1-row + an 8-row evaluation: {_summary(figures)}"
        busy = load > (os.cpu_count() or 1) - 0.5
        record = {
            "key": k,
            "backend": backend,
            "reason": reason,
            "figures": {b: {str(n): ms for n, ms in per.items()} for b, per in figures.items()},
            "rule": f"lowest ms(1 row) + ms(8 rows); ONNX only when more than {TIE:.0%} below llama.cpp",
            "model": model,
            "load_before": round(load, 2),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        write_decision(path, record)
    say(
        f"{model}: drafting with {'ONNX Runtime (int8)' if backend == ONNX else 'llama.cpp'} ({reason})"
        + (f"; the machine was busy (load {load:.1f}): delete the file to measure again" if busy else "")
        + f"; cached in {path}"
    )
    return _choice(backend, reason, threads, figures, cached=False)


def _choice(backend: str, reason: str, threads: int, figures: Figures | None, *, cached: bool) -> Choice:
    options = {"int8": True} if backend == ONNX else {}
    return Choice(backend, reason, threads, figures, cached, options)


def _figures(raw: object) -> Figures | None:
    if not isinstance(raw, dict):
        return None
    try:
        return {str(b): {int(n): float(ms) for n, ms in per.items()} for b, per in raw.items()}
    except (AttributeError, TypeError, ValueError):
        return None
