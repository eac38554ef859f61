"""The speculation core driven directly: scripted verdicts, the fake drafter, no server, no patching.

Hits, misses, stales, abandoned drafts, refused trees, chains of conditional trees and the end of
a generation mid-flight, each checked on what the core sends and how it accounts it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from edge_client.speculation import (
    DraftConditional,
    Drafted,
    DraftPlain,
    PrespecConfig,
    Refused,
    Request,
    Send,
    TreeSpec,
)
from edge_client.speculation.estimates import ChoiceModel
from edge_client.speculation.ledger import Answered, Ledger
from edge_client.speculation.outcomes import reach_probabilities
from edge_client.stats import RoundTrace
from shared.messages import Mode, Prompt, SessionLimits, Verdict
from shared.tree import ExpansionConfig
from tests.edge_client.fake_drafter import FakeDrafter
from tests.edge_client.scripted import Scripted

PROMPT = [3, 14, 15, 9, 26, 5]
SHAPE = TreeSpec("static", ExpansionConfig((2, 1, 1)))


def _session(prespec: PrespecConfig | None = None, **kw: Any) -> Scripted:
    # the tests of the ledger's chains draft every outcome with the full shape (no outcome cache:
    # tests/edge_client/test_schedule.py has it)
    cfg = prespec if prespec is not None else PrespecConfig(fanout=3, max_chain=2, gate=False, cache=False)
    return Scripted(FakeDrafter(64), Request(Mode.GREEDY, SHAPE), cfg, **kw)


def _children_of(s: Scripted, parent: int) -> dict[int, tuple[int, ...]]:
    """The conditional trees sent for outcomes of tree `parent`: round -> the sequence it assumes."""
    return {sp.round: sp.full for sp in s.core.ledger.children_of(parent)}


def _plain_drafts(s: Scripted) -> int:
    return len(s.draft_actions(DraftPlain))


def test_first_tree_rides_with_the_prompt_and_conditional_trees_follow() -> None:
    s = _session()
    s.start(PROMPT)
    assert 0 in s.trees and s.core.in_flight == 0 and _plain_drafts(s) == 1
    assert s.idle() > 0
    kids = _children_of(s, 0)
    assert kids and s.stats.prespec_sent == len(s.proto.outstanding)
    for r, full in kids.items():
        tree = s.trees[r]
        # each assumes an outcome of tree 0 (accepted path + bonus) and is drafted below it
        assert full[: len(PROMPT)] == tuple(PROMPT) and len(full) > len(PROMPT)
        assert tree.base == len(PROMPT) and tuple(tree.cond.tolist()) == full[len(PROMPT) :]
    # chains: outcomes of conditional trees too; only trees fewer than max_chain (2) ahead expand
    assert any(sp.parent not in (None, 0) for sp in s.core.ledger)
    assert all(s.core.ledger.ahead(sp) <= 2 for sp in s.core.ledger)


def test_a_hit_needs_no_draft_and_the_chain_goes_on() -> None:
    s = _session()
    s.start(PROMPT)
    s.idle()
    rid, full = max(_children_of(s, 0).items(), key=lambda kv: s.core.ledger[kv[0]].prob)
    drafts = _plain_drafts(s)
    v = s.verdict_to(0, full, next_round=rid)
    assert [d.round for d in s.delivered] == [v.round] and tuple(s.proto.committed) == full
    assert s.core.in_flight == rid and _plain_drafts(s) == drafts  # no synchronous draft
    assert s.stats.hits == 1 and s.stats.decided == 1
    assert all(sp.full[: len(full)] == full for sp in s.core.ledger)  # the rest forgotten
    # the trees that assumed another outcome came back stale; the chain below `rid` goes on
    assert all(r in s.core.ledger for r in s.proto.outstanding)
    s.idle()
    grand = _children_of(s, rid)
    assert grand, "outcomes of the tree now in flight get conditional trees"
    r2, full2 = next(iter(grand.items()))
    s.verdict_to(rid, full2, next_round=r2)
    assert s.core.in_flight == r2 and s.stats.hits == 2 and _plain_drafts(s) == drafts


def test_a_miss_drafts_below_the_committed_sequence() -> None:
    s = _session()
    s.start(PROMPT)
    s.idle()
    assumed = {full[len(PROMPT) :][:1] for full in _children_of(s, 0).values()}
    bonus = next(t for t in range(64) if (t,) not in assumed and t not in s.trees[0].tokens[:2].tolist())
    s.verdict(0, [], bonus)  # nothing accepted, a bonus no conditional tree assumed
    assert tuple(s.proto.committed) == (*PROMPT, bonus)
    last = s.draft_actions(DraftPlain)[-1]
    assert last.committed == (*PROMPT, bonus) and _plain_drafts(s) == 2
    sent = s.sent_trees()[-1]
    assert sent.tree.base == len(PROMPT) + 1 and sent.tree.cond.size == 0
    assert s.core.in_flight == sent.round and s.core.anchor == (*PROMPT, bonus)
    assert s.stats.hits == 0 and s.stats.decided == 1
    assert not any(sp.full[: len(PROMPT) + 1] != (*PROMPT, bonus) for sp in s.core.ledger)


def test_a_conditional_tree_still_on_its_way_is_taken_as_the_tree_in_flight() -> None:
    """The verdict names no next round, but a tree that matches was sent before it arrived: the
    server verifies it on arrival (shared.protocol.tree_matches), so the edge drafts nothing."""
    s = _session()
    s.start(PROMPT)
    s.idle()
    rid, full = next(iter(_children_of(s, 0).items()))
    drafts = _plain_drafts(s)
    s.verdict_to(0, full, next_round=None)
    assert s.core.in_flight == rid and _plain_drafts(s) == drafts and s.stats.hits == 1
    # ... and when that tree comes back stale after all, the edge falls back to drafting
    s.stale(rid)
    assert s.core.in_flight is not None and s.core.in_flight != rid
    assert _plain_drafts(s) == drafts + 1


def _a_missing_bonus(s: Scripted, rnd: int) -> int:
    """A bonus after nothing accepted in tree `rnd` that no tree sent assumes: a miss."""
    n = len(s.proto.committed)
    assumed = {sp.full[n] for sp in s.core.ledger if len(sp.full) > n}
    firsts = {int(s.trees[rnd].tokens[c]) for c in s.trees[rnd].children_of(-1)}
    return next(t for t in range(1, 64) if t not in assumed | firsts)


@pytest.mark.parametrize("max_pending", [1, 2, 4])
@pytest.mark.parametrize("in_flight", ["prompt", "conditional"])
def test_speculations_leave_the_slot_of_the_tree_in_flight_to_a_fallback(
    max_pending: int, in_flight: str
) -> None:
    """The server keeps max_pending trees besides the one it verifies. Conditional trees never
    take more (the prompt's tree in flight is not an outstanding tree round, a conditional one is),
    so after a miss the synchronous tree goes out while the stales of all of them are still on
    their way (a live 1000 ms round trip overflowed here: the edge tried an eighth tree)."""
    s = _session(
        PrespecConfig(fanout=3, max_chain=4, gate=False, cache=False),
        limits=SessionLimits(max_pending=max_pending),
    )
    s.start(PROMPT)
    s.idle()
    rnd = 0
    if in_flight == "conditional":
        rnd, full = next(iter(_children_of(s, 0).items()))
        s.verdict_to(0, full, next_round=rnd)
        s.idle()
    speculations = s.proto.outstanding - {rnd}
    assert len(speculations) == max_pending, "the core fills the room it has, no more"
    drafts = _plain_drafts(s)
    s.verdict(rnd, [], _a_missing_bonus(s, rnd), stales_first=False)
    fallback = s.sent_trees()[-1].round
    assert _plain_drafts(s) == drafts + 1 and s.core.in_flight == fallback
    assert not s.proto.outstanding - {fallback}, "the speculations came back stale"
    s.idle()
    assert len(s.proto.outstanding - {fallback}) == max_pending  # speculating again below it


def test_a_tree_refused_for_room_is_dropped_and_one_in_flight_fails_the_generation() -> None:
    s = _session()
    s.start(PROMPT)
    s.idle()
    rid = next(iter(_children_of(s, 0)))
    s.too_many_pending(rid)
    assert s.stats.prespec_refused == 1 and rid not in s.core.ledger
    with pytest.raises(Refused):
        s.too_many_pending(0)  # the tree in flight: not a speculation, the generation fails


def test_a_draft_a_verdict_rules_out_is_abandoned_and_not_sent() -> None:
    s = _session(PrespecConfig(fanout=3, max_chain=2, gate=False, batch=1, cache=False))
    s.start(PROMPT)
    while s.core.ledger.has_pending_leaves():
        s._run(s.core.idle(quiet=True))
    steps = s.core.idle(quiet=True)
    assert steps is not None
    action = steps.send(None)
    assert isinstance(action, DraftConditional) and len(action.fulls) == 1
    assumed = action.fulls[0][len(PROMPT)]
    other = next(t for t in range(64) if t != assumed and t not in s.trees[0].tokens[:2].tolist())
    sent = len(s.sent_trees())
    # the verdict is decoded (as the executor's pump does) while the draft runs
    from shared.messages import encode

    v = Verdict(
        round=0,
        tokens=np.asarray([other], dtype=np.int32),
        accepted_nodes=np.zeros(0, np.int32),
        has_bonus=True,
        committed_len=len(PROMPT) + 1,
        verify_ms=1.0,
    )
    s.proto.receive(encode(v), acknowledge=False)
    assert all(stop() for stop in action.stops)
    result = s.step.run(action)
    with pytest.raises(StopIteration):
        steps.send(result)
    assert s.stats.prespec_cancelled == 1 and len(s.sent_trees()) == sent


def test_the_end_of_the_generation_mid_flight() -> None:
    s = _session()
    s.start(PROMPT)
    s.idle()
    rid, full = next(iter(_children_of(s, 0).items()))
    s.verdict_to(0, full, next_round=rid)
    drafts = _plain_drafts(s)
    s.verdict(rid, [], 0, done=True)  # EOS as the bonus: done, with conditional trees outstanding
    assert s.core.finished and s.delivered[-1].done and s.core.in_flight is None
    assert _plain_drafts(s) == drafts and s.core.idle(quiet=True) is None


def test_leaves_are_evaluated_only_when_they_may_be_reached() -> None:
    """A sent tree's leaves are evaluated (to predict the bonus after a full acceptance) only where
    the outcome model gives them a fair chance, leaf by leaf; with a model sure the draft is never
    right, the drafting thread never spends time on leaves."""
    s = _session(PrespecConfig(fanout=3, max_chain=2, gate=False, leaf_min_reach=0.1, cache=False))
    s.start(PROMPT)
    spec = s.core.ledger[0]
    reach = spec.prob * reach_probabilities(spec.draft, s.core.choice)
    unevaluated = set(np.flatnonzero(spec.draft.workspace_ids < 0).tolist())
    s.idle()
    asked = [set(nodes) for a in s.leaves_asked() for r, _, nodes in a.work if r == 0]
    assert asked, "the likely leaves of the first tree are evaluated"
    evaluated = set().union(*asked)
    assert evaluated <= unevaluated
    assert all(reach[n] >= 0.1 for n in evaluated)
    assert all(reach[n] < 0.1 for n in unevaluated - evaluated)
    assert unevaluated - evaluated, "some side branches were left out"
    assert bool((s.core.ledger[0].draft.workspace_ids[list(evaluated)] >= 0).all())

    never = Scripted(FakeDrafter(64), Request(Mode.GREEDY, SHAPE), PrespecConfig(leaf_min_reach=0.1))
    never.learned.choice[(0.0, False)] = ChoiceModel(temperature=0.0, agree=0.0, tested=1e6, decay=1.0)
    never = Scripted(never.drafter, never.req, never.prespec, learned=never.learned)
    never.start(PROMPT)
    never.idle()
    assert not never.leaves_asked()


def test_without_prespeculation_each_round_is_synchronous() -> None:
    s = Scripted(FakeDrafter(64), Request(Mode.GREEDY, SHAPE), None)
    s.start(PROMPT)
    assert s.idle() == 0 and s.proto.outstanding == set()
    tree = s.trees[0]
    s.verdict(0, [0], 7 if int(tree.tokens[s.trees[0].children_of(0)[0]]) != 7 else 8)
    assert _plain_drafts(s) == 2 and s.core.in_flight == 1 and s.proto.outstanding == {1}
    assert s.stats.rounds == 1 and s.stats.tree_nodes == [tree.num_nodes]


@pytest.mark.parametrize("seed", range(24))
def test_random_sessions_keep_the_wire_limits_and_one_tree_in_flight(seed: int) -> None:
    """Random scripted verifiers: hits (named in next_round or still on their way), misses, stales
    decoded before or after the verdict, at random max_pending, fanout and chain depth. The core
    never sends past the server's room (ClientProtocol.tree would raise), conditional trees leave
    the in-flight slot free, and after every verdict but the last exactly one tree is in flight.
    Odd seeds run the outcome cache with a slow scripted drafter and a long round trip, so that its
    chains fit."""
    rng = np.random.default_rng(seed)
    max_pending = int(rng.integers(1, 5))
    cache = seed % 2 == 1
    cfg = PrespecConfig(
        fanout=int(rng.integers(1, 4)), max_chain=int(rng.integers(1, 4)), gate=False, cache=cache
    )
    timing: dict[str, Any] = {"eval_ms": lambda n: 40.0 + 2.0 * n, "draft_ms": 30.0} if cache else {}
    s = _session(cfg, limits=SessionLimits(max_pending=max_pending), **timing)
    if cache:
        s.learned.rtt_ms = 400.0
    s.start(PROMPT)
    rounds = int(rng.integers(4, 16))
    for i in range(rounds):
        s.idle()
        rnd = s.core.in_flight
        assert rnd is not None and (rnd == 0 or rnd in s.proto.outstanding)
        assert len(s.proto.outstanding - {rnd}) <= max_pending
        hits = [r for r in _children_of(s, rnd) if r in s.proto.outstanding]
        committed = tuple(s.proto.committed)
        if i == rounds - 1:
            s.verdict(rnd, [], 7, done=True)
            assert s.core.finished and s.core.in_flight is None
            break
        first = bool(rng.random() < 0.5)
        if hits and rng.random() < 0.7:
            r = hits[int(rng.integers(len(hits)))]
            full = s.core.ledger[r].full
            s.verdict_to(rnd, full, next_round=r if rng.random() < 0.5 else None, stales_first=first)
            assert s.core.in_flight == r and tuple(s.proto.committed) == full
        else:
            bonus = _a_missing_bonus(s, rnd)
            s.verdict(rnd, [], bonus, stales_first=first)
            assert tuple(s.proto.committed) == (*committed, bonus)
            fallback = s.sent_trees()[-1]
            assert s.core.in_flight == fallback.round and fallback.tree.base == len(committed) + 1
    assert s.stats.rounds == len(s.delivered) == rounds


def _gated_run(draft_ms: float) -> Scripted:
    """The first tree in flight, the verdict due in 60 ms (a 60 ms round trip learned, verified
    in no time), every draft taking `draft_ms` on the scripted clock; the core works until it
    stops on its own."""
    cfg = PrespecConfig(fanout=3, max_chain=2, gate=True, min_gain=0.0, batch=1, cache=False)
    s = _session(cfg, draft_ms=draft_ms)
    s.learned.rtt_ms = 60.0
    s.start(PROMPT)
    s.idle()
    return s


def test_the_cost_gate_reads_the_cores_clock() -> None:
    """The gate weighs a conditional draft against the time left before the verdict in flight is
    due, on the core's clock: when drafting takes no time on it every candidate is worth drafting;
    when each draft takes 25 ms the verdict comes due after two, and the unlikely outcomes are
    held back (a fallback would wait for them)."""
    free = _gated_run(0.0)
    assert free.stats.prespec_gated == 0 and free.stats.prespec_sent > 2
    slow = _gated_run(25.0)
    assert slow.stats.prespec_gated > 0
    assert 0 < slow.stats.prespec_sent < free.stats.prespec_sent
    due = slow.core.est.verdict_due
    assert due is not None and slow.clock() > due - 0.025  # it stopped with less than a draft left
    # the clock moved only by the drafts (the first tree, leaf evaluations, conditional trees)
    steps = (slow.clock() - 1000.0) / 0.025
    assert steps == pytest.approx(round(steps)) and round(steps) >= 1 + slow.stats.prespec_sent


def test_a_shell_answering_with_the_wrong_result_fails_naming_the_action() -> None:
    """Every action checks its result's type: a shell bug surfaces as a TypeError naming the
    action, not as an attribute error deep in the core."""
    s = _session()
    steps = s.core.start(Prompt(tokens=np.asarray(PROMPT, np.int32), mode=Mode.GREEDY, max_new_tokens=8))
    action = steps.send(None)
    assert isinstance(action, DraftPlain)
    with pytest.raises(TypeError, match="DraftPlain got a Drafted"):
        steps.send(Drafted(()))
    with pytest.raises(TypeError, match="Send got a float"):
        Send(b"", "tree", 1).take(0.5)
    with pytest.raises(TypeError, match="DraftConditional got a Drafted"):
        DraftConditional((), ((1,), (2,)), (lambda: False, lambda: False), lockstep=True).take(
            Drafted((None,))
        )


def test_the_ledger_is_changed_only_by_its_transitions() -> None:
    """A round's life in the ledger: sent (with leaves pending), leaves evaluated, expanded once,
    attempted, answered with the share of its odds attempted; stale and refused conditional trees
    leave it; a verdict forgets what it rules out."""
    s = _session()
    s.start(PROMPT)
    first = s.core.ledger[0]
    ledger = Ledger()
    ledger.sent(first, leaves=(3, 4))
    with pytest.raises(ValueError, match="round 0 is in the ledger already"):
        ledger.sent(first)
    assert ledger.leaves_pending() == {0: (3, 4)} and ledger.to_expand(2) == []
    ledger.leaves_evaluated({0: None})
    assert not ledger.has_pending_leaves() and ledger.to_expand(2) == [0]
    assert ledger.expanding(0) is first and ledger.expanding(0) is None and ledger.to_expand(2) == []
    a = dataclasses.replace(first, round=1, full=(*PROMPT, 7), prob=0.5, parent=0)
    b = dataclasses.replace(first, round=2, full=(*PROMPT, 8), prob=0.25, parent=0)
    c = dataclasses.replace(first, round=3, full=(*PROMPT, 7, 9), prob=0.2, parent=1)
    for spec in (a, b, c):
        ledger.sent(spec)
    assert ledger.ahead(c) == 2 and [sp.round for sp in ledger.children_of(0)] == [1, 2]
    assert ledger.refused(0) is False and 0 in ledger  # the tree in flight is no conditional tree
    assert ledger.refused(2) is True and 2 not in ledger
    ledger.attempt(0, 0.5)
    ledger.attempt(0, 0.25)
    answered = ledger.answered(0)
    assert answered.spec is first and answered.predicted == pytest.approx(0.75)
    assert ledger.answered(0) == Answered(None, 0.0)
    ledger.forget_unreachable((*PROMPT, 8))  # the verdict went another way: 1 and 3 cannot happen
    assert len(ledger) == 0
    ledger.sent(a)
    ledger.stale(1)
    assert 1 not in ledger


def test_the_round_trace_records_sends_and_verdicts_on_the_cores_clock() -> None:
    """With a trace, every tree sent and every verdict taken up is recorded with the core's clock:
    the first tree with the prompt, conditional trees with their parent and odds, hits and the
    miss's fallback."""
    s = _session(draft_ms=10.0)
    s.stats.trace = RoundTrace()
    s.start(PROMPT)
    s.idle()
    rid, full = next(iter(_children_of(s, 0).items()))
    s.verdict_to(0, full, next_round=rid)
    s.verdict(rid, [], _a_missing_bonus(s, rid))
    trace = s.stats.trace
    assert [e.round for e in trace.sends] == [0, *(t.round for t in s.sent_trees())]
    first = trace.sends[0]
    assert first.parent is None and first.ahead == 0 and first.t == pytest.approx(1000.010)
    kid = next(e for e in trace.sends if e.round == rid)
    assert kid.parent == 0 and kid.ahead == len(full) - len(PROMPT) and 0 < kid.prob < 1
    assert kid.nodes == s.trees[rid].num_nodes and kid.depth == s.trees[rid].max_depth
    assert [(v.round, v.hit, v.next) for v in trace.verdicts[:1]] == [(0, True, rid)]
    miss = trace.verdicts[1]
    assert miss.round == rid and miss.accepted == 0 and miss.tokens == 1 and miss.hit is False
    assert miss.next is None  # the fallback is drafted after the verdict was taken up
    assert trace.sends[-1].parent is None and trace.sends[-1].t > miss.t
    assert sum(v.hit for v in trace.verdicts) == s.stats.hits
    assert set(trace.as_dict()) == {"sends", "verdicts", "drafts"}
