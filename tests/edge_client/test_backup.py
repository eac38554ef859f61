"""The miss path (speculation.backup): which tree is drafted after a miss, priced with measured costs."""

from __future__ import annotations

import pytest

from edge_client.speculation import DraftPlain, PrespecConfig, Request, TreeSpec
from edge_client.speculation.backup import choose_backup, draft_ms_of, level_rows
from shared.messages import Mode
from shared.tree import ExpansionConfig
from tests.edge_client.fake_drafter import FakeDrafter
from tests.edge_client.scripted import Scripted

MAIN = TreeSpec("static", ExpansionConfig((2, 1, 1, 1, 1, 1, 1, 1)))
CPU_VERIFY = {1: 400.0, 4: 480.0, 8: 560.0, 16: 740.0, 32: 1100.0}  # the 1.5B fp32 on one core
FLAT_VERIFY = {1: 20.0, 64: 21.0}  # a GPU's shape


def test_level_rows_and_draft_time_of_a_static_tree() -> None:
    assert level_rows(ExpansionConfig((2, 1, 1))) == [2, 2, 2]
    assert level_rows(ExpansionConfig((1, 3, 2))) == [1, 3, 6]
    # the bonus token's sync, then every level but the leaves
    assert draft_ms_of([2, 2, 2], lambda n: 10.0 * n) == 10.0 + 20.0 + 20.0
    assert draft_ms_of([1], lambda n: 7.0) == 7.0


def test_a_slow_drafter_and_a_steep_verifier_get_a_chain() -> None:
    """The 0.5B drafting at ~90 ms an evaluation for a CPU verifier: the full 16-node tree costs
    8 evaluations on the critical path; a chain of a few tokens gives more tokens per ms."""
    best, options = choose_backup(
        MAIN, 5.5, 16, 0.86, lambda n: 85.0 + 2.0 * n, CPU_VERIFY, 50.0, max_depth=16
    )
    assert best.shape.kind == "sequence" and 2 <= best.shape.chain_depth < 8
    assert best.rate == max(o.rate for o in options) and best.rate > options[0].rate
    full = options[0]
    assert full.label == "tree" and full.draft_ms == pytest.approx(87.0 + 7 * 89.0)
    assert full.round_ms == pytest.approx(full.draft_ms + 50.0 + 740.0)
    chain = next(o for o in options if o.label == f"chain{best.shape.chain_depth}")
    d = best.shape.chain_depth
    assert chain.tokens == pytest.approx(1 + sum(0.86**i for i in range(1, d + 1)))
    assert chain.draft_ms == pytest.approx(d * 87.0)


def test_a_fast_drafter_and_a_flat_verifier_keep_the_full_tree() -> None:
    best, options = choose_backup(MAIN, 5.5, 16, 0.86, lambda n: 1.0, FLAT_VERIFY, 50.0, max_depth=16)
    assert best is options[0] and best.label == "tree"


def test_alpha_must_be_a_probability() -> None:
    with pytest.raises(ValueError, match="alpha must be a probability"):
        choose_backup(MAIN, 5.5, 16, 1.5, lambda n: 1.0, FLAT_VERIFY, 0.0, max_depth=16)


def _miss(backup: str, eval_ms: float, verify: dict[int, float] = CPU_VERIFY) -> Scripted:
    """A session whose first verdict misses every conditional tree: the core drafts the fallback."""
    s = Scripted(
        FakeDrafter(64),
        Request(Mode.GREEDY, MAIN),
        PrespecConfig(fanout=2, max_chain=1, gate=False, backup=backup),
        eval_ms=lambda rows: eval_ms,
        verify_cost_ms=verify,
    )
    s.start([3, 14, 15, 9, 26, 5])
    s.idle()
    assumed = {sp.full[6] for sp in s.core.ledger if len(sp.full) > 6}
    tree0 = s.trees[0]
    bonus = next(
        t for t in range(1, 64) if t not in assumed and t not in tree0.tokens[tree0.depth == 1].tolist()
    )
    s.verdict(0, [], bonus)
    return s


