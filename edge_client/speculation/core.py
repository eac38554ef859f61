"""The speculation core of one generation, without I/O: events in, actions out.

Without pre-speculation each round is synchronous: draft a tree below the committed sequence,
send it, wait for the verdict. With pre-speculation (SSD / Saguaro, speculation.outcomes) the
drafter keeps working while a round is in flight: it drafts conditional trees for the most likely
outcomes of the tree in flight (and, going deeper, of those trees), most probable first, and
sends each as soon as it is drafted. After a verdict the next tree is then usually already at the
verifier (named in `next_round`, or still on its way: it matches on arrival); only on a miss
does the edge draft synchronously.

Shape. The steps (`start`, `idle`, `receive`) are generators: each yields actions
(speculation.actions) and receives their results, so the logic reads in order while the shell
(speculation.executor) or a test (scripted verdicts, inline drafting) runs them. The wire state
is the client's `shared.protocol.ClientProtocol`, and so is the round in flight: the shell's pump
decodes frames on arrival (so that a draft a verdict rules out is abandoned at once, the committed
sequence is never behind the socket), and the protocol moves its in-flight marker only when the
core takes a frame up (`ClientProtocol.acknowledge`), so `in_flight` is the round whose verdict
the core waits for.

Bookkeeping. The drafter is synced to an *anchor* sequence; every tree is drafted in its workspace
below `anchor + cond`, so conditional trees reuse the nodes of the trees they continue. The
ledger (speculation.ledger) records each sent tree and the committed sequence it assumes. On a
miss the drafter is re-synced to the committed sequence (the anchor moves); when the workspace
fills up during a run of hits, the anchor moves and the tree in flight is replayed.

Keeping the critical path short. Every tree is sent without its leaves evaluated; the leaves the
outcome model gives a fair chance of being reached (PrespecConfig.leaf_min_reach) are evaluated
right after, while the tree is in flight. A conditional tree is abandoned between evaluations as
soon as a verdict rules its outcome out, so a miss's fallback waits for at most one evaluation.

The pre-speculation steps (the gate, the conditional trees drafted while a round is in flight, the
outcome cache, the leaves evaluated after sending) are in speculation.prespeculation, a base class
of the core.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Generator

import numpy as np

from edge_client.speculation import auto
from edge_client.speculation.actions import (
    Ask,
    Deliver,
    DraftPlain,
    Reanchor,
    Send,
    Sent,
    Steps,
    ask,
)
from edge_client.speculation.config import DrafterProfile, PrespecConfig, Refused, Request, TreeSpec
from edge_client.speculation.estimates import (
    ChoiceModel,
    Learned,
    RoundEstimates,
    choose_budget,
    ema,
    next_gains,
)
from edge_client.speculation.estimates import verify_ms as advertised_ms
from edge_client.speculation.ledger import Ledger, Speculation
from edge_client.speculation.outcomes import reach_probabilities
from edge_client.speculation.planner import Planner
from edge_client.speculation.prespeculation import PrespecSteps
from edge_client.stats import GenerationStats, SendEvent, VerdictEvent
from edge_client.trees import DraftResult
from shared.errors import ErrorCode
from shared.messages import (
    FEATURE_STREAM,
    Error,
    Message,
    Mode,
    Prompt,
    Stale,
    Stream,
    Tree,
    Verdict,
    Welcome,
)
from shared.protocol import ClientProtocol, ClientState
from shared.tree import ExpansionConfig, TokenTree
from shared.tree_match import rebase, reroot

Clock = Callable[[], float]


class SpeculationCore(PrespecSteps):
    """The rounds of one generation (see the module docstring).

    `clock` is the time the core reasons in (perf_counter seconds by default): when a verdict is
    due, what the cost gate has left, drafting times. The shell stamps frames with the same clock;
    a test passes a scripted one.
    """

    def __init__(
        self,
        proto: ClientProtocol,
        welcome: Welcome,
        req: Request,
        prespec: PrespecConfig | None,
        learned: Learned,
        stats: GenerationStats,
        drafter: DrafterProfile | None,
        temperature: float = 0.0,
        clock: Clock = time.perf_counter,
    ) -> None:
        self.proto = proto
        self.welcome = welcome
        self.req = req
        self.prespec = prespec if req.mode is not Mode.AR else None
        self.learned = learned
        self.stats = stats
        self.drafter = drafter
        self.clock = clock
        self.choice: ChoiceModel = learned.choice_model(
            temperature if req.mode is not Mode.GREEDY else 0.0, coupled=req.coupling is not None
        )
        if req.coupling is not None:  # the first trees rank with the landing scale learned so far
            req.coupling.landing.adopt(self.choice.landing)
        self.ledger = Ledger()
        self.planner = Planner(self.ledger, self.prespec, self.choice)
        self.est = RoundEstimates()
        self.anchor: tuple[int, ...] = ()
        self.workspace_full = False
        self.cancelled = False
        self.finished = False
        self._bytes_since_verdict = 0
        # what a tree of the configured shape yields and costs: (tokens, nodes, draft ms)
        self._full: tuple[float, int, float] | None = None
        self._cache_first: int | None = None  # the round in flight whose likeliest outcome was drafted
        self._cache_idle: int | None = None  # the round in flight for which no more chains fit
        self._cache_planned_ms = 0.0  # the priced time of the last chains planned
        # mode auto (speculation.auto): its plan, whether the verifier takes stream rounds, the
        # latest verdict's cost maps, and the committed length the last chain ahead of a stream
        # was drafted at
        self.plan = req.plan if req.mode is not Mode.AR else None
        self.streams = self.plan is not None and FEATURE_STREAM in (welcome.features or ())
        self.forward: dict[int, float] | None = None
        self.marginal: dict[int, float] | None = None
        self._ahead_at = -1
        self._ahead_rounds: dict[int, str] = {}  # trees sent while the target streamed: their kind
        self._last_verdict_at: float | None = None  # clock time of the previous verdict (auto's Realized)

    @property
    def in_flight(self) -> int | None:
        """The round whose verdict the core waits for (the protocol's, as of the frames taken up)."""
        return self.proto.in_flight

    # ------------------------------------------------------------------ steps
    def start(self, prompt: Prompt) -> Steps:
        """Draft the first tree (not in mode ar) and send the prompt with it."""
        full = tuple(self.proto.committed_for(prompt))
        first: DraftResult | None = None
        if self.streams:  # mode auto: the prefill starts now, the first chain is drafted ahead of it
            frame = self.proto.prompt(dataclasses.replace(prompt, stream=prompt.max_new_tokens))
            yield from ask(Send(frame, "prompt", 0))
            return
        if self.req.mode is not Mode.AR:
            first = yield from self._draft_plain(full)
        msg = prompt if first is None else dataclasses.replace(prompt, tree=first.tree)
        frame = self.proto.prompt(msg)
        sent = yield from ask(Send(frame, "prompt", 0))
        if first is not None:
            self._trace_send(first, 0, None, 0, 1.0, sent)
            self._sent(Speculation(0, first, full, 1.0, None, sent.at))
            self.est.verdict_due = self._due(sent.at, first.tree.num_nodes)

    def _due(self, sent_at: float, nodes: int) -> float:
        """When the verdict on a tree of `nodes` nodes sent at `sent_at` is expected here: a round
        trip and a verification (as measured; before any was, the server's advertised cost)."""
        v = self.est.verify_ms or float(advertised_ms(self._curve(), np.asarray([nodes]))[0])
        return sent_at + (self.learned.rtt_ms + v) / 1e3

    def idle(self, quiet: bool) -> Steps | None:
        """Work while waiting: evaluate pending leaves, or draft the next conditional tree; only
        when `quiet` (no frame is waiting to be received), but the gate is asked (and counts a
        held-back tree) either way."""
        if self.streams and quiet and not self.cancelled and self.proto.state is ClientState.GENERATING:
            if self._want_fallback():
                return self._send_stream(self.welcome.limits.max_context)
            if self._want_ahead():
                return self._draft_ahead()
        if self.ledger.has_pending_leaves() and quiet:
            return self._finish_leaves()
        if self._can_prespeculate() and quiet:
            return self._prespeculate_one()
        return None

    def receive(self, msg: Message, received: float) -> Steps:
        """A decoded frame (received at clock time `received`): account it, deliver a verdict, and
        draft synchronously after a miss."""
        if isinstance(msg, Error):
            refused = self._refused_speculation(msg)
            self.proto.acknowledge(msg)
            if refused:
                return
            raise Refused(msg)
        if isinstance(msg, Stale):
            self.ledger.stale(msg.round)
            # the tree taken for current (one still on its way when the verdict came) may be refused
            # after all: then nothing is in flight, draft below the committed sequence
            was_in_flight = msg.round == self.in_flight
            self.proto.acknowledge(msg)
            if not was_in_flight or self.proto.state is not ClientState.GENERATING:
                return
        elif isinstance(msg, Verdict):
            reanchor = self._on_verdict(msg, received)
            yield from ask(Deliver(msg))
            if msg.done:
                self.finished = True
                return
            if reanchor is not None:
                # a run of hits filled the workspace: move the anchor, replay the tree in flight
                spec, committed_now = reanchor
                self.anchor = committed_now
                self.workspace_full = False
                self.ledger.workspace_moved()
                yield from ask(Reanchor(committed_now, spec.draft.tree))
                self.ledger.reexpand(spec.round)
                self.planner.expand(spec.round)
        else:
            return
        if self.cancelled or self.req.mode is Mode.AR or self.in_flight is not None:
            return
        # a miss: draft synchronously below the committed sequence. The protocol decodes ahead of
        # the core, so later verdicts may already be waiting (and the generation over).
        if self.proto.state is not ClientState.GENERATING:
            return
        committed = tuple(self.proto.committed)
        if self.prespec is not None:  # (without pre-speculation the planner never queues anything)
            self.planner.clear()
        if self.streams and self._stream_pays():
            assert self.plan is not None
            yield from self._send_stream(self.welcome.limits.max_context)
            return
        dr = yield from self._draft_plain(committed, self._backup())
        now = self.proto
        if now.state is not ClientState.GENERATING or tuple(now.committed) != committed:
            # a verdict came in while drafting (the generation may even have ended): this tree is
            # not current; the verdict waits in the queue and decides what follows
            return
        yield from self._send_tree(dr, committed, 1.0, None)

    def cancel(self) -> None:
        self.cancelled = True
        if self.prespec is not None:
            self.planner.clear()

    # ------------------------------------------------------------------ drafting
    def _draft_plain(
        self, committed: tuple[int, ...], shape: TreeSpec | None = None
    ) -> Generator[Ask[object], object, DraftResult]:
        """A tree below `committed` (of `shape`, else the configured one), drafter re-synced to it
        (the anchor moves)."""
        self.anchor = committed
        self.workspace_full = False
        self.ledger.workspace_moved()  # the old workspace is gone
        budget = self._budget(rtt=True) if shape is None else 0
        dr = yield from ask(DraftPlain(committed, budget, shape))
        self.stats.draft_ms.append(dr.draft_ms)
        self.est.note_draft(dr)
        if shape is None and self.prespec is not None:  # the miss path's prices (pre-speculation's)
            self._note_full(dr)
        return dr

    def _note_full(self, dr: DraftResult, plain: bool = True) -> None:
        """A tree of the configured shape: what such a tree yields and, drafted below the committed
        sequence (`plain`), costs (the miss path's prices)."""
        tokens = 1.0 + float(reach_probabilities(dr, self.choice).sum())
        old = self._full
        ms = dr.draft_ms if plain or old is None else old[2]
        self._full = (ema(None if old is None else old[0], tokens), dr.tree.num_nodes, ms)

    def _backup(self) -> TreeSpec | None:
        """The miss path's tree (speculation.backup; None: the configured shape). `auto` prices
        chains in greedy verification only: at T > 0 (match) the chains' tokens, priced from the
        coupled agreement, came out optimistic on the real pair (docs/edge.md, "Pre-speculation");
        `chain` forces them."""
        cfg = self.prespec
        deterministic = not self.req.mode.stochastic and self.req.tree.kind != "sequence"
        if cfg is None or cfg.backup == "tree" or self._full is None or not deterministic:
            return None
        if cfg.backup == "auto" and (self.req.coupling is not None or self.choice.temperature != 0):
            return None
        eval_ms = self._eval_curve()
        if eval_ms is None:
            return None
        best, options = self._price_backups(eval_ms)
        if cfg.backup == "chain":
            best = max((o for o in options if o.shape.kind == "sequence"), key=lambda o: o.rate)
        self.stats.backups[best.label] = self.stats.backups.get(best.label, 0) + 1
        return None if best is options[0] else best.shape

    def _budget(self, rtt: bool = False) -> int:
        """Nodes of a dynamic tree (TreeSpec budget), from the server's cost curve; 0 otherwise.
        `rtt`: the tree is drafted with nothing in flight (the round trip is on the critical path
        even with pre-speculation)."""
        spec = self.req.tree
        if spec.kind != "budget" or self.drafter is None:
            return 0
        cap = min(self.welcome.limits.max_nodes, self.drafter.max_nodes // 2)
        if spec.budget:
            return min(spec.budget, cap)
        last = self.learned.last_draft
        alpha = self.choice.alpha if self.choice.temperature == 0 else 0.7
        seen = None
        if last is not None:
            seen = (reach_probabilities(last, self.choice), last.frontier_probs, last.tree.max_depth)
        rtt_ms = self.learned.rtt_ms if rtt or self.prespec is None else 0.0
        per_node, gains = self.drafter.ms_per_node(), next_gains(alpha, cap, seen)
        return choose_budget(self._curve(), gains, rtt_ms=rtt_ms, draft_ms_per_node=per_node, max_nodes=cap)

    def _ruled_out(self, full: tuple[int, ...]) -> bool:
        """The verdicts decoded so far exclude `full`. Called from the drafting thread: it reads the
        protocol's immutable snapshot, never its lists."""
        snap = self.proto.snapshot
        if self.cancelled or not snap.generating:
            return True
        return full[: len(snap.committed)] != snap.committed

    # ------------------------------------------------------------------ sending
    def _send_tree(
        self, dr: DraftResult, full: tuple[int, ...], prob: float, parent: int | None
    ) -> Generator[Ask[object], object, int]:
        proto = self.proto
        rid = proto.last_round + 1
        ahead = len(full) - len(proto.committed)
        # (a tree drafted while the target streamed stays below the sequence it was drafted for:
        # the verifier re-roots it)
        known = min(len(proto.committed), dr.tree.committed_len)
        frame = proto.tree(Tree(round=rid, tree=rebase(dr.tree, known)))
        sent = yield from ask(Send(frame, "tree", rid))
        self._trace_send(dr, rid, parent, ahead, prob, sent)
        self._bytes_since_verdict += sent.size
        self.learned.last_draft = dr
        if self.in_flight == rid:  # sent with none in flight, for the committed sequence
            self.est.verdict_due = self._due(sent.at, dr.tree.num_nodes)
        self._sent(Speculation(rid, dr, full, prob, parent, sent.at))
        return rid

    def _trace_send(
        self, dr: DraftResult, rid: int, parent: int | None, ahead: int, prob: float, sent: Sent
    ) -> None:
        trace = self.stats.trace
        if trace is not None:
            tree = dr.tree
            depth = tree.max_depth
            trace.sends.append(SendEvent(sent.at, rid, parent, tree.num_nodes, depth, ahead, prob, sent.size))

    def _sent(self, spec: Speculation) -> None:
        """Tree `spec.round` is on its way: record it with those of its leaves likely enough to be
        reached to be worth evaluating (PrespecConfig.leaf_min_reach), and queue its outcomes."""
        cfg = self.prespec
        leaves: tuple[int, ...] = ()
        if cfg is not None:
            missing = spec.draft.workspace_ids == -1  # not evaluated (merged trees: NOT_IN_WORKSPACE is -2)
            if bool(missing.any()):
                reach = spec.prob * reach_probabilities(spec.draft, self.choice)
                leaves = tuple(np.flatnonzero(missing & (reach >= cfg.leaf_min_reach)).tolist())
        self.ledger.sent(spec, leaves)
        if cfg is not None:
            self.planner.expand_all()

    def _room(self) -> int:
        """Conditional trees the server can still take: max_pending besides the one in flight,
        whose slot stays free for a miss's fallback (the prompt's round is no outstanding tree)."""
        proto = self.proto
        return self.welcome.limits.max_pending - len(proto.outstanding - {proto.in_flight})

    # ------------------------------------------------------------------ mode auto
    def _curve(self) -> dict[int, float]:
        """The forward ms by tree nodes the plans price rounds with: the latest verdict's
        (forward_ms: the verifier's live curve under its current load), else the welcome's."""
        if self.forward:
            return {n: ms for n, ms in self.forward.items() if n >= 1} or self.welcome.verify_cost_ms
        return self.welcome.verify_cost_ms

    def _maps(self) -> tuple[dict[int, float], dict[int, float]] | None:
        """(forward_ms, marginal_ms) with a stream step's price (0 nodes), or None before any."""
        fwd = self.forward or self.welcome.verify_cost_ms
        if not fwd:
            return None
        if 0 not in fwd:  # the welcome prices trees only: a stream step costs at most a 1-node forward
            fwd = {0: auto.at(fwd, 1), **fwd}
        return fwd, self.marginal or fwd

    def _kind(self, v: Verdict, spec: Speculation | None) -> str:
        """The round's kind for the stats: stream, prespec (its tree was sent before the verdict
        it assumed), chain, tree (a tree sent while the target streamed: chain or tree)."""
        if self.req.mode is Mode.AR:
            return "ar"
        if v.round in self._ahead_rounds:
            return self._ahead_rounds[v.round]
        if spec is None:
            streamed = not len(v.accepted_nodes) and (v.round != 0 or self.streams)
            return "stream" if streamed else "tree"
        if spec.parent is not None:
            return "prespec"
        return _shape_kind(spec.draft.tree)

    def _stream_pays(self) -> bool:
        """Mode auto's choice after a miss: let the target stream (True) or draft a tree. The
        trees drafted then (chain, tree) are checked against the stream on the user's clock."""
        plan, maps, eval_ms = self.plan, self._maps(), self._eval_curve()
        if plan is not None and auto.measured_slower(plan, self.learned.realized, ("chain", "tree")):
            self.stats.plans["stream (measured)"] = self.stats.plans.get("stream (measured)", 0) + 1
            return True
        if plan is None or maps is None or eval_ms is None or self._full is None:
            return False  # nothing measured yet: speculate, and measure
        fwd, marg = maps
        _, options = self._price_backups(eval_ms)
        hit = (self.stats.hits + 1) / (self.stats.decided + 2)  # with one hit and one miss as a prior
        rtt = self.learned.rtt_ms
        specs = [auto.price_speculation(o.tokens, o.nodes, o.draft_ms, rtt, hit, fwd, marg) for o in options]
        key = (lambda o: o.user_ms) if plan.objective == "latency" else (lambda o: o.cloud_ms)
        best = auto.choose(plan, min(specs, key=key), auto.price_stream(fwd, marg))
        self.stats.plans[best.kind] = self.stats.plans.get(best.kind, 0) + 1
        return best.kind == "stream"

    def _want_fallback(self) -> bool:
        """A tree is in flight and no stream waits behind it as the fallback for a miss (objective
        latency: on a miss the target streams instead of idling while the edge drafts)."""
        plan, proto = self.plan, self.proto
        if plan is None or plan.objective != "latency" or self.in_flight is None:
            return False
        if proto.is_stream(self.in_flight) or proto.waiting_stream() is not None or self._room() <= 0:
            return False
        maps, eval_ms = self._maps(), self._eval_curve()
        if maps is None or eval_ms is None or self._full is None:
            return True  # nothing measured yet: the verifier streams rather than idles
        best, _ = self._price_backups(eval_ms)
        fwd = maps[0]
        return auto.fallback_pays(
            auto.at(fwd, 0),
            best.draft_ms,
            self.learned.rtt_ms,
            auto.at(fwd, best.nodes),
            best.tokens,
            self.choice.alpha,
            plan.margin,
        )

    def _want_ahead(self) -> bool:
        """The target is streaming, no tree of ours can take over from it yet, and speculation
        pays (else the stream goes on: `_stream_pays`, asked again at every streamed token)."""
        proto = self.proto
        if not proto.is_stream(self.in_flight) or self._ahead_at == len(proto.committed):
            return False
        if any(not proto.is_stream(r) for r in proto.outstanding):
            return False  # a tree is on its way: it may still take over
        assert self.plan is not None
        # streaming teaches nothing of the drafts: every `explore` tokens a tree goes anyway (every
        # `explore_slow` where speculation has been measured slower: only to measure it again)
        slow = auto.measured_slower(self.plan, self.learned.realized)
        every = self.plan.explore_slow if slow else self.plan.explore
        explore = len(proto.committed) - max(self._ahead_at, 0) >= every
        return explore or not self._stream_pays()

    def _send_stream(self, k: int) -> Steps:
        """A stream round of up to k tokens: in flight now, or waiting for a miss."""
        proto = self.proto
        rid = proto.last_round + 1
        frame = proto.stream(Stream(rid, max(1, k)))
        yield from ask(Send(frame, "stream", rid))

    def _ahead_shape(self) -> TreeSpec | None:
        """The tree drafted while the target streams: the miss path's best chain made deeper by
        the tokens the stream will have produced by the time the chain is at the verifier (they
        are taken off its top when it re-roots): m = ceil((d + m) evals + round trip over a stream
        step); the configured shape before the costs are measured."""
        maps, eval_ms = self._maps(), self._eval_curve()
        if maps is None or eval_ms is None or self._full is None:
            return self._backup()
        _, options = self._price_backups(eval_ms)
        chains = [o for o in options if o.shape.kind == "sequence"]
        if not chains:
            return self._backup()
        d = max(chains, key=lambda o: o.rate).shape.chain_depth
        step, e1 = auto.at(maps[0], 0), eval_ms(1)
        m = 1 if step <= e1 else int(np.ceil((d * e1 + self.learned.rtt_ms) / (step - e1)))
        depth = max(1, min(d + m, self.welcome.limits.max_depth))
        return TreeSpec("sequence", ExpansionConfig((1,) * depth), depth=depth)

    def _draft_ahead(self) -> Steps:
        """While the target streams: draft the miss path's tree below the committed sequence and
        send it; the verifier re-roots it below the tokens streamed meanwhile where they follow one
        of its paths (shared.tree_match.reroot) and verifies it instead of the next stream step."""
        committed = tuple(self.proto.committed)
        self._ahead_at = len(committed)
        dr = yield from self._draft_plain(committed, self._ahead_shape())
        now = tuple(self.proto.committed)
        if (
            self.proto.state is not ClientState.GENERATING
            or self.cancelled
            or now[: len(committed)] != committed
        ):
            return
        rid = yield from self._send_tree(dr, committed, 1.0, self.in_flight)
        self._ahead_rounds[rid] = _shape_kind(dr.tree)

    # ------------------------------------------------------------------ frames
    def _refused_speculation(self, e: Error) -> bool:
        """A conditional tree the server had no room for (TOO_MANY_PENDING) is dropped like a stale
        one: the generation goes on. Any other error, or one about the tree in flight, fails it."""
        r = e.round
        if e.fatal or e.code is not ErrorCode.TOO_MANY_PENDING or r is None or r == self.in_flight:
            return False
        if not self.ledger.refused(r):
            return False
        self.stats.prespec_refused += 1
        return True

    def _on_verdict(self, v: Verdict, now: float) -> tuple[Speculation, tuple[int, ...]] | None:
        """Account a verdict (received at clock time `now`); find the tree now in flight; returns
        what to re-anchor on, if needed."""
        st, proto, ledger = self.stats, self.proto, self.ledger
        # the odds the outcome model gave the outcomes of this tree that conditional drafts were
        # started for (counting those abandoned: a draft still running when the verdict comes is
        # finished and sent only if the verdict matches it)
        answered = ledger.answered(v.round)
        spec = answered.spec
        st.rounds += 1
        st.tokens += len(v.tokens)
        st.verify_ms.append(v.verify_ms)
        if v.forward_ms:
            self.forward, self.marginal = v.forward_ms, v.marginal_ms or v.forward_ms
        kind = self._kind(v, spec)
        st.count_round(kind)
        if self.streams:  # the user's time for these tokens, since the previous verdict
            if self._last_verdict_at is not None:
                ms = (now - self._last_verdict_at) * 1e3
                self.learned.realized.observe(kind, len(v.tokens), ms)
                st.time_round(kind, len(v.tokens), ms)
            self._last_verdict_at = now
        if v.gap_ms is not None:
            st.gap_ms.append(v.gap_ms)
        self.est.note_verify(v.verify_ms)
        before = tuple(proto.committed[: v.committed_len - len(v.tokens)])
        if spec is not None and v.round != 0 and len(spec.full) < len(before):
            # the verifier re-rooted this tree below tokens it streamed meanwhile (shared.tree_match.reroot):
            # its accepted nodes index the subtree, and the outcome models learn nothing from it
            rooted = reroot(rebase(spec.draft.tree, len(spec.full)), before)
            if rooted is not None:
                st.record_accepted([int(rooted[0].depth[i]) for i in v.accepted_nodes.tolist()])
            spec = None
        if spec is not None:
            tree = spec.draft.tree
            st.tree_nodes.append(tree.num_nodes)
            if self.welcome.verify_cost_ms:
                idle = advertised_ms(self.welcome.verify_cost_ms, np.asarray([tree.num_nodes]))
                st.idle_verify_ms.append(float(idle[0]))
            acc = v.accepted_nodes.tolist()
            st.record_accepted([int(tree.depth[i]) for i in acc])
            self.learned.calibration.update(spec.draft.expected_accepted, len(acc))
            if not tree.is_stochastic:
                self.choice.observe(spec.draft, acc, v.tokens.tolist())
            if spec.parent is None and self.in_flight == v.round:
                rtt = max(0.0, (now - spec.sent_at) * 1e3 - v.verify_ms)
                st.rtt_ms.append(rtt)
                self.learned.observe_rtt(rtt)
        self._bytes_since_verdict = 0
        committed = tuple(proto.committed)
        # forget what can no longer happen
        ledger.forget_unreachable(committed)
        # the tree now in flight: next_round, or a conditional tree still on its way to the server
        # that matches on arrival (ClientProtocol.acknowledge)
        proto.acknowledge(v)
        nxt = self.in_flight
        # a conditional tree that matched is verified right away: its verdict follows in one verify
        self.est.verdict_due = None if nxt is None else now + self.est.verify_ms / 1e3
        if not v.done and not self.cancelled and self.req.mode is not Mode.AR and kind != "stream":
            # a hit: the next tree was at the server (a stream waiting for the miss is no hit)
            hit = nxt is not None and not proto.is_stream(nxt)
            st.record_outcome(len(v.accepted_nodes), hit, answered.predicted)
        if st.trace is not None:
            hit = nxt is not None and not v.done
            acc_n, n_tok = len(v.accepted_nodes), len(v.tokens)
            st.trace.verdicts.append(VerdictEvent(now, v.round, acc_n, n_tok, v.verify_ms, hit, nxt, v.done))
        if self.prespec is not None:
            self.planner.keep_known()
            self.planner.expand_all()
        live = None if nxt is None else ledger.get(nxt)
        if live is not None and self.workspace_full:
            self.planner.clear()
            return live, committed
        return None


def _shape_kind(tree: TokenTree) -> str:
    return "chain" if tree.max_depth == tree.num_nodes else "tree"


__all__ = ["Clock", "DrafterProfile", "Refused", "SpeculationCore", "Steps"]
