"""Tensor parallelism (cloud_verifier.parallel) on the CPU with gloo at TP=2.

TP=2 splits every projection's reduction (o, down) into two partial sums added by an all-reduce,
so its logits differ from TP=1's by float32 rounding only: within TOL = 1e-4 (absolute; tiny's
logits are O(1)). Within one TP=2 group the batch-invariant CPU attention, oneDNN's row-invariant
projections and an elementwise all-reduce keep a tree row bit-identical to decoding its path
alone, as at TP=1. Greedy generation through the real edge client and `cloud-verifier serve
--tensor-parallel 2` equals TP=1's; a killed worker turns /readyz to 503 with one log line, and
a forward in a broken group fails at once. Qwen2.5-Coder-0.5B (2 KV heads) runs with SLOW=1.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import httpx
import numpy as np
import pytest
import torch

from cloud_verifier import parallel
from cloud_verifier.server import ThreadedServer
from cloud_verifier.server_config import ServerConfig
from cloud_verifier.step import EngineConfig, RoundResult, SeqState, SeqStatus, StepRunner
from shared.messages import Mode, Prompt
from shared.model import (
    Target,
    decode_step,
    load_target,
    prefill,
    prefill_chunk,
    round_keep,
    tree_round,
)
from shared.model.kv_cache import PagedKVCache
from shared.model.llama import onednn_available
from shared.model.model_config import make_tiny_config
from shared.tree import TokenTree
from tests.cloud_verifier.helpers import incremental_logits, max_diff, random_tree

TOL = 1e-4  # |logit(TP=2) - logit(TP=1)| in float32, tiny (measured 1.1e-5)
QWEN_TOL = 5e-4  # Qwen2.5-Coder-0.5B (logits reach ~30; measured 3.7e-5 on these inputs)

pytestmark = pytest.mark.skipif(not torch.distributed.is_gloo_available(), reason="torch without gloo")


@functools.cache
def cpu_tiny() -> Target:
    """TP=1 on the CPU (the reference of the gloo group, on a machine with a GPU too)."""
    return load_target("tiny", device="cpu", progress=False)


# ------------------------------------------------------------------------------ no processes
def test_forward_command_round_trips_and_malformed_ones_are_refused() -> None:
    rng = random.Random(0)
    tree = random_tree(rng, 7, 1000, 12, [])
    inputs = [tree_round(3, tree, [5]), prefill_chunk(9, [1, 2, 3, 4], 6, logits_last=True)]
    ints, data = parallel.encode_inputs(inputs)
    assert ints.dtype == torch.int64 and data.dtype == torch.uint8
    back = parallel.decode_inputs(ints, data)
    for a, b in zip(inputs, back, strict=True):
        assert a.seq_id == b.seq_id
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.positions, b.positions)
        assert torch.equal(a.logit_rows, b.logit_rows)
        assert (a.tree_mask is None) == (b.tree_mask is None)
        if a.tree_mask is not None and b.tree_mask is not None:
            assert torch.equal(a.tree_mask, b.tree_mask)
    with pytest.raises(ValueError, match="malformed"):
        parallel.decode_inputs(ints[:-1], data)
    with pytest.raises(ValueError, match="malformed"):
        parallel.decode_inputs(ints, data[:-1])
    with pytest.raises(ValueError, match="malformed"):
        parallel.decode_inputs(torch.tensor([10**6]), data)


def test_a_split_that_cuts_kv_heads_is_refused_with_the_model_and_n() -> None:
    cfg = make_tiny_config()  # 8 heads, 2 KV heads
    parallel.check_shardable(cfg, 2, "tiny")
    with pytest.raises(ValueError, match=r"model 'tiny' cannot be split over 4 .*num_kv_heads \(2\)"):
        parallel.check_shardable(cfg, 4, "tiny")


def test_threads_are_split_between_ranks() -> None:
    assert parallel.threads_per_rank(8, 2) == 4
    assert parallel.threads_per_rank(1, 2) == 1


# ------------------------------------------------------------------------------ devices (no GPU needed)
def _gpus(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """Pretend n CUDA GPUs are visible (0: CUDA unavailable), at the level select_device reads."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_backend_and_rank_device_follow_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 0)
    assert parallel.select_device("cpu", 1, 2, 1) == torch.device("cpu")
    assert parallel.select_device("auto", 0, 2, 0, spawning=True) == torch.device("cpu")
    assert parallel.backend_for(torch.device("cpu")) == "gloo"
    with pytest.raises(ValueError, match="CUDA is not available here; use --device cpu"):
        parallel.select_device("cuda", 0, 2, 0)
    _gpus(monkeypatch, 4)
    assert parallel.select_device("auto", 0, 2, 0, spawning=True) == torch.device("cuda", 0)
    dev = parallel.select_device("cuda", 3, 4, 3)
    assert dev == torch.device("cuda", 3) and parallel.backend_for(dev) == "nccl"
    assert parallel.select_device("cuda", 5, 8, 1) == torch.device("cuda", 1)  # 2nd machine: LOCAL_RANK
    with pytest.raises(ValueError, match="give --device cuda; rank r uses cuda:LOCAL_RANK"):
        parallel.select_device("cuda:1", 0, 2, 0)
    with pytest.raises(ValueError, match="not --device mps"):
        parallel.select_device("mps", 0, 2, 0)


