"""Tensor parallelism of the target (Megatron-LM's layout) over torch.distributed: gloo on CPUs,
NCCL on CUDA GPUs (one GPU a rank).

Layout, for N ranks, rank r (GQA groups stay whole on a rank, so attention needs no communication):
  * q heads [r H/N, (r+1) H/N) and KV heads [r KV/N, (r+1) KV/N): the matching rows of the fused
    qkv weight and bias (column-parallel q/k/v), the matching columns of o (row-parallel);
  * gate and up rows [r I/N, (r+1) I/N), kept fused as [gate_r | up_r] (column-parallel), the
    matching columns of down (row-parallel);
  * one all-reduce (sum) of the [T, hidden] partial output after o and one after down per layer
    (the `all_reduce` hook of LlamaModel); norms, embeddings and rotary tables are replicated;
  * the head is VOCAB-PARALLEL: rank r computes the logits of vocabulary rows [r V/N, (r+1) V/N)
    and they are gathered to rank 0 (the only rank that needs them). Why not a head replicated on
    rank 0: the head is the largest single matrix of a small model (Qwen2.5-0.5B: 136M of its
    494M parameters, 15-40% of a verify forward), so on rank 0 alone it would leave the other
    ranks idle for that share of every step and hold its packed copy (0.54 GB fp32) on rank 0
    only; sharded, every rank does 1/N of it and packs 1/N of it, for one gather of
    [rows, V/N] float32 per rank (1.2 MB a rank at 4 rows: far cheaper than the matmul it splits);
  * each rank keeps its own PagedKVCache holding its KV heads, with the SAME block tables.

Rank 0 runs the service and the engine. Its model (`ShardedLlamaModel`) and KV cache
(`ShardedKVCache`) broadcast a compact command before doing the same locally: a 64-byte header
(int64 [op, cache, n_ints, n_bytes, a0..a3]), then one byte payload holding the int64 words and
the mask bytes (no pickle; `pack_command`, built in one host buffer, pinned on CUDA, and copied
to the rank's device once: two broadcasts and one host->device copy a command); ranks > 0 run
`worker_loop`, which applies each command to their shard. Every KV-mutating call (add, free,
discard, truncate, commit_rows; reserve and write happen inside the forward on every rank) is
therefore applied in one order on every rank, and block allocation, being deterministic, gives
the same tables. The engine frees and adds sessions on its event-loop thread while a forward runs
on its worker thread: those calls are applied to rank 0's bookkeeping at once but sent after the
forward, and a freed session's blocks return to rank 0's free list only then, so that the forward's
allocation sees on every rank the free list it saw on rank 0.

Devices (`select_device`): on CPU every rank uses gloo; with --device cuda (or auto where CUDA
is available) every rank uses NCCL on `cuda:{LOCAL_RANK}` (the workers `serve` starts get LOCAL_RANK
= RANK; torchrun sets it), and every tensor of a collective lives there: the command buffers, the
all-reduced [T, hidden] partial sums, the logit shards and the cache-check flag. Sharded weights are
loaded on the rank's device in --dtype (the full model is loaded there first, then sliced and its
layers freed one by one: the peak is one full model a GPU), the KV cache of each rank is on its
device, and attention is chosen as at TP=1 (Triton on CUDA). The all-reduces are asynchronous on
the host (no TORCH_NCCL_BLOCKING_WAIT: that would sync the host at every layer); a worker syncs once
a command (the header, then the payload, read back to the host). Starting N workers on CUDA needs
N visible GPUs (refused otherwise, with torch.cuda.device_count()).

`cloud-verifier serve --tensor-parallel N` starts ranks 1..N-1 itself (`python -m
cloud_verifier.parallel`, rendezvous on a free loopback port, `--threads` split between ranks);
under `torchrun` (RANK, WORLD_SIZE, MASTER_ADDR set) every rank runs `serve` and ranks > 0 turn
into workers. A rank that dies is noticed by rank 0 (it watches the processes it started, and any
failed or timed-out collective counts): one log line, /readyz 503 (`TPGroup.alive` is one of the
engine's health checks), and every later forward fails at once with that reason, so sessions get
an error instead of hanging.

On NCCL a collective with a dead peer may never fail by itself, so: rank 0's monitor still watches
the workers it started (a death is noticed within 0.1 s, /readyz 503, and the group's NCCL
communicators are aborted, which ends kernels stuck on the dead peer); every collective of a
forward has the step timeout (STEP_TIMEOUT_S) in NCCL's watchdog, and rank 0's commands the join
timeout; rank 0 sets TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (unless set: abort the communicators on an
error or timeout but keep the process, so the service stays up to answer 503) and workers keep
torch's default (3: a worker whose collective fails or times out exits, which rank 0 sees). Under
torchrun nobody watches the processes: a dead worker is noticed by rank 0's next command, when its
collectives fail or time out (JOIN_TIMEOUT_S at worst) - run it under a supervisor that restarts
the group. (None of this has run on GPUs yet: see tests/cloud_verifier/test_parallel_cuda.py.)
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from cloud_verifier.config import ServerConfig
from cloud_verifier.kv_cache import PagedKVCache
from cloud_verifier.model import gemm
from cloud_verifier.model.config import ModelConfig, make_tiny_config
from cloud_verifier.model.llama import ATTENTION_MODES, DecoderLayer, LlamaModel, SeqInput, check_input
from cloud_verifier.model.target import Target, load_target
from cloud_verifier.model.weights import build_model, resolve_device, resolve_dtype

CPU = torch.device("cpu")

log = logging.getLogger("cloud_verifier.parallel")

HEADER = 8  # int64 words of a command header: op, cache, n_ints, n_bytes, a0, a1, a2, a3
MAX_INTS = 1 << 22  # int64 words of one command's payload (a forward of 512 rows needs ~1,600)
MAX_BYTES = 1 << 24  # mask bytes of one forward (a 4,096-row tree: 16 MiB)
JOIN_TIMEOUT_S = 120.0  # every rank must reach the rendezvous within this
STEP_TIMEOUT_S = 60.0  # one collective inside a forward (a hung rank fails the step after this)
IDLE_TIMEOUT = timedelta(days=365)  # workers wait for the next command as long as the service is idle


class Op(enum.IntEnum):
    STOP = 0
    NEW_CACHE = 1  # a0 num_blocks, a1 block_size
    DROP_CACHE = 2
    ADD = 3  # a0 seq
    FREE = 4  # a0 seq
    DISCARD = 5  # a0 seq
    TRUNCATE = 6  # a0 seq, a1 length
    COMMIT_ROWS = 7  # a0 seq; ints: keep
    FORWARD = 8  # ints, bytes: encode_inputs
    SET_ATTENTION = 9  # a0 index in ATTENTION_MODES
    SET_GEMM = 10  # a0 index in gemm.KINDS
    CHECK_CACHE = 11  # ints: rank 0's `cache_digest`; every rank answers whether its own equals it


class TensorParallelError(RuntimeError):
    """The tensor-parallel group is broken (a rank died or a collective failed or timed out)."""


def check_shardable(config: ModelConfig, world: int, model: str) -> None:
    """Refuse a split that would cut a GQA group, a head or an MLP row block across ranks."""
    if world < 1:
        raise ValueError(f"--tensor-parallel must be at least 1, got {world}")
    for what, n in (
        ("num_kv_heads", config.num_kv_heads),
        ("num_heads", config.num_heads),
        ("intermediate_size", config.intermediate_size),
    ):
        if n % world:
            raise ValueError(
                f"model {model!r} cannot be split over {world} tensor-parallel ranks: its {what} ({n}) "
                f"is not a multiple of {world}; use --tensor-parallel N with N dividing {config.num_kv_heads}"
            )


# ---------------------------------------------------------------------------------------- devices
def backend_for(device: torch.device) -> str:
    """The collective backend of a rank on `device`: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def local_rank(rank: int) -> int:
    """This process's GPU index among the ranks on its machine: LOCAL_RANK (torchrun, or `start`)."""
    raw = os.environ.get("LOCAL_RANK", str(rank))
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"LOCAL_RANK must be an integer, got {raw!r}") from None


