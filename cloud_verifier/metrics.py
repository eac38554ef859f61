"""Prometheus metrics of the verifier, in a registry of their own (one per app)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from cloud_verifier.engine import Engine

_NODE_BUCKETS = (0, 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256)
_LEN_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32)
_TTFT = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_WAIT = (0.0, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05)
_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self._declare_rounds(r)
        self._declare_engine(r)
        self._declare_sessions(r)
        self._declare_vllm(r)
        self.admission_waiting = Gauge(
            "specdec_admission_waiting", "HTTP requests waiting for a generation slot", registry=r
        )
        self.model_name = ""
        self._preemptions = 0  # the engine's count already added to the counters

    def _declare_rounds(self, r: CollectorRegistry) -> None:
        """What the verified trees were and how much of them was accepted."""
        self.num_drafts = Counter("specdec_num_drafts", "Tree rounds verified", registry=r)
        self.num_draft_tokens = Counter("specdec_num_draft_tokens", "Tree nodes verified", registry=r)
        self.num_accepted_tokens = Counter("specdec_num_accepted_tokens", "Tree nodes accepted", registry=r)
        self.accepted_per_pos = Counter(
            "specdec_num_accepted_tokens_per_pos", "Accepted tree nodes by depth", ["position"], registry=r
        )
        self.emitted_tokens = Counter("specdec_emitted_tokens", "Tokens sent in verdicts", registry=r)
        self.tree_nodes = Histogram(
            "specdec_tree_nodes", "Nodes per verified tree", buckets=_NODE_BUCKETS, registry=r
        )
        self.accepted_len = Histogram(
            "specdec_accepted_length", "Accepted nodes per round", buckets=_LEN_BUCKETS, registry=r
        )

    def _declare_engine(self, r: CollectorRegistry) -> None:
        """The engine's forwards and the rounds' latencies."""
        self.forward_seconds = Histogram(
            "specdec_verify_forward_seconds",
            "Seconds per engine forward (all sessions)",
            buckets=_SECONDS,
            registry=r,
        )
        self.round_seconds = Histogram(
            "specdec_round_seconds",
            "Seconds from a round becoming ready to its verdict",
            buckets=_SECONDS,
            registry=r,
        )
        self.round_gap_seconds = Histogram(
            "specdec_round_gap_seconds",
            "Seconds from a verdict to its session's next tree being handed to the engine (the wait "
            "for the edge: ~0 for a pending conditional tree, drafting + round trip after a miss)",
            buckets=_SECONDS,
            registry=r,
        )
        self.step_rows = Histogram(
            "specdec_engine_step_rows", "Rows per engine forward", buckets=_NODE_BUCKETS, registry=r
        )
        self.step_sessions = Histogram(
            "specdec_engine_step_sessions", "Sessions per engine forward", buckets=_LEN_BUCKETS, registry=r
        )
        self.verify_cost_ms = Gauge(
            "cloud_verifier_verify_cost_ms",
            "The live verify cost curve: ms of a forward of N tree nodes (row 0 + N rows), as the "
            "welcome advertises it (cloud_verifier/live_cost.py)",
            ["nodes"],
            registry=r,
        )
        self.batch_wait_seconds = Histogram(
            "cloud_verifier_batch_wait_seconds",
            "Seconds each engine forward waited for rounds about to arrive (0: none; the cost curve's "
            "rule, cloud_verifier/batch_wait.py)",
            buckets=_WAIT,
            registry=r,
        )
        self.batch_waited_forwards = Counter(
            "cloud_verifier_batch_waited_forwards",
            "Engine forwards that waited for rounds about to arrive",
            registry=r,
        )

    def _declare_sessions(self, r: CollectorRegistry) -> None:
        """Sessions, the KV pool, conditional trees and errors."""
        self.sessions = Gauge("specdec_sessions", "Open sessions", registry=r)
        self.kv_blocks_used = Gauge("specdec_kv_blocks_in_use", "KV blocks in use", registry=r)
        self.kv_blocks_total = Gauge("specdec_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.kv_blocks_reserved = Gauge(
            "cloud_verifier_kv_blocks_reserved",
            "KV blocks reserved for the generations admitted (each the most it can grow to)",
            registry=r,
        )
        self.kv_queued = Gauge(
            "cloud_verifier_kv_queued_generations",
            "Generations waiting for room in the KV pool before their prefill",
            registry=r,
        )
        self.preemptions = Counter(
            "cloud_verifier_preemptions",
            "Sessions whose KV blocks were freed for an earlier-admitted session's round (recomputed "
            "later from their committed tokens)",
            registry=r,
        )
        self.cond_hits = Counter(
            "specdec_conditional_tree_hits", "Pending trees verified with no round trip", registry=r
        )
        self.cond_stale = Counter("specdec_conditional_tree_stale", "Trees answered with stale", registry=r)
        self.errors = Counter("specdec_errors", "Error frames sent", ["code"], registry=r)
        self.rejected_sessions = Counter(
            "specdec_rejected_sessions", "Connections refused (max sessions)", registry=r
        )
        self.resumes = Counter(
            "cloud_verifier_resumes",
            "Sessions resuming a dropped one by its token, by what became of its KV cache: reused "
            "(the prompt's common prefix not prefilled again), busy (its last round still ran: "
            "prefilled), gone (not held here: expired, reclaimed or another replica's; prefilled)",
            ["kv"],
            registry=r,
        )
        self.direct_moves = Counter(
            "cloud_verifier_direct_moves",
            "Sessions a client moved from the fleet's proxy to this replica's own address "
            "(welcome.direct); the proxied connection stays open, idle, until the session ends",
            registry=r,
        )
        self.parked_sessions = Gauge(
            "cloud_verifier_parked_sessions",
            "Dropped sessions whose KV cache is kept for a resume",
            registry=r,
        )
        self.cond_pending = Gauge(
            "specdec_conditional_trees_pending", "Conditional trees waiting for their outcome", registry=r
        )

    def _declare_vllm(self, r: CollectorRegistry) -> None:
        """The same concepts under vLLM's names, so its dashboards and alerts work unchanged."""
        m = ["model_name"]
        self.vllm_drafts = Counter("vllm:spec_decode_num_drafts", "Tree rounds verified", m, registry=r)
        self.vllm_draft_tokens = Counter(
            "vllm:spec_decode_num_draft_tokens", "Draft (tree) tokens verified", m, registry=r
        )
        self.vllm_accepted = Counter(
            "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", m, registry=r
        )
        self.vllm_accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens by position (depth - 1)",
            [*m, "position"],
            registry=r,
        )
        self.vllm_running = Gauge("vllm:num_requests_running", "Generations running", m, registry=r)
        self.vllm_waiting = Gauge(
            "vllm:num_requests_waiting", "Rounds ready and not yet in an engine step", m, registry=r
        )
        self.vllm_ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Prompt received to first token", m, buckets=_TTFT, registry=r
        )
        self.vllm_tpot = Histogram(
            "vllm:time_per_output_token_seconds", "Seconds per output token after the first", m,
            buckets=_SECONDS, registry=r,
        )  # fmt: skip
        self.vllm_kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage, 0 to 1", m, registry=r)
        self.vllm_preemptions = Counter(
            "vllm:num_preemptions", "Sessions preempted (KV freed, recomputed later)", m, registry=r
        )

    def record_round(self, nodes: int, accepted_depths: list[int]) -> None:
        self.num_drafts.inc()
        self.num_draft_tokens.inc(nodes)
        self.num_accepted_tokens.inc(len(accepted_depths))
        for d in accepted_depths:
            self.accepted_per_pos.labels(position=str(d)).inc()
        self.tree_nodes.observe(nodes)
        self.accepted_len.observe(len(accepted_depths))
        name = self.model_name
        self.vllm_drafts.labels(name).inc()
        self.vllm_draft_tokens.labels(name).inc(nodes)
        self.vllm_accepted.labels(name).inc(len(accepted_depths))
        for d in accepted_depths:
            self.vllm_accepted_per_pos.labels(name, str(d - 1)).inc()

    def record_pool(self, engine: Engine) -> None:
        """The KV pool's usage, reservations and queue now, and the preemptions since the last call."""
        kv, name = engine.kv, self.model_name
        self.kv_blocks_used.set(kv.blocks_in_use)
        self.kv_blocks_total.set(kv.num_blocks)
        self.vllm_kv_usage.labels(name).set(kv.blocks_in_use / max(kv.num_blocks, 1))
        self.kv_blocks_reserved.set(engine.runner.room.reserved_blocks)
        self.kv_queued.set(engine.queued)
        self.record_batch_waits(engine)
        new = engine.preemptions - self._preemptions
        if new > 0:
            self.preemptions.inc(new)
            self.vllm_preemptions.labels(name).inc(new)
            self._preemptions = engine.preemptions

    def record_batch_waits(self, engine: Engine) -> None:
        """The engine's batch waits since the last call (each forward's, 0 included)."""
        waits = engine.batch_waits
        while waits:
            w = waits.popleft()
            self.batch_wait_seconds.observe(w)
            if w > 0:
                self.batch_waited_forwards.inc()

    def record_cost(self, curve: dict[int, float]) -> None:
        """The live verify cost curve now ({N nodes: ms})."""
        for n, ms in curve.items():
            self.verify_cost_ms.labels(nodes=str(n)).set(ms)

    def record_generation(self, ttft_s: float, tokens: int, seconds: float) -> None:
        """One generation ended: its time to first token, and the time per token after it."""
        self.vllm_ttft.labels(self.model_name).observe(ttft_s)
        if tokens > 1:
            self.vllm_tpot.labels(self.model_name).observe(max(seconds - ttft_s, 0.0) / (tokens - 1))
