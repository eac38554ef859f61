"""`TPGroup`: this process's place in the tensor-parallel group: the command channel, the
collectives of a forward, and the group's liveness; `current()` is the group `start` or `join`
made.

A rank that dies is noticed by rank 0 (it watches the processes it started, and any failed or
timed-out collective counts): one log line, /readyz 503 (`TPGroup.alive` is one of the engine's
health checks), and every later forward fails at once with that reason, so sessions get an error
instead of hanging.

On NCCL a collective with a dead peer may never fail by itself, so: rank 0's monitor still watches
the workers it started (a death is noticed within 0.1 s, /readyz 503, and the group's NCCL
communicators are aborted, which ends kernels stuck on the dead peer); every collective of a
forward has the step timeout (STEP_TIMEOUT_S) in NCCL's watchdog, and rank 0's commands the join
timeout; rank 0 sets TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (unless set: abort the communicators on an
error or timeout but keep the process, so the service stays up to answer 503) and workers keep
torch's default (3: a worker whose collective fails or times out exits, which rank 0 sees). Under
torchrun nobody watches the processes: a dead worker is noticed by rank 0's next command, when its
collectives fail or time out (JOIN_TIMEOUT_S at worst) - run it under a supervisor that restarts
the group. The all-reduces are asynchronous on the host (no TORCH_NCCL_BLOCKING_WAIT: that would
sync the host at every layer); a worker syncs once a command (the header, then the payload, read
back to the host).
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from cloud_verifier.parallel.devices import CPU, backend_for
from cloud_verifier.parallel.protocol import (
    HEADER,
    Op,
    TensorParallelError,
    pack_command,
    payload_size,
    unpack_payload,
)

log = logging.getLogger("cloud_verifier.parallel")

JOIN_TIMEOUT_S = 120.0  # every rank must reach the rendezvous within this
STEP_TIMEOUT_S = 60.0  # one collective inside a forward (a hung rank fails the step after this)
IDLE_TIMEOUT = timedelta(days=365)  # workers wait for the next command as long as the service is idle


class TPGroup:
    """This process's place in the group: the command channel, the step collectives, liveness."""

    def __init__(
        self,
        rank: int,
        world: int,
        procs: Sequence[subprocess.Popen[bytes]] = (),
        device: torch.device = CPU,
    ) -> None:
        self.rank = rank
        self.world = world
        self.procs = list(procs)  # ranks 1.. when this process started them
        self.device = device  # every tensor of a collective lives here
        self.backend = backend_for(device)
        # workers wait for commands as long as the service is idle; collectives inside a forward
        # time out. On NCCL rank 0's sends time out too (a broadcast there waits for every receiver).
        cmd_timeout = IDLE_TIMEOUT
        if rank == 0 and self.backend == "nccl":
            cmd_timeout = timedelta(seconds=JOIN_TIMEOUT_S)
        self.cmd = dist.new_group(backend=self.backend, timeout=cmd_timeout)
        self.step = dist.new_group(backend=self.backend, timeout=timedelta(seconds=STEP_TIMEOUT_S))
        self.lock = threading.RLock()
        self.idle = threading.Condition(self.lock)
        self.forwarding = False
        self.deferred: list[tuple[Callable[[], None], Op, int, list[int]]] = []
        self.dropped: list[int] = []  # caches garbage-collected on rank 0, dropped on the next send
        self.error: str | None = None
        self.closing = False
        self._next_cache = 0
        self._monitor: threading.Thread | None = None
        if self.procs:
            self._monitor = threading.Thread(target=self._watch, name="tp-monitor", daemon=True)
            self._monitor.start()

    def alive(self) -> bool:
        return self.error is None

    def fail(self, reason: str) -> None:
        """Mark the group broken (once): log the reason and stop the other ranks."""
        with self.lock:
            if self.error is not None or self.closing:
                return
            self.error = reason
        log.error("%s", reason)
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        if self.backend == "nccl":  # end kernels waiting on the dead peer (gloo's fail by themselves)
            for pg in (self.cmd, self.step):
                with contextlib.suppress(Exception):
                    pg.abort()

    def check(self) -> None:
        if self.error is not None:
            raise TensorParallelError(self.error)

    def _dead_rank(self, wait_s: float = 0.0) -> str | None:
        """'rank r died: exit code c' for the first worker of ours that has exited (waiting up to
        wait_s for one: a collective usually fails a moment before the process is reaped)."""
        deadline = time.monotonic() + wait_s
        while True:
            for r, p in enumerate(self.procs, start=1):
                if p.poll() is not None:
                    return (
                        f"tensor-parallel rank {r} died: exit code {p.returncode}; the verifier is not ready"
                    )
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    def _watch(self) -> None:
        while not self.closing and self.error is None:
            reason = self._dead_rank()
            if reason is not None and not self.closing:
                self.fail(reason)
                return
            time.sleep(0.1)

    def _collective(self, what: str, fn: Callable[[], object]) -> None:
        self.check()
        try:
            fn()
        except Exception as exc:
            reason = self._dead_rank(wait_s=1.0) if self.procs else None
            self.fail(
                reason
                or f"tensor-parallel {what} failed on rank {self.rank}: {exc}; the verifier is not ready"
            )
            raise TensorParallelError(self.error or str(exc)) from exc

    # -- rank 0: commands
    def send(
        self,
        op: Op,
        cache: int = -1,
        args: Sequence[int] = (),
        ints: Sequence[int] | torch.Tensor = (),
        data: torch.Tensor | None = None,
    ) -> None:
        """Broadcast one command (rank 0; the caller holds the lock)."""
        while self.dropped:
            self._send(Op.DROP_CACHE, self.dropped.pop(), (), torch.empty(0, dtype=torch.int64), None)
        payload = (
            torch.as_tensor(list(ints), dtype=torch.int64) if not isinstance(ints, torch.Tensor) else ints
        )
        self._send(op, cache, args, payload, data)

    def _send(
        self, op: Op, cache: int, args: Sequence[int], ints: torch.Tensor, data: torch.Tensor | None
    ) -> None:
        buf = pack_command(op, cache, args, ints, data, self.device)

        def go() -> None:
            dist.broadcast(buf[: 8 * HEADER], 0, group=self.cmd)
            if buf.numel() > 8 * HEADER:
                dist.broadcast(buf[8 * HEADER :], 0, group=self.cmd)

        self._collective(f"command {op.name}", go)

    def new_cache_id(self) -> int:
        self._next_cache += 1
        return self._next_cache

    # -- ranks > 0: commands
    def receive(self) -> tuple[Op, int, list[int], torch.Tensor, torch.Tensor]:
        """The next command: (op, cache, [a0..a3], int64 payload, uint8 payload)."""
        header = torch.empty(8 * HEADER, dtype=torch.uint8, device=self.device)
        dist.broadcast(header, 0, group=self.cmd)
        host = header.to(CPU)  # (the worker's one wait for rank 0)
        payload = torch.empty(payload_size(host), dtype=torch.uint8, device=self.device)
        if payload.numel():
            dist.broadcast(payload, 0, group=self.cmd)
        return unpack_payload(host, payload.to(CPU))

    # -- every rank: the forward's collectives
    def all_reduce(self, t: torch.Tensor) -> None:
        self._collective("all-reduce", lambda: dist.all_reduce(t, group=self.step))

    def gather_logits(self, vocab: int) -> Callable[[torch.Tensor], torch.Tensor]:
        """The head's hook: [k, shard] on every rank -> [k, vocab] on rank 0 (the shard itself elsewhere)."""
        shard = -(-vocab // self.world)

        def gather(logits: torch.Tensor) -> torch.Tensor:
            if logits.shape[1] < shard:  # the last rank's shard is short when N does not divide V
                logits = torch.nn.functional.pad(logits, (0, shard - logits.shape[1]))
            logits = logits.contiguous()
            if self.rank != 0:
                self._collective("logit gather", lambda: dist.gather(logits, None, dst=0, group=self.step))
                return logits
            parts = [torch.empty_like(logits) for _ in range(self.world)]
            self._collective("logit gather", lambda: dist.gather(logits, parts, dst=0, group=self.step))
            return torch.cat(parts, dim=1)[:, :vocab]

        return gather

    # -- shutdown
    def close(self) -> None:
        """Rank 0: stop the workers and leave the group (idempotent)."""
        if self.closing:
            return
        if self.rank == 0 and self.error is None:
            with self.lock:
                try:
                    self.send(Op.STOP)
                except TensorParallelError:
                    pass
        self.closing = True
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
        global _GROUP
        if _GROUP is self:
            _GROUP = None


_GROUP: TPGroup | None = None


def current() -> TPGroup | None:
    """This process's group, once `start` or `join` made one."""
    return _GROUP


def set_current(group: TPGroup) -> TPGroup:
    """Make `group` this process's group (`start`, `join`); `TPGroup.close` forgets it."""
    global _GROUP
    _GROUP = group
    return group