def select_device(device: str, rank: int, world: int, local: int, spawning: bool = False) -> torch.device:
    """The device of rank `rank` of `world` for --device `device` (auto: CUDA when available):
    the CPU, or `cuda:{local}` (one GPU a rank). `spawning`: this process is about to start all
    `world` ranks on this machine, so `world` GPUs must be visible."""
    dev = resolve_device(device)
    if dev.type == "cpu":
        return CPU
    if dev.type != "cuda":
        raise ValueError(f"tensor parallelism runs on CPUs (gloo) or CUDA GPUs (NCCL), not --device {device}")
    if dev.index is not None:
        raise ValueError(
            f"--device {device} with --tensor-parallel: give --device cuda; rank r uses cuda:LOCAL_RANK "
            "(restrict the GPUs with CUDA_VISIBLE_DEVICES)"
        )
    if not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available here; use --device cpu")
    count = torch.cuda.device_count()
    if spawning and count < world:
        raise ValueError(
            f"--tensor-parallel {world} on CUDA needs {world} GPUs (one a rank), but "
            f"torch.cuda.device_count() is {count}; use --tensor-parallel {count} or fewer, or --device cpu"
        )
    if not 0 <= local < count:
        raise ValueError(
            f"tensor-parallel rank {rank} needs GPU cuda:{local} (its LOCAL_RANK), but "
            f"torch.cuda.device_count() is {count}"
        )
    return torch.device("cuda", local)


