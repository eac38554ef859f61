"""What the benches share: the prompt sets (shared/prompts.py, re-exported here), a verifier in
its own process pinned to its own cores, the edge pinned to the others (docs/architecture.md §6),
the verifier's counters, and the one shape of every bench: the common flags (`add_common_args`),
the result file (`write_result`: {"config", "rows", "complete"} and the bench's own keys) and a
plot's saving (`save_figure`)."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared.prompts import DATA as DATA
from shared.prompts import HUMANEVAL as HUMANEVAL
from shared.prompts import PROMPTS as PROMPTS
from shared.prompts import BenchPrompt as BenchPrompt
from shared.prompts import load_humaneval as load_humaneval
from shared.prompts import load_prompt_file as load_prompt_file
from shared.prompts import load_prompts as load_prompts
from shared.prompts import load_suite as load_suite

if TYPE_CHECKING:  # matplotlib loads only in the benches that draw
    from matplotlib.figure import Figure

REPO = Path(__file__).resolve().parents[1]


def add_prompt_file_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--prompt-file",
        type=Path,
        action="append",
        default=None,
        metavar="PATH",
        help="JSONL of your own prompts, used instead of the built-in sets (repeatable): lines of "
        'Spec-Bench\'s form {"question_id", "category", "turns"} (first turn, as a chat turn) or '
        'HumanEval\'s {"task_id", "prompt"} (raw)',
    )


# ------------------------------------------------------------------------- one shape of bench
RESULT_KEYS = ("config", "rows", "complete")  # the envelope of every result file (write_result)


def add_common_args(
    ap: argparse.ArgumentParser,
    *,
    json: bool = False,
    json_help: str = "",
    seed: int | None = None,
    seed_help: str = "",
    tokens: int | None = None,
    tokens_help: str = "",
    prompt_file: bool = False,
    no_progress: bool = False,
) -> None:
    """Declare the flags the benches share, with one name, metavar and help text everywhere; a module
    passes its defaults (`seed`, `tokens`; None: no flag) and what a flag means there (`*_help`):

      --json PATH         the result file, written with write_result (default: none written)
      --seed N            the run's seed (what it seeds: seed_help)
      --tokens N          tokens per prompt or generation (tokens_help)
      --prompt-file PATH  your own prompts instead of the built-in sets (suite_from_args)
      --no-progress       no progress bars (tqdm, on stderr)

    Which module takes which (tests/bench/test_harness_shape.py checks this table against every
    module's call, and that no module declares one of these flags itself):

      agreement         --json --tokens --prompt-file --no-progress
      chaos             --json --seed --tokens --no-progress
      cost_curve        --json --no-progress
      demo              --json --tokens
      draft_parallel    --json --prompt-file --no-progress
      drafter_cost      --json --no-progress
      e2e               --json --seed --tokens --prompt-file --no-progress
      fuzz              --json --seed --no-progress
      js_edge           --json --tokens --prompt-file --no-progress
      gpu_forward       --json --seed
      load              --json --seed --tokens --no-progress
      load_cost         --json --tokens --prompt-file --no-progress
      lookup_tau        --json --tokens --prompt-file --no-progress
      merged            --json --seed --tokens --prompt-file
      network           --json --tokens --prompt-file --no-progress
      offload           --json --tokens --prompt-file --no-progress
      onnx_drafter      --json
      outcomes          --json --tokens --prompt-file --no-progress
      parallel          --json --no-progress
      peers             --json --tokens --prompt-file
      prefill_share     --json --seed --tokens --no-progress
      quant_matmul      --json --no-progress
      round_files       --json
      serve             --json --seed --prompt-file --no-progress
      simulate          --json --no-progress
      soak              --json --seed --no-progress
      speculators       --json --tokens --prompt-file --no-progress
      target_step       --json --no-progress
      train_step        --json --no-progress
      tree_attention    --json --seed
      verifier_memory   --json
      verify_exactness  --json --seed --no-progress
      weights_agreement --json --tokens --prompt-file --no-progress

    Left out where it would mean nothing: --prompt-file where no prompt suite runs (kernel and forward
    micro-benchmarks, fuzz, soak, chaos and prefill_share on made-up tokens, load's own --prompt-dir,
    drafter_cost's one prompt, simulate's traces); --seed where nothing is drawn at random or seeds follow
    the prompt index (agreement, network, outcomes, load_cost); --no-progress where no bar is drawn. Not
    benches: gpu_check (its report goes through write_result), netproxy and the libraries (e2e_results,
    network_report, peers_report, load_clients, load_figures, llama_tools, proposer, serve_metrics)."""
    if json:
        what = "write the result to this JSON file ({config, rows, complete} and the bench's own keys)"
        help_ = f"{what}: {json_help}" if json_help else what
        ap.add_argument("--json", type=Path, default=None, metavar="PATH", help=help_)
    if seed is not None:
        ap.add_argument(
            "--seed", type=int, default=seed, metavar="N", help=f"seed: {seed_help}" if seed_help else "seed"
        )
    if tokens is not None:
        ap.add_argument(
            "--tokens", type=int, default=tokens, metavar="N", help=tokens_help or "new tokens per prompt"
        )
    if prompt_file:
        add_prompt_file_arg(ap)
    if no_progress:
        ap.add_argument("--no-progress", action="store_true", help="no progress bars (tqdm, on stderr)")


def _jsonable(value: object) -> object:
    """json's `default`: a path as its text, an enum as its value, a numpy scalar or array as its
    Python number or list; anything else it cannot hold is a TypeError naming the type."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, Enum):
        return value.value
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"a {type(value).__name__} cannot be written to JSON: {value!r:.80}")