def test_after_a_miss_a_slow_drafter_drafts_a_chain_and_it_is_verified_as_sent() -> None:
    s = _miss("auto", 90.0)
    plain = s.draft_actions(DraftPlain)
    assert plain[0].shape is None  # the first tree (with the prompt) has the configured shape
    fallback = plain[-1]
    assert fallback.shape is not None and fallback.shape.kind == "sequence"
    sent = s.sent_trees()[-1]
    tree = sent.tree
    assert s.core.in_flight == sent.round and tree.num_nodes == fallback.shape.chain_depth
    assert tree.max_depth == tree.num_nodes  # a chain
    assert s.stats.backups == {f"chain{fallback.shape.chain_depth}": 1}
    # the chain's outcomes are pre-speculated like any tree's
    s.idle()
    assert any(sp.parent == sent.round for sp in s.core.ledger)


def test_the_configured_tree_when_asked_or_when_drafting_and_nodes_are_cheap() -> None:
    for backup, ms, verify in (("tree", 90.0, CPU_VERIFY), ("auto", 0.01, FLAT_VERIFY)):
        s = _miss(backup, ms, verify)
        assert s.draft_actions(DraftPlain)[-1].shape is None, backup
        assert s.sent_trees()[-1].tree.num_nodes == 16
    assert _miss("chain", 0.01, FLAT_VERIFY).draft_actions(DraftPlain)[-1].shape is not None


def test_backup_must_be_a_known_policy() -> None:
    with pytest.raises(ValueError, match=r"PrespecConfig\.backup must be 'auto', 'tree' or 'chain'"):
        PrespecConfig(backup="fast")


def test_the_drafters_cost_per_evaluation_is_measured_by_rows() -> None:
    """DrafterStats.eval_ms: the running average at a measured size, linear between sizes, flat
    below the smallest and in proportion to the rows beyond the largest (a batch larger than any
    measured is priced pessimistically, so plans grow batches as they are measured)."""
    from edge_client.drafters.base import DrafterStats

    st = DrafterStats()
    assert st.eval_ms(4) is None
    st.observe(1, 80.0)
    st.observe(4, 100.0)
    assert st.eval_ms(1) == 80.0 and st.eval_ms(4) == 100.0
    assert st.eval_ms(2) == pytest.approx(80.0 + 20.0 / 3)
    assert st.eval_ms(24) == pytest.approx(600.0)  # 100 ms for 4 rows: 25 a row beyond
    st.observe(4, 200.0)  # a running average, not the last sample
    assert st.eval_ms(4) == pytest.approx(0.8 * 100.0 + 0.2 * 200.0)
    drafter = FakeDrafter(64)
    drafter.sync([1, 2, 3])
    drafter.extend([-1, -1, 0], [4, 5, 6])
    assert drafter.stats.eval_ms(3) is not None and drafter.stats.eval_ms(3) == drafter.stats.by_rows[3]


def test_auto_keeps_the_configured_tree_at_a_temperature_and_chain_forces_chains() -> None:
    """In match at T > 0 (coupled drafting) `auto` drafts the configured tree after a miss (the
    chains' priced tokens were optimistic there); `chain` still drafts chains."""
    from edge_client.trees import Coupling

    for backup, chain in (("auto", False), ("chain", True)):
        s = Scripted(
            FakeDrafter(64),
            Request(Mode.MATCH, MAIN, coupling=Coupling(seed=5, temperature=0.7)),
            PrespecConfig(fanout=2, max_chain=1, gate=False, backup=backup),
            eval_ms=lambda rows: 90.0,
            verify_cost_ms=CPU_VERIFY,
        )
        s.start([3, 14, 15, 9, 26, 5])
        s.idle()
        assumed = {sp.full[6] for sp in s.core.ledger if len(sp.full) > 6}
        first = s.trees[0]
        drafted = first.tokens[first.depth == 1].tolist()
        bonus = next(t for t in range(1, 64) if t not in assumed and t not in drafted)
        s.verdict(0, [], bonus)
        shape = s.draft_actions(DraftPlain)[-1].shape
        assert (shape is not None and shape.kind == "sequence") is chain, backup