def test_fewer_gpus_than_ranks_is_refused_naming_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    _gpus(monkeypatch, 1)
    want = r"--tensor-parallel 2 on CUDA needs 2 GPUs \(one a rank\), but torch.cuda.device_count\(\) is 1"
    with pytest.raises(ValueError, match=want):
        parallel.select_device("cuda", 0, 2, 0, spawning=True)
    with pytest.raises(ValueError, match=r"rank 1 needs GPU cuda:1 \(its LOCAL_RANK\).* is 1"):
        parallel.select_device("cuda", 1, 2, 1)
    started: list[object] = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))
    with pytest.raises(ValueError, match=want):
        parallel.start(2, "tiny", device="auto")
    assert started == [] and parallel.current() is None  # refused before any worker starts


def test_serve_tensor_parallel_on_too_few_gpus_exits_2_with_the_count(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _gpus(monkeypatch, 1)
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(k, raising=False)
    cfg = ServerConfig(model="tiny", tensor_parallel=2, device="cuda")
    assert parallel.serve_parallel(cfg) == 2
    assert "torch.cuda.device_count() is 1; use --tensor-parallel 1 or fewer" in capsys.readouterr().err


def test_local_rank_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert parallel.local_rank(3) == 3
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert parallel.local_rank(5) == 1
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(ValueError, match="LOCAL_RANK must be an integer"):
        parallel.local_rank(0)


def test_a_command_is_one_buffer_on_the_rank_device_and_round_trips() -> None:
    inputs = [
        prefill_chunk(9, [1, 2, 3, 4], 6, logits_last=True),
        tree_round(3, random_tree(random.Random(0), 5, 100, 8, []), [5]),
    ]
    ints, data = parallel.encode_inputs(inputs)
    meta = parallel.pack_command(parallel.Op.FORWARD, 7, (1, 2), ints, data, torch.device("meta"))
    assert meta.device.type == "meta" and meta.dtype == torch.uint8
    buf = parallel.pack_command(parallel.Op.FORWARD, 7, (1, 2), ints, data, torch.device("cpu"))
    assert buf.numel() == 8 * (parallel.HEADER + ints.numel()) + data.numel() == meta.numel()
    header, payload = buf[: 8 * parallel.HEADER], buf[8 * parallel.HEADER :]
    assert parallel.payload_size(header) == payload.numel()
    op, cache, args, got_ints, got_data = parallel.unpack_payload(header, payload)
    assert (op, cache, args) == (parallel.Op.FORWARD, 7, [1, 2, 0, 0])
    assert torch.equal(got_ints, ints) and torch.equal(got_data, data)
    bad = header.clone()
    bad.view(torch.int64)[2] = parallel.MAX_INTS + 1
    with pytest.raises(parallel.TensorParallelError, match="malformed command header"):
        parallel.payload_size(bad)
    with pytest.raises(parallel.TensorParallelError, match="payload of"):
        parallel.unpack_payload(header, payload[:-1])
    with pytest.raises(ValueError, match="FORWARD too large"):
        parallel.pack_command(
            parallel.Op.FORWARD,
            0,
            (),
            torch.zeros(parallel.MAX_INTS + 1, dtype=torch.int64),
            None,
            torch.device("cpu"),
        )


# ------------------------------------------------------------------------------ rank 0 in this process
@pytest.fixture(scope="module")
def tp2() -> Iterator[Target]:
    threads = torch.get_num_threads()
    group = parallel.start(2, "tiny", device="cpu", threads=2)  # (sets this process's share: one thread)
    try:
        yield parallel.load_sharded_target(group, "tiny", device="cpu", progress=False)
    finally:
        group.close()
        torch.set_num_threads(threads)


def test_every_collective_tensor_is_on_the_group_device(tp2: Target, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same code as on NCCL, with device cpu: commands, all-reduces, the logit gather and the
    cache check hand torch.distributed tensors on the group's device (its weights and KV there too)."""
    group = tp2.model.group
    assert isinstance(group, parallel.TPGroup)
    assert (group.device, group.backend) == (torch.device("cpu"), "gloo")
    seen: dict[str, set[torch.device]] = {}
    for name in ("broadcast", "all_reduce", "gather"):
        real = getattr(torch.distributed, name)

        def spy(
            t: torch.Tensor, *a: object, _real: Callable[..., object] = real, _name: str = name, **k: object
        ) -> object:
            seen.setdefault(_name, set()).add(t.device)
            return _real(t, *a, **k)

        monkeypatch.setattr(torch.distributed, name, spy)
    kv = tp2.new_kv_cache(8, 16)
    kv.add(1)
    tp2.model.forward_packed([prefill_chunk(1, [1, 2, 3], 0, logits_last=True)], kv)
    assert isinstance(kv, parallel.ShardedKVCache) and kv.consistent()
    kv.free(1)
    assert set(seen) == {"broadcast", "all_reduce", "gather"}
    assert all(devs == {group.device} for devs in seen.values()), seen
    assert tp2.model.device == group.device and tp2.model.embed.device == group.device


def test_prefill_logits_match_tp1(tp2: Target) -> None:
    ref = cpu_tiny()
    rng = random.Random(1)
    prompt = [rng.randrange(ref.config.vocab_size) for _ in range(45)]
    outs = []
    for t in (tp2, ref):
        kv = t.new_kv_cache(32, 16)
        kv.add(1)
        (lg,) = t.model.forward_packed([prefill_chunk(1, prompt, 0, logits_last=True)], kv)
        outs.append(lg)
        kv.free(1)
    assert outs[0].shape == (1, ref.config.vocab_size)
    assert max_diff(outs[0], outs[1]) <= TOL


def _round(t: Target, committed: list[int], tail: int, tree_seed: int, cond: int) -> tuple[torch.Tensor, ...]:
    """A tree round after a prefix; then commit a path and decode one more token."""
    rng = random.Random(tree_seed)
    vocab = t.config.vocab_size
    base = len(committed) - cond
    tree = random_tree(rng, 14, vocab, base, committed[base:])
    kv = t.new_kv_cache(64, 16)
    kv.add(4)
    prefill(t.model, kv, 4, committed[:-tail])
    (lg,) = t.model.forward_packed([tree_round(4, tree, committed[-tail:])], kv)
    accepted = tree.path(rng.randrange(tree.num_nodes))
    kv.commit_rows(4, round_keep(tail, accepted))
    n = len(committed) + len(accepted)
    (after,) = t.model.forward_packed([decode_step(4, 7, n)], kv)
    kv.free(4)
    return lg, after


@pytest.mark.parametrize(("tail", "cond"), [(1, 0), (3, 0), (1, 2)])
def test_tree_and_conditional_tree_logits_match_tp1(tp2: Target, tail: int, cond: int) -> None:
    ref = cpu_tiny()
    rng = random.Random(tail * 10 + cond)
    committed = [rng.randrange(ref.config.vocab_size) for _ in range(37)]
    got = _round(tp2, committed, tail, 5, cond)
    want = _round(ref, committed, tail, 5, cond)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        assert max_diff(a, b) <= TOL, f"max |Δlogit| {max_diff(a, b):.3g}"


def test_tree_rows_equal_one_by_one_decoding_under_tp2(tp2: Target) -> None:
    rng = random.Random(11)
    vocab = tp2.config.vocab_size
    committed = [rng.randrange(vocab) for _ in range(20)]
    tree = random_tree(rng, 16, vocab, 20, [])
    kv = tp2.new_kv_cache(64, 16)
    kv.add(2)
    prefill(tp2.model, kv, 2, committed[:-1])
    (lg,) = tp2.model.forward_packed([tree_round(2, tree, committed[-1:])], kv)
    ref_committed, ref_nodes = incremental_logits(tp2.model, committed, tree, num_blocks=64)
    exact = onednn_available() and tp2.model.attention_kernel == "cpu-invariant"
    worst = max(max_diff(lg[:1], ref_committed[-1:]), max_diff(lg[1:], ref_nodes))
    assert worst <= (0.0 if exact else TOL), f"max |Δlogit| {worst:.3g}"


def test_packed_sessions_with_frees_during_the_forward_match_tp1(tp2: Target) -> None:
    """The engine frees and adds sessions on its loop thread while a forward runs: deferred on
    rank 0 and replayed after the forward, so later allocations agree on every rank."""
    ref = cpu_tiny()
    rng = random.Random(3)
    vocab = ref.config.vocab_size
    prompts = {s: [rng.randrange(vocab) for _ in range(n)] for s, n in ((1, 60), (2, 33), (3, 20))}
    results = []
    for t in (tp2, ref):
        kv = t.new_kv_cache(24, 16)
        for s in (1, 2, 3, 9):
            kv.add(s)
        prefill(t.model, kv, 9, [5] * 40)  # a session the loop thread frees mid-forward
        out: list[list[torch.Tensor]] = []
        inputs = [prefill_chunk(s, p, 0, logits_last=True) for s, p in prompts.items()]
        th = threading.Thread(
            target=lambda m=t.model, k=kv, i=inputs, o=out: o.append(m.forward_packed(i, k))
        )
        group = getattr(t.model, "group", None)
        th.start()
        if group is not None:  # free and add while rank 0's forward is under way
            deadline = time.monotonic() + 5
            while not group.forwarding and time.monotonic() < deadline:
                time.sleep(0.0002)
            assert group.forwarding, "the forward ended before the free could overlap it"
        kv.free(9)
        kv.add(10)
        th.join()
        for s in (1, 2, 3):
            kv.commit_rows(s, list(range(len(prompts[s]))))
        # the next allocations must land on the same blocks on every rank
        prefill(t.model, kv, 10, [7] * 50)
        nxt = t.model.forward_packed([decode_step(10, 3, 50), decode_step(1, 4, 60)], kv)
        results.append([*out[0], *nxt])
        if isinstance(kv, parallel.ShardedKVCache):
            assert kv.consistent()
    for a, b in zip(*results, strict=True):
        assert max_diff(a, b) <= TOL


def _generate_past_the_pool(t: Target, blocks: int) -> tuple[list[list[int]], int, PagedKVCache]:
    """Three 44-token prompts that may add 4 tokens each, on an engine that reserves no tree rows,
    with 12-node trees (wrong after the first node): on 9 blocks the first trees do not fit and the
    latest-admitted session is preempted. Each session's tokens, the preemptions, the pool."""
    prompts = [[(29 * i + 7 * j) % 4000 + 3 for j in range(44)] for i in range(3)]
    kv = t.new_kv_cache(blocks, 16)
    r = StepRunner(t, kv, EngineConfig(gather_ms=0, max_nodes=0))
    tokens: list[list[int]] = [[] for _ in prompts]
    seqs: list[SeqState] = []

    def on_result(i: int) -> Callable[[RoundResult], None]:
        def cb(res: RoundResult) -> None:
            tokens[i].extend(res.tokens)
            if not res.done:
                s = seqs[i]
                tree = TokenTree.from_sequences([[5, *range(100, 111)]], base=len(s.committed))
                r.submit(s, res.round + 1, tree)

        return cb

    for i, p in enumerate(prompts):
        seqs.append(r.open(on_result(i)))
        r.start(
            seqs[i], Prompt(np.asarray(p, np.int32), Mode.GREEDY, max_new_tokens=4), np.asarray(p, np.int32)
        )
    for _ in range(100):
        if all(s.status is SeqStatus.IDLE for s in seqs):
            break
        r.step()
    return tokens, r.room.preemptions, kv


def test_a_preemption_under_tp2_frees_the_blocks_on_every_rank_and_keeps_the_tokens(tp2: Target) -> None:
    """KVRoom.fit frees a preempted session's blocks through the sharded cache, so every rank's
    bookkeeping stays rank 0's; the recomputed session's tokens equal a run with room to spare."""
    roomy, none, _ = _generate_past_the_pool(tp2, 64)
    tight, preempted, kv = _generate_past_the_pool(tp2, 9)
    assert none == 0 and preempted >= 1
    assert tight == roomy
    assert isinstance(kv, parallel.ShardedKVCache) and kv.consistent()


# ------------------------------------------------------------------------------ the service
SERVICE = ServerConfig(model="tiny", measure_cost=False, max_sessions=4, max_context=512, kv_blocks=256)


def test_the_server_loads_through_the_loader_it_is_given_and_refuses_tp_without_one() -> None:
    """The server knows nothing of tensor parallelism: serve_parallel hands it a loader; without
    one, --tensor-parallel 2 is refused (naming what to do) instead of loading an unsplit model."""
    seen: list[ServerConfig] = []

    def loader(cfg: ServerConfig) -> Target:
        seen.append(cfg)
        raise ValueError("no model from this loader")

    tp = replace(SERVICE, tensor_parallel=2)
    with pytest.raises(RuntimeError, match="no model from this loader"):
        ThreadedServer(tp, loader=loader).start(timeout=30)
    assert seen == [tp]
    with pytest.raises(
        RuntimeError, match=r"--tensor-parallel 2 needs the ranks started first: run `cloud-verifier"
    ):
        ThreadedServer(tp).start(timeout=30)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker_pids(pid: int) -> list[int]:
    out: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(x) for x in f.read().split()]
    return out


async def _greedy(url: str, prompt: str, n: int) -> list[int]:
    from edge_client.client import EdgeClient
    from edge_client.drafters.registry import create_drafter

    drafter = create_drafter("torch", "tiny")
    try:
        async with EdgeClient(url, drafter, resume=False) as c:
            async for _ in c.generate(prompt, max_new_tokens=n):
                pass
            assert c.last is not None
            return list(c.last.tokens)
    finally:
        drafter.close()


PROMPT, N = "def fibonacci(n):", 40


def _tp1_greedy() -> list[int]:
    with ThreadedServer(SERVICE, target=cpu_tiny()) as srv:
        want = asyncio.run(_greedy(srv.url, PROMPT, N))
    assert len(want) == N
    return want


def test_edge_client_greedy_through_a_tp2_verifier_equals_tp1_and_a_dead_rank_fails_readyz(
    tp2: Target, caplog: pytest.LogCaptureFixture
) -> None:
    """The service on rank 0 of the TP=2 group: the edge client's greedy output equals TP=1's;
    then SIGKILL the worker: one log line, /readyz 503 within a few seconds, and forwards fail at
    once instead of waiting on the dead rank. (Runs last in the module: it breaks the group.)"""
    want = _tp1_greedy()
    group = getattr(tp2.model, "group", None)
    assert isinstance(group, parallel.TPGroup) and group.procs
    kv = tp2.new_kv_cache(8, 16)
    with ThreadedServer(SERVICE, target=tp2) as srv:
        assert asyncio.run(_greedy(srv.url, PROMPT, N)) == want
        ready = f"{srv.http}/readyz"
        assert httpx.get(ready, timeout=5).status_code == 200
        # forwards in flight when the rank dies fail too, instead of waiting on it
        busy = tp2.new_kv_cache(64, 16)
        busy.add(1)
        failed: list[BaseException] = []
        looping = threading.Event()

        def forwards() -> None:
            try:
                while True:
                    tp2.model.forward_packed([prefill_chunk(1, list(range(300)), 0)], busy)
                    busy.discard(1)
                    looping.set()
            except Exception as exc:
                failed.append(exc)

        th = threading.Thread(target=forwards, daemon=True)
        th.start()
        assert looping.wait(30)
        group.procs[0].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        while (r := httpx.get(ready, timeout=5)).status_code == 200:
            assert time.monotonic() - t0 < 5, "/readyz still 200 five seconds after a rank died"
            time.sleep(0.05)
        assert r.status_code == 503
        assert "tensor-parallel rank 1 died: exit code -9" in r.json()["detail"]
        th.join(5)
        assert not th.is_alive() and isinstance(failed[0], parallel.TensorParallelError)
    died = "tensor-parallel rank 1 died: exit code -9; the verifier is not ready"
    assert [rec.getMessage() for rec in caplog.records if "died" in rec.getMessage()] == [died]
    kv.add(1)  # rank 0's bookkeeping still works (nothing is sent)
    t0 = time.monotonic()
    with pytest.raises(parallel.TensorParallelError, match="rank 1 died"):
        tp2.model.forward_packed([decode_step(1, 3, 0)], kv)
    assert time.monotonic() - t0 < 1.0


@pytest.mark.slow
def test_cli_serve_tensor_parallel_2_greedy_equals_tp1_and_a_killed_rank_turns_readyz_503() -> None:
    """`cloud-verifier serve --tensor-parallel 2` as a user starts it (workers spawned by rank 0)."""
    prompt, n = PROMPT, N
    want = _tp1_greedy()

    port = _free_port()
    cmd = [sys.executable, "-m", "cloud_verifier.cli", "serve", "--model", "tiny", "--port", str(port)]
    cmd += ["--no-measure-cost", "--kv-blocks", "256", "--tensor-parallel", "2", "--threads", "2"]
    cmd += ["--device", "cpu"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = f"http://127.0.0.1:{port}/readyz"
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(ready, timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        got = asyncio.run(_greedy(f"ws://127.0.0.1:{port}/v1/session", prompt, n))
        assert got == want

        (worker,) = _worker_pids(proc.pid)
        os.kill(worker, signal.SIGKILL)
        t0 = time.monotonic()
        while httpx.get(ready, timeout=2).status_code == 200:
            assert time.monotonic() - t0 < 5, "/readyz still 200 five seconds after a rank died"
            time.sleep(0.05)
        assert httpx.get(ready, timeout=2).status_code == 503
    finally:
        proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=30)
    assert "tensor-parallel rank 1 died: exit code -9; the verifier is not ready" in err