def _nccl_error_handling(rank: int) -> None:
    """Rank 0 keeps its process when a collective fails (abort the communicators, raise): the
    service answers 503. Workers keep torch's default (tear the process down)."""
    if rank == 0:
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


def pack_command(
    op: int,
    cache: int,
    args: Sequence[int],
    ints: torch.Tensor,
    data: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor:
    """One command as uint8 on `device`: the 64-byte header, then the int64 words, then the mask
    bytes; built in one host buffer (pinned for a CUDA device) and copied to `device` once."""
    nbytes = 0 if data is None else int(data.numel())
    if ints.numel() > MAX_INTS or nbytes > MAX_BYTES:
        name = Op(op).name if op in Op._value2member_map_ else str(op)
        raise ValueError(f"tensor-parallel command {name} too large ({ints.numel()} ints, {nbytes} bytes)")
    a = [*args, 0, 0, 0, 0][:4]
    header = torch.tensor([int(op), cache, int(ints.numel()), nbytes, *a], dtype=torch.int64)
    n_words = HEADER + int(ints.numel())
    buf = torch.empty(8 * n_words + nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    words = buf[: 8 * n_words].view(torch.int64)
    words[:HEADER] = header
    words[HEADER:] = ints.to(CPU, torch.int64)
    if data is not None and nbytes:
        buf[8 * n_words :] = data.reshape(-1).to(CPU, torch.uint8)
    return buf.to(device, non_blocking=True)


def unpack_payload(
    header: torch.Tensor, payload: torch.Tensor
) -> tuple[Op, int, list[int], torch.Tensor, torch.Tensor]:
    """A received command on the host: (op, cache, [a0..a3], int64 words, uint8 mask bytes)."""
    op_raw, cache, n_ints, n_bytes, *args = (int(v) for v in header.view(torch.int64))
    try:
        op = Op(op_raw)
    except ValueError:
        raise TensorParallelError(f"unknown tensor-parallel op {op_raw}") from None
    if payload.numel() != 8 * n_ints + n_bytes:
        raise TensorParallelError(f"tensor-parallel command {op.name}: payload of {payload.numel()} bytes")
    return op, cache, args, payload[: 8 * n_ints].view(torch.int64), payload[8 * n_ints :]


def payload_size(header: torch.Tensor) -> int:
    """The payload bytes a (host) header announces; a malformed header is refused."""
    words = header.view(torch.int64).tolist()
    n_ints, n_bytes = words[2], words[3]
    if not 0 <= n_ints <= MAX_INTS or not 0 <= n_bytes <= MAX_BYTES:
        raise TensorParallelError(f"malformed command header {words}")
    return int(8 * n_ints + n_bytes)


# ---------------------------------------------------------------------------------------- group
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def threads_per_rank(threads: int, world: int) -> int:
    """A rank's share of --threads (0: of the machine's cores), at least one."""
    total = threads or os.cpu_count() or 1
    return max(1, total // world)


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def start(
    world: int,
    model: str,
    dtype: str = "auto",
    device: str = "auto",
    attention: str = "model",
    threads: int = 0,
    timeout_s: float = JOIN_TIMEOUT_S,
) -> TPGroup:
    """Rank 0 of a new group on this machine: start ranks 1..world-1 (`python -m
    cloud_verifier.parallel`) and rendezvous with them on a free loopback port."""
    global _GROUP
    if _GROUP is not None:
        raise RuntimeError("this process is already in a tensor-parallel group")
    if world < 2:
        raise ValueError(f"a tensor-parallel group needs at least 2 ranks, got {world}")
    dev = select_device(device, 0, world, 0, spawning=True)  # (refused before anything starts)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        _nccl_error_handling(0)
    port = _free_port()
    share = threads_per_rank(threads, world)
    procs = []
    for r in range(1, world):
        env = {
            **os.environ,
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": str(share),
            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
        }
        cmd = [sys.executable, "-m", "cloud_verifier.parallel", "--model", model, "--dtype", dtype]
        cmd += ["--device", dev.type, "--attention", attention, "--threads", str(share)]
        # a session of its own: a terminal's Ctrl-C reaches rank 0 only, which stops the workers
        procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
    try:
        _rendezvous(procs, port, world, timeout_s, dev)
        _GROUP = TPGroup(0, world, procs, dev)
    except Exception:
        for p in procs:
            p.kill()
            p.wait()
        raise
    torch.set_num_threads(share)
    return _GROUP


def _rendezvous(
    procs: Sequence[subprocess.Popen[bytes]], port: int, world: int, timeout_s: float, device: torch.device
) -> None:
    """Rank 0's init_process_group, given up as soon as a worker exits instead of joining (it
    runs in a thread so that rank 0 can watch the workers meanwhile)."""
    errors: list[BaseException] = []

    def init() -> None:
        try:
            dist.init_process_group(
                backend_for(device),
                init_method=f"tcp://127.0.0.1:{port}",
                rank=0,
                world_size=world,
                timeout=timedelta(seconds=timeout_s),
                device_id=device if device.type == "cuda" else None,
            )
        except BaseException as exc:  # handed to the caller's thread
            errors.append(exc)

    th = threading.Thread(target=init, name="tp-rendezvous", daemon=True)
    th.start()
    while th.is_alive():
        th.join(0.1)
        for r, p in enumerate(procs, start=1):
            if th.is_alive() and p.poll() is not None:
                raise RuntimeError(
                    f"tensor-parallel rank {r} exited with code {p.returncode} before joining the group "
                    "(its error is above)"
                )
    if errors:
        raise errors[0]


def join(device: str = "cpu", timeout_s: float = JOIN_TIMEOUT_S) -> TPGroup:
    """Join the group described by RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (torchrun, or a
    worker started by `start`), on `select_device(device, ...)` with LOCAL_RANK's GPU."""
    global _GROUP
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = select_device(device, rank, world, local_rank(rank))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        _nccl_error_handling(rank)
    dist.init_process_group(
        backend_for(dev),
        timeout=timedelta(seconds=timeout_s),
        device_id=dev if dev.type == "cuda" else None,
    )
    _GROUP = TPGroup(dist.get_rank(), dist.get_world_size(), device=dev)
    return _GROUP


# ---------------------------------------------------------------------------------------- model
class ShardedLlamaModel(LlamaModel):
    """One rank's shard. On rank 0 a forward (and a change of attention or kernels) is first sent
    to the other ranks; its `config` is the shard's (heads, KV heads, intermediate size / N)."""

    def __init__(
        self,
        config: ModelConfig,
        full: ModelConfig,
        group: TPGroup,
        dtype: torch.dtype,
        device: torch.device,
        gemm_kind: str,
    ) -> None:
        super().__init__(config, dtype, device, gemm_kind)
        self.full_config = full
        self.group = group
        self.all_reduce = group.all_reduce
        self.gather_logits = group.gather_logits(full.vocab_size)

    def set_attention(self, mode: str) -> None:
        if mode not in ATTENTION_MODES:
            raise ValueError(f"attention mode must be one of {ATTENTION_MODES}, got {mode!r}")
        g = self.__dict__.get("group")
        if isinstance(g, TPGroup) and g.rank == 0:
            with g.lock:
                g.send(Op.SET_ATTENTION, args=(ATTENTION_MODES.index(mode),))
                super().set_attention(mode)
        else:
            super().set_attention(mode)

    def set_gemm(self, kind: str) -> None:
        if kind not in gemm.KINDS:
            raise ValueError(f"gemm must be one of {gemm.KINDS}, got {kind!r}")
        self._check_weights("set_gemm")
        g = self.group
        if g.rank == 0:
            with g.lock:
                g.send(Op.SET_GEMM, args=(gemm.KINDS.index(kind),))
                super().set_gemm(kind)
        else:
            super().set_gemm(kind)

    def new_kv_cache(self, num_blocks: int, block_size: int = 16) -> PagedKVCache:
        if self.group.rank != 0:
            return super().new_kv_cache(num_blocks, block_size)
        local = super().new_kv_cache(num_blocks, block_size)  # its shape and options, then shared
        g = self.group
        with g.lock:
            cid = g.new_cache_id()
            g.send(Op.NEW_CACHE, cid, (num_blocks, block_size))
        return ShardedKVCache(g, cid, local)

    @torch.inference_mode()
    def forward_packed(self, inputs: list[SeqInput], kv: PagedKVCache) -> list[torch.Tensor]:
        g = self.group
        if g.rank != 0:
            return super().forward_packed(inputs, kv)
        if not isinstance(kv, ShardedKVCache) or kv.group is not g:
            raise TypeError("a tensor-parallel model needs a KV cache made by its new_kv_cache")
        if not inputs:
            return []
        for x in inputs:
            check_input(x, self.config.vocab_size)
        ints, data = encode_inputs(inputs)
        with g.lock:
            g.check()
            g.send(Op.FORWARD, kv.cache_id, ints=ints, data=data)
            g.forwarding = True
        try:
            # (the engine's forward thread: kernels and NCCL on this rank's GPU, not the thread's default)
            with torch.cuda.device(g.device) if g.device.type == "cuda" else contextlib.nullcontext():
                return super().forward_packed(inputs, kv)
        finally:
            _end_forward(g)


def _end_forward(g: TPGroup) -> None:
    """After a forward: apply and send what the event loop did meanwhile, in its order."""
    with g.lock:
        g.forwarding = False
        deferred, g.deferred = g.deferred, []
        for finish, op, cache, args in deferred:
            finish()
            if g.error is None:
                try:
                    g.send(op, cache, args)
                except TensorParallelError:
                    pass
        g.idle.notify_all()


def shard_model(full: LlamaModel, group: TPGroup, name: str) -> ShardedLlamaModel:
    """Rank `group.rank`'s shard of `full`; each of full's layers is freed right after slicing
    (the embedding table is shared, not copied)."""
    c, n, r = full.config, group.world, group.rank
    check_shardable(c, n, name)
    local_cfg = replace(
        c,
        num_heads=c.num_heads // n,
        num_kv_heads=c.num_kv_heads // n,
        intermediate_size=c.intermediate_size // n,
        tie_embeddings=False,
    )
    model = ShardedLlamaModel(local_cfg, c, group, full.dtype, full.device, full.gemm_kind)
    hd, q, kvs, inter = c.head_dim, local_cfg.q_size, local_cfg.kv_size, local_cfg.intermediate_size
    rows = [
        slice(r * q, (r + 1) * q),
        slice(c.q_size + r * kvs, c.q_size + (r + 1) * kvs),
        slice(c.q_size + c.kv_size + r * kvs, c.q_size + c.kv_size + (r + 1) * kvs),
    ]
    del hd
    ffn = [
        slice(r * inter, (r + 1) * inter),
        slice(c.intermediate_size + r * inter, c.intermediate_size + (r + 1) * inter),
    ]

    def param(t: torch.Tensor) -> nn.Parameter:
        return nn.Parameter(t, requires_grad=False)

    for src, dst in zip(full.layers, model.layers, strict=True):
        assert isinstance(src, DecoderLayer) and isinstance(dst, DecoderLayer)
        dst.attn_norm = src.attn_norm
        dst.mlp_norm = src.mlp_norm
        dst.qkv = param(torch.cat([src.qkv[s] for s in rows]))
        if src.qkv_bias is not None:
            dst.qkv_bias = param(torch.cat([src.qkv_bias[s] for s in rows]))
        dst.o = param(src.o[:, r * q : (r + 1) * q].contiguous())
        dst.gate_up = param(torch.cat([src.gate_up[s] for s in ffn]))
        dst.down = param(src.down[:, r * inter : (r + 1) * inter].contiguous())
        for p in (src.qkv, src.o, src.gate_up, src.down):
            p.data = p.data.new_empty(0)
    model.embed = full.embed
    model.norm = full.norm
    shard = -(-c.vocab_size // n)
    head = full.lm_head[r * shard : min(c.vocab_size, (r + 1) * shard)]
    # tied: a view of the shared embedding table (packing copies it anyway); untied: its own copy
    model.lm_head = param(head if full.lm_head is full.embed else head.contiguous())
    if full.lm_head is not full.embed:
        full.lm_head.data = full.lm_head.data.new_empty(0)
    LlamaModel.set_attention(model, full.attention_mode)  # (every rank does it: nothing to send)
    return model


def load_sharded_target(
    group: TPGroup,
    name: str,
    dtype: str = "auto",
    device: str = "auto",
    progress: bool = True,
    attention: str = "model",
) -> Target:
    """`load_target` on the group's device (`device` must resolve to its type), then this rank's
    shard of it (the Target keeps the full ModelConfig)."""
    if resolve_device(device).type != group.device.type:
        raise ValueError(
            f"--device {device} but the tensor-parallel group runs on {group.device.type} "
            f"({group.backend}); give the same --device to every rank"
        )
    full = load_target(name, dtype, str(group.device), progress and group.rank == 0, attention)
    model = shard_model(full.model, group, name)
    return replace(full, model=model)


def _load_model(name: str, dtype: str, device: str, attention: str) -> LlamaModel:
    """A worker's model: as `load_target` loads it, without the tokenizer where that is avoidable
    (`tiny`: the seeded random weights of target.py, in 0.4 s instead of 10)."""
    if name != "tiny":
        return load_target(name, dtype, device, False, attention).model
    dev = resolve_device(device)
    model = build_model(make_tiny_config(), 0, resolve_dtype(dtype, dev), dev)
    model.set_attention(attention)
    return model


# ---------------------------------------------------------------------------------------- KV cache
class ShardedKVCache(PagedKVCache):
    """Rank 0's KV cache (its KV heads): every mutation is sent to the other ranks, whose caches
    apply it in the same order (see the module doc for calls made while a forward runs)."""

    def __init__(self, group: TPGroup, cache_id: int, local: PagedKVCache) -> None:
        # adopt the freshly made local pool's state (no second allocation)
        self.__dict__.update(local.__dict__)
        self.group = group
        self.cache_id = cache_id
        weakref.finalize(self, group.dropped.append, cache_id)

    def _mutate(
        self, op: Op, args: Sequence[int], apply: Callable[[], None], ints: Sequence[int] = ()
    ) -> None:
        g = self.group
        with g.lock:
            while g.forwarding and op not in (Op.ADD, Op.FREE):
                g.idle.wait()  # (the engine never does this during a forward; other callers wait)
            if g.forwarding:
                self._defer(op, args)
                return
            apply()  # raises before anything is sent when the call is refused
            if g.error is None:
                # a failed send has marked the group broken (logged, /readyz 503); the engine's
                # bookkeeping on this rank stays right, so the caller is not interrupted
                with contextlib.suppress(TensorParallelError):
                    g.send(op, self.cache_id, args, ints)

    def _defer(self, op: Op, args: Sequence[int]) -> None:
        g, sid = self.group, args[0]
        if op is Op.ADD:
            PagedKVCache.add(self, sid)
            g.deferred.append((lambda: None, op, self.cache_id, list(args)))
            return
        # free: forget the sequence now, but keep its blocks off the free list until the forward
        # is over, as on the other ranks (which free it after the forward)
        seq = self._seq(sid)
        del self._seqs[sid]
        blocks = list(seq.blocks)
        g.deferred.append((lambda: self._release(blocks), op, self.cache_id, list(args)))

    def add(self, seq_id: int) -> None:
        self._mutate(Op.ADD, (seq_id,), lambda: PagedKVCache.add(self, seq_id))

    def free(self, seq_id: int) -> None:
        self._mutate(Op.FREE, (seq_id,), lambda: PagedKVCache.free(self, seq_id))

    def discard(self, seq_id: int) -> None:
        self._mutate(Op.DISCARD, (seq_id,), lambda: PagedKVCache.discard(self, seq_id))

    def truncate(self, seq_id: int, length: int) -> None:
        self._mutate(Op.TRUNCATE, (seq_id, length), lambda: PagedKVCache.truncate(self, seq_id, length))

    def commit_rows(self, seq_id: int, keep: Sequence[int]) -> None:
        idx = [int(i) for i in keep]
        self._mutate(Op.COMMIT_ROWS, (seq_id,), lambda: PagedKVCache.commit_rows(self, seq_id, idx), idx)

    def consistent(self) -> bool:
        """Whether every rank's cache has rank 0's sequences, lengths, block tables and free list."""
        g = self.group
        with g.lock:
            while g.forwarding:
                g.idle.wait()
            g.send(Op.CHECK_CACHE, self.cache_id, ints=cache_digest(self))
            return _agree(g, True)


def cache_digest(kv: PagedKVCache) -> list[int]:
    """The bookkeeping every rank must share: free blocks, then (seq, cached, scratch, blocks...)."""
    out = [kv.num_free_blocks, len(kv.sequences())]
    for sid in sorted(kv.sequences()):
        table = kv.block_table(sid)
        out += [sid, kv.cached_len(sid), kv.scratch_len(sid), len(table), *table]
    return out


def _agree(g: TPGroup, ok: bool) -> bool:
    """Every rank's verdict: True when all say so."""
    flag = torch.tensor([0 if ok else 1], dtype=torch.int64, device=g.device)
    g._collective("cache check", lambda: dist.all_reduce(flag, group=g.step))
    return int(flag) == 0


# ---------------------------------------------------------------------------------------- inputs
def encode_inputs(inputs: Sequence[SeqInput]) -> tuple[torch.Tensor, torch.Tensor]:
    """A forward's inputs as int64 words [m, (seq, n, k, has_mask) * m, tokens, positions,
    logit_rows of each] and uint8 mask bytes (each tree mask, row-major)."""
    meta = [len(inputs)]
    parts: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    for x in inputs:
        meta += [x.seq_id, x.num_rows, int(x.logit_rows.numel()), int(x.tree_mask is not None)]
        parts += [x.tokens.reshape(-1), x.positions.reshape(-1), x.logit_rows.reshape(-1)]
        if x.tree_mask is not None:
            masks.append(x.tree_mask.reshape(-1).to(torch.uint8))
    ints = torch.cat([torch.tensor(meta, dtype=torch.int64), *(p.to("cpu", torch.int64) for p in parts)])
    data = torch.cat(masks).cpu() if masks else torch.empty(0, dtype=torch.uint8)
    return ints, data


def decode_inputs(ints: torch.Tensor, data: torch.Tensor) -> list[SeqInput]:
    """The inverse of `encode_inputs`; a payload whose sizes do not add up is refused."""
    words = ints.tolist()
    if not words or not 0 < words[0] <= 4096 or len(words) < 1 + 4 * words[0]:
        raise ValueError(f"malformed forward command ({len(words)} words)")
    m, at, mat = words[0], 1 + 4 * words[0], 0
    out = []
    for i in range(m):
        sid, n, k, has_mask = words[1 + 4 * i : 5 + 4 * i]
        if n < 1 or k < 0 or at + 2 * n + k > len(words) or (has_mask and mat + n * n > data.numel()):
            raise ValueError("malformed forward command (sizes)")
        tokens = ints[at : at + n]
        positions = ints[at + n : at + 2 * n]
        rows = ints[at + 2 * n : at + 2 * n + k]
        at += 2 * n + k
        mask = None
        if has_mask:
            mask = data[mat : mat + n * n].view(n, n).bool()
            mat += n * n
        out.append(SeqInput(sid, tokens, positions, mask, rows))
    if at != len(words) or mat != data.numel():
        raise ValueError("malformed forward command (trailing data)")
    return out


# ---------------------------------------------------------------------------------------- service
def load_for_service(config: ServerConfig) -> Target:
    """The server's loader with --tensor-parallel N: rank 0's shard, in the group `serve_parallel` made."""
    group = current()
    if group is None or group.rank != 0:
        raise RuntimeError("--tensor-parallel needs the ranks started first: run `cloud-verifier serve`")
    if group.world != config.tensor_parallel:
        raise RuntimeError(
            f"--tensor-parallel {config.tensor_parallel} but the group has {group.world} ranks"
        )
    return load_sharded_target(group, config.model, config.dtype, config.device, True, config.attention)


def serve_parallel(config: ServerConfig) -> int:
    """`cloud-verifier serve --tensor-parallel N` (or any serve under torchrun): rank 0 serves,
    the other ranks run `worker_loop`. Returns the process's exit status."""
    from cloud_verifier import logs, server

    logs.setup(config.log_level, config.log_format)
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if config.tensor_parallel not in (1, world):
            print(
                f"cloud-verifier: --tensor-parallel {config.tensor_parallel} but torchrun started {world} "
                "ranks; give --tensor-parallel WORLD_SIZE (or leave it out)",
                file=sys.stderr,
            )
            return 2
        config = replace(config, tensor_parallel=world)
        if config.threads:
            torch.set_num_threads(config.threads)
        try:
            group = join(config.device)
        except ValueError as exc:
            print(f"cloud-verifier: {exc}", file=sys.stderr)
            return 2
        if group.rank != 0:
            return _serve_commands(group, config.model, config.dtype, config.device, config.attention)
    else:
        try:
            group = start(
                config.tensor_parallel,
                config.model,
                config.dtype,
                config.device,
                config.attention,
                config.threads,
            )
        except ValueError as exc:  # a device or a GPU count this group cannot have
            print(f"cloud-verifier: {exc}", file=sys.stderr)
            return 2
        config = replace(config, threads=threads_per_rank(config.threads, config.tensor_parallel))
    try:
        return server.serve(config)
    finally:
        group.close()


# ---------------------------------------------------------------------------------------- workers
def worker_loop(group: TPGroup, model: ShardedLlamaModel) -> None:
    """Ranks > 0: apply rank 0's commands until STOP (or until the group breaks)."""
    caches: dict[int, PagedKVCache] = {}
    while True:
        op, cid, a, ints, data = group.receive()
        if op is Op.STOP:
            return
        try:
            if op is Op.NEW_CACHE:
                caches[cid] = model.new_kv_cache(a[0], a[1])
            elif op is Op.DROP_CACHE:
                caches.pop(cid, None)
            elif op is Op.SET_ATTENTION:
                model.set_attention(ATTENTION_MODES[a[0]])
            elif op is Op.SET_GEMM:
                model.set_gemm(gemm.KINDS[a[0]])
            elif op is Op.CHECK_CACHE:
                kv = caches.get(cid)
                mine = cache_digest(kv) if kv is not None else None
                if mine != ints.tolist():
                    log.error("rank %d: KV cache %d differs from rank 0's", group.rank, cid)
                _agree(group, mine == ints.tolist())
            else:
                kv = caches[cid]
                if op is Op.FORWARD:
                    model.forward_packed(decode_inputs(ints, data), kv)
                elif op is Op.ADD:
                    kv.add(a[0])
                elif op is Op.FREE:
                    kv.free(a[0])
                elif op is Op.DISCARD:
                    kv.discard(a[0])
                elif op is Op.TRUNCATE:
                    kv.truncate(a[0], a[1])
                elif op is Op.COMMIT_ROWS:
                    kv.commit_rows(a[0], ints.tolist())
        except TensorParallelError:
            raise
        except Exception as exc:  # rank 0 made the same call on the same state and got the same error
            log.debug("rank %d: %s failed as on rank 0: %s", group.rank, op.name, exc)


def run_worker(model: str, dtype: str, device: str, attention: str, threads: int) -> int:
    """A worker process: join, load this rank's shard, pack it, serve commands. Exit status 0
    after STOP, 1 when the group broke."""
    if threads:
        torch.set_num_threads(threads)
    return _serve_commands(join(device), model, dtype, device, attention)


def _serve_commands(group: TPGroup, model: str, dtype: str, device: str, attention: str) -> int:
    try:
        sharded = shard_model(_load_model(model, dtype, str(group.device), attention), group, model)
        sharded.prepare(release=True)
        worker_loop(group, sharded)
    except Exception as exc:  # a broken group, or a model this rank cannot load or split
        log.error("tensor-parallel rank %d stops: %s", group.rank, exc)
        return 1
    group.closing = True
    dist.destroy_process_group()
    return 0


@dataclass(frozen=True)
class _WorkerArgs:
    model: str
    dtype: str
    device: str
    attention: str
    threads: int


def _parse(argv: Sequence[str] | None) -> _WorkerArgs:
    p = argparse.ArgumentParser(
        prog="python -m cloud_verifier.parallel",
        description="One tensor-parallel worker rank of `cloud-verifier serve --tensor-parallel N` "
        "(started by it; reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the environment).",
    )
    p.add_argument("--model", required=True, help="the target alias or path rank 0 serves")
    p.add_argument("--dtype", default="auto", help="as serve --dtype")
    p.add_argument("--device", default="auto", help="as serve --device")
    p.add_argument("--attention", default="model", choices=list(ATTENTION_MODES), help="as serve --attention")
    p.add_argument("--threads", type=int, default=0, help="torch threads of this rank (0: torch's default)")
    ns = p.parse_args(argv)
    return _WorkerArgs(ns.model, ns.dtype, ns.device, ns.attention, ns.threads)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    a = _parse(argv)
    if not under_torchrun():
        print(
            "python -m cloud_verifier.parallel: RANK, WORLD_SIZE and MASTER_ADDR must be set", file=sys.stderr
        )
        return 2
    return run_worker(a.model, a.dtype, a.device, a.attention, a.threads)


if __name__ == "__main__":
    sys.exit(main())