def write_json(path: str | os.PathLike[str], doc: object, *, indent: int | None = None) -> Path:
    """Write a JSON file that is not a bench's result (a trace, recorded scripts, a curve file:
    the inputs of other benches, each with its own format): built whole first (paths as text),
    then replacing the file at once, its folder made. Result files go through write_result."""
    text = json.dumps(doc, indent=indent, default=_jsonable) + "\n"
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out)
    return out


def write_result(
    path: str | os.PathLike[str] | None,
    config: Mapping[str, object] | argparse.Namespace,
    rows: Sequence[Mapping[str, object]],
    complete: bool,
    /,
    **extra: object,
) -> Path | None:
    """Write a bench's result file (its --json): {"config": the run's settings (a Namespace is
    taken as vars()), "rows": the per-row results its table shows, "complete": True once every
    planned row has finished (False in a file rewritten as rows come in)}, then the bench's own
    keys (`extra`: whatever its earlier files held and its readers use). Nothing is written when
    `path` is None (no --json). Paths are written as text, enums as their values, numpy scalars
    and arrays as numbers and lists; NaN stays NaN (Python's json reads it). Returns the path.

    Refused before the file is touched (TypeError or ValueError): `complete` that is not a bool, a
    config that is not a mapping of str keys, rows that are not a list (or tuple) of mappings of
    str keys, an extra key that is one of RESULT_KEYS, a value JSON cannot hold."""
    cfg = vars(config) if isinstance(config, argparse.Namespace) else config
    if not isinstance(complete, bool):
        raise TypeError(f"complete must be a bool, got {type(complete).__name__}")
    if not isinstance(cfg, Mapping) or not all(isinstance(k, str) for k in cfg):
        raise TypeError(f"config must be a mapping of str keys, got {type(cfg).__name__}")
    if not isinstance(rows, (list, tuple)):
        raise TypeError(f"rows must be a list of mappings, got {type(rows).__name__}")
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping) or not all(isinstance(k, str) for k in row):
            raise TypeError(f"rows[{i}] must be a mapping of str keys, got {type(row).__name__}")
    clash = sorted(set(extra) & set(RESULT_KEYS))
    if clash:
        raise ValueError(f"{', '.join(clash)}: the envelope's own keys, not extra keys")
    if path is None:
        return None
    doc = {"config": dict(cfg), "rows": list(rows), "complete": complete, **extra}
    return write_json(path, doc, indent=2)


def figure_rows(figures: Mapping[str, object]) -> list[dict[str, object]]:
    """The rows of a figure / value table (chaos, fuzz, soak), as printed: one {figure, value} each."""
    return [{"figure": k, "value": v} for k, v in figures.items()]


def save_figure(fig: Figure, path: str | os.PathLike[str], *, dpi: int) -> Path:
    """The end of every bench's plot: tight layout, the folder made, the PNG written, the figure
    closed (pyplot keeps every open figure otherwise)."""
    import matplotlib.pyplot as plt

    out = Path(path)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    plt.close(fig)
    return out


def positive_ints(text: str) -> list[int]:
    """An argparse type: a comma list of positive integers, in the order given."""
    return _int_list(text, 1, "positive integers")


def nonnegative_ints(text: str) -> list[int]:
    """An argparse type: a comma list of integers >= 0 (e.g. round trips, 0 meaning direct)."""
    return _int_list(text, 0, "integers of 0 or more")


