"""Processes and servers of the benches: a verifier in its own process pinned to its own cores
(`Verifier`), the edge pinned to the others (`CoreSplit`, docs/architecture.md §6), a TCP delay
proxy in its own process (`Proxy`), an ASGI app served in a thread (`served`), the verifier's
counters (`read_metrics`)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


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


def pinned(cores: Iterable[int]) -> Callable[[], None]:
    """A child's preexec_fn: pin it to `cores` (none: leave it) and end it with the bench
    (die_with_parent)."""
    chosen = set(cores)

    def pin() -> None:
        if chosen and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, chosen)
        die_with_parent()

    return pin


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
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"verifier-{self.port}.log"
        log = self.log_path.open("wb")
        env = dict(os.environ)
        if self.threads > 0:  # 0: the verifier's own default (OpenMP refuses OMP_NUM_THREADS=0)
            env["OMP_NUM_THREADS"] = str(self.threads)
        out = subprocess.PIPE if self.echo else log
        self.proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, preexec_fn=pinned(self.cores), cwd=REPO, env=env
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


@contextmanager
def served(app: Any) -> Iterator[int]:
    """Serve an ASGI app on uvicorn in a thread on a free loopback port until the block ends; yields
    the port (the browser edge's page in bench.end_to_end.js_edge, the edge's local endpoint in tests)."""
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


class Proxy:
    """`python -m bench.tools.netproxy` in its own process, on the edge's cores."""

    def __init__(
        self, target_port: int, rtt_ms: float, jitter_ms: float, mbps: float, cores: Sequence[int]
    ) -> None:
        self.port = free_port()
        self.cmd = [
            sys.executable,
            "-m",
            "bench.tools.netproxy",
            "--listen",
            f"127.0.0.1:{self.port}",
            "--target",
            f"127.0.0.1:{target_port}",
            "--delay-ms",
            str(rtt_ms / 2),
            "--jitter-ms",
            str(jitter_ms),
            "--bandwidth-mbps",
            str(mbps),
        ]
        self.cores = set(cores)
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Proxy:
        self.proc = subprocess.Popen(
            self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=pinned(self.cores)
        )
        deadline = time.monotonic() + 20
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return self
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("the delay proxy did not start") from None
                time.sleep(0.05)

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/session"