def _int_list(text: str, minimum: int, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < minimum:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
    return values


def suite_from_args(
    ap: argparse.ArgumentParser, humaneval: int, spec_bench: int, files: list[Path] | None
) -> list[BenchPrompt]:
    """The prompts of a benchmark run: every --prompt-file in order, else the built-in sets."""
    if not files:
        return load_suite(humaneval, spec_bench)
    try:
        return [p for f in files for p in load_prompt_file(f)]
    except ValueError as exc:
        ap.error(str(exc))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class CoreSplit:
    """Disjoint CPU sets for the edge (this process) and the verifier (a child process)."""

    edge: tuple[int, ...]
    verifier: tuple[int, ...]

    @classmethod
    def auto(cls) -> CoreSplit:
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
        if len(cores) < 2:
            return cls(tuple(cores), tuple(cores))
        half = max(1, len(cores) // 2)
        return cls(tuple(cores[:half]), tuple(cores[half:]))

    def describe(self) -> str:
        shared = " (shared: fewer than 2 cores)" if set(self.edge) & set(self.verifier) else ""
        return (
            f"CPU allocation: edge (drafter, 1 thread) on cores {list(self.edge)}, "
            f"verifier on cores {list(self.verifier)}{shared}"
        )

    def pin_edge(self) -> None:
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, set(self.edge))


def die_with_parent() -> None:
    """In a child before exec: ask Linux to end it when the bench dies (a crash must not leave a
    verifier holding 8 GB behind); a no-op elsewhere."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def read_runs(
    paths: Sequence[str], bench: str, key: str, kind: type, missing: str, same_run: Sequence[str]
) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, Any]]:
    """The `--json` files of one bench made in pieces (`--merge`): each (path, document), and the
    first file's config. A file that cannot be read, lacks `key` of type `kind` (`missing` says so)
    or was run with other settings (`same_run` keys of its config) is a ValueError naming it."""
    if not paths:
        raise ValueError("name at least one JSON file")
    docs: list[tuple[str, dict[str, Any]]] = []
    first: dict[str, Any] | None = None
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: cannot read a {bench} JSON file ({exc})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get(key), kind):
            raise ValueError(f"{path}: {missing}")
        cfg = doc.get("config") or {}
        if first is None:
            first = cfg
        diff = [k for k in same_run if cfg.get(k) != first.get(k)]
        if diff:
            raise ValueError(
                f"{path} was run with other settings than {paths[0]}: "
                + ", ".join(f"{k} {cfg.get(k)!r} vs {first.get(k)!r}" for k in diff)
            )
        docs.append((path, doc))
    assert first is not None
    return docs, first


def read_metrics(http: str) -> dict[str, float]:
    """Unlabelled Prometheus samples of the verifier at `http` (http://host:port), by name."""
    with urllib.request.urlopen(http + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for m in re.finditer(r"^([a-zA-Z_:][a-zA-Z0-9_:]*) ([0-9.eE+-]+)$", text, re.M):
        out[m.group(1)] = float(m.group(2))
    return out


@dataclass
class Verifier:
    """A `cloud-verifier serve` child process."""

    model: str
    cores: Sequence[int] = ()
    threads: int = 1
    args: Sequence[str] = ()
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None
    echo: bool = False  # show the child's output (progress bars of a first start) until it is ready
    _echoing: threading.Event = field(default_factory=threading.Event)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/session"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 600.0) -> Verifier:
        cmd = [
            sys.executable,
            "-m",
            "cloud_verifier",
            "serve",
            "--model",
            self.model,
            "--port",
            str(self.port),
            "--threads",
            str(self.threads),
            "--log-level",
            "warning",
            *self.args,
        ]
        cores = set(self.cores)

        def pin() -> None:
            if cores and hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(0, cores)
            die_with_parent()

        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"verifier-{self.port}.log"
        log = self.log_path.open("wb")
        env = dict(os.environ)
        if self.threads > 0:  # 0: the verifier's own default (OpenMP refuses OMP_NUM_THREADS=0)
            env["OMP_NUM_THREADS"] = str(self.threads)
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        out = subprocess.PIPE if self.echo else log
        self.proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=pin, cwd=REPO, env=env
        )
        if self.echo:
            self._echoing.set()
            threading.Thread(target=self._tee, args=(log,), daemon=True).start()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the verifier exited ({self.proc.returncode}); see {self.log_path}")
            try:
                with urllib.request.urlopen(self.http + "/readyz", timeout=2) as r:
                    if r.status == 200:
                        self._echoing.clear()
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the verifier was not ready within {timeout} s; see {self.log_path}")
            time.sleep(0.25)

    def _tee(self, log: Any) -> None:
        """Copy the child's output to its log, and to this terminal while starting (echo)."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while True:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            log.write(chunk)
            log.flush()
            if self._echoing.is_set():
                sys.stderr.buffer.write(chunk)
                sys.stderr.buffer.flush()
        log.close()

    def metrics(self) -> dict[str, float]:
        """Unlabelled Prometheus samples of the verifier, by name."""
        return read_metrics(self.http)

    def forwards(self) -> float:
        """Target forward passes so far (every engine step is one forward)."""
        return self.metrics().get("specdec_verify_forward_seconds_count", 0.0)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None

    def __enter__(self) -> Verifier:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    """A plain text table."""
    cells = [[str(h) for h in header]] + [
        [f"{c:.3f}" if isinstance(c, float) else str(c) for c in r] for r in rows
    ]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


@contextmanager
def served(app: Any) -> Iterator[int]:
    """Serve an ASGI app on uvicorn in a thread on a free loopback port until the block ends; yields
    the port (the browser edge's page in bench.js_edge, the edge's local endpoint in tests)."""
    import uvicorn

    # log_config=None: uvicorn's default config would leave handlers bound to the caller's stderr
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", log_config=None)
    )
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not start within 30 s")
        time.sleep(0.02)
    try:
        yield int(server.servers[0].sockets[0].getsockname()[1])
    finally:
        server.should_exit = True
        t.join(10)
