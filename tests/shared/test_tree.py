from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared import ErrorCode, ExpansionConfig, ProtocolError, SparseDist, SparseRows, TokenTree, merge
from shared.tree import Draws

WORDS = ["machine", "learning", "algorithm", "is", "system", "design", "translation", "models", "are"]
ID = {w: i for i, w in enumerate(WORDS)}


def ids(text: str) -> list[int]:
    return [ID[w] for w in text.split()]


def test_specinfer_figure3_merge() -> None:
    """The four SSM sequences of SpecInfer Figure 3 merge into the paper's tree.

    "machine" is row 0 (the last committed token); each SSM proposes the three tokens after it.
    """
    seqs = [
        "machine learning algorithm is",
        "machine learning system design",
        "machine translation models are",
        "machine translation system design",
    ]
    prompt = ids("machine")
    chains = [TokenTree.chain(ids(s)[1:], base=0, cond=prompt) for s in seqs]
    tree = merge(chains)
    assert tree.committed_len == 1
    words = [WORDS[t] for t in tree.tokens]
    assert words == [
        "learning",
        "algorithm",
        "is",
        "system",
        "design",
        "translation",
        "models",
        "are",
        "system",
        "design",
    ]
    assert tree.parents.tolist() == [-1, 0, 1, 0, 3, -1, 5, 6, 5, 8]
    assert tree.depth.tolist() == [1, 2, 3, 2, 3, 1, 2, 3, 2, 3]
    # every sequence is a root-to-leaf path, and there is no other leaf
    leaves = {tuple(WORDS[t] for t in tree.path_tokens(i)) for i in tree.leaves()}
    assert leaves == {tuple(s.split()[1:]) for s in seqs}
    # the two "system design" branches stay apart: they follow different prefixes
    assert tree.children_of(-1) == [0, 5]
    assert tree.children_of(0) == [1, 3]
    assert tree.children_of(5) == [6, 8]
    assert tree.dfs_order() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    tree.validate(len(WORDS), max_nodes=16, max_depth=3, stochastic=False)


def test_masks_and_positions_literal() -> None:
    #   row0 -> a(0) -> c(2)
    #        -> b(1) -> d(3) -> e(4)
    t = TokenTree.build([10, 11, 12, 13, 14], [-1, -1, 0, 1, 3], base=7)
    assert t.depth.tolist() == [1, 1, 2, 2, 3]
    assert t.positions.tolist() == [7, 7, 8, 8, 9]
    assert t.row0_position == 6
    expect = np.array(
        [
            [1, 0, 0, 0, 0],
            [0, 1, 0, 0, 0],
            [1, 0, 1, 0, 0],
            [0, 1, 0, 1, 0],
            [0, 1, 0, 1, 1],
        ],
        dtype=bool,
    )
    assert np.array_equal(t.ancestor_mask(), expect)
    rows = t.row_mask()
    assert rows.shape == (6, 6)
    assert rows[:, 0].all()
    assert rows[0].tolist() == [True, False, False, False, False, False]
    assert rows[5].tolist() == [True, False, True, False, True, True]
    assert t.dfs_order() == [0, 2, 1, 3, 4]
    assert t.path(4) == [1, 3, 4]
    assert t.leaves() == [2, 4]


def test_conditional_tree_positions_literal() -> None:
    # The edge knew 5 committed tokens and assumes the round in flight adds [40, 41]: L = 7.
    t = TokenTree.build([50, 51, 52], [-1, 0, 0], base=5, cond=[40, 41])
    assert t.committed_len == 7
    assert t.row0_position == 6  # row 0 is cond[-1], the assumed bonus token
    assert t.positions.tolist() == [7, 8, 8]
    assert t.row_mask().astype(int).tolist() == [
        [1, 0, 0, 0],
        [1, 1, 0, 0],
        [1, 1, 1, 0],
        [1, 1, 0, 1],
    ]


def test_expansion_config() -> None:
    cfg = ExpansionConfig()
    assert cfg.ks == (1, 1, 3, 1, 1, 1, 1, 1)
    assert cfg.num_nodes == 1 + 1 + 3 * 6 == 20
    assert cfg.width == 3 and cfg.depth == 8
    assert ExpansionConfig.parse("2,2,1").num_nodes == 2 + 4 + 4
    par = ExpansionConfig((2, 2)).parents().tolist()
    assert par == [-1, -1, 0, 0, 1, 1]
    t = TokenTree.build(list(range(20)), ExpansionConfig().parents())
    assert t.max_depth == 8 and len(t.leaves()) == 3
    with pytest.raises(ValueError):
        ExpansionConfig((1, 0))
    with pytest.raises(ValueError):
        ExpansionConfig.parse("1,x")


@pytest.mark.parametrize(
    ("tree", "kwargs", "code", "field"),
    [
        (TokenTree.build([1, 99], [-1, 0], base=3), {}, ErrorCode.OUT_OF_RANGE, "tree.tokens"),
        (TokenTree.build([1, -2], [-1, 0], base=3), {}, ErrorCode.OUT_OF_RANGE, "tree.tokens"),
        (TokenTree.build([1, 2], [-1, 1], base=3), {}, ErrorCode.BAD_TREE, "tree.parents"),
        (TokenTree.build([1, 2], [-1, -5], base=3), {}, ErrorCode.BAD_TREE, "tree.parents"),
        (TokenTree.build([1, 2], [-1, -1, 0], base=3), {}, ErrorCode.BAD_TREE, "tree.parents"),
        (TokenTree.build(list(range(9)), [-1] * 9, base=3), {}, ErrorCode.LIMIT_EXCEEDED, "tree.tokens"),
        (TokenTree.chain([1, 2, 3, 4, 5], base=3), {}, ErrorCode.LIMIT_EXCEEDED, "tree.parents"),
        (TokenTree.build([1, 1], [-1, -1], base=3), {}, ErrorCode.BAD_TREE, "tree.tokens"),
        (TokenTree.build([1], [-1], base=0), {}, ErrorCode.BAD_TREE, "tree.base"),
        (TokenTree.build([1], [-1], base=2, cond=[77]), {}, ErrorCode.OUT_OF_RANGE, "tree.cond"),
        (TokenTree.build([1], [-1], base=2), {"stochastic": True}, ErrorCode.BAD_TREE, "tree.draws"),
    ],
)
def test_validation_names_the_field(
    tree: TokenTree, kwargs: dict[str, Any], code: ErrorCode, field: str
) -> None:
    with pytest.raises(ProtocolError) as info:
        tree.validate(vocab_size=20, max_nodes=8, max_depth=4, **kwargs)
    assert info.value.code is code
    assert info.value.field == field


def _stochastic(tokens: list[int], parents: list[int], rows: list[SparseDist], qrow: list[int]) -> TokenTree:
    n = len(tokens)
    draws = Draws(
        node=np.arange(n, dtype=np.int32),
        drafter=np.zeros(n, dtype=np.int32),
        qrow=np.asarray(qrow, dtype=np.int32),
        q=SparseRows.from_rows(rows),
    )
    return TokenTree.build(tokens, parents, base=2, draws=draws)


def test_stochastic_validation() -> None:
    q0 = SparseDist.from_weights([1, 2, 3], [30000, 30000, 5536])
    q1 = SparseDist.from_weights([4, 5], [65000, 536])
    good = _stochastic([1, 1, 4], [-1, -1, 0], [q0, q1], [0, 0, 1])  # a duplicate draw of token 1
    good.validate(20, 8, 4, stochastic=True)
    with pytest.raises(ProtocolError) as info:  # duplicates are illegal without replacement
        good.validate(20, 8, 4, stochastic=True, without_replacement=True)
    assert info.value.field == "tree.draws.node"
    zero = _stochastic([1, 7], [-1, -1], [q0], [0, 0])  # token 7 has no mass in q0
    with pytest.raises(ProtocolError) as info:
        zero.validate(20, 8, 4, stochastic=True)
    assert info.value.code is ErrorCode.BAD_DISTRIBUTION
    two_parents = _stochastic([1, 2], [-1, 0], [q0], [0, 0])  # one q row used at row 0 and node 0
    with pytest.raises(ProtocolError) as info:
        two_parents.validate(20, 8, 4, stochastic=True)
    assert info.value.field == "tree.draws.qrow"
    bad_q = SparseRows(np.array([0, 2]), np.array([1, 2], np.int32), np.array([1, 2], np.int64))
    broken = TokenTree.build(
        [1],
        [-1],
        base=2,
        draws=Draws(np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32), bad_q),
    )
    with pytest.raises(ProtocolError) as info:
        broken.validate(20, 8, 4, stochastic=True)
    assert info.value.code is ErrorCode.BAD_DISTRIBUTION
    with pytest.raises(ProtocolError):  # deterministic modes refuse draws
        good.validate(20, 8, 4, stochastic=False)


def test_stochastic_merge_keeps_every_draw() -> None:
    qa = SparseDist.from_weights([1, 2], [40000, 25536])
    qb = SparseDist.from_weights([1, 3], [10000, 55536])
    a = _stochastic([1, 2, 1], [-1, -1, -1], [qa], [0, 0, 0])  # token 1 drawn twice by drafter A
    b = _stochastic([3, 1], [-1, -1], [qb], [0, 0])
    bd = b.draws
    assert bd is not None
    b = TokenTree.build(b.tokens, b.parents, b.base, b.cond, Draws(bd.node, bd.drafter + 1, bd.qrow, bd.q))
    m = merge([a, b])
    assert m.tokens.tolist() == [1, 2, 3]  # node shared between identical paths
    d = m.draws
    assert d is not None
    assert d.num_draws == 5
    # draw order: A's three draws in their order, then B's two
    assert m.tokens[d.node].tolist() == [1, 2, 1, 3, 1]
    assert d.drafter.tolist() == [0, 0, 0, 1, 1]
    assert d.qrow.tolist() == [0, 0, 0, 1, 1]
    assert m.draws_at(-1) == [0, 1, 2, 3, 4]
    m.validate(20, 8, 4, stochastic=True)


# ------------------------------------------------------------------------- property tests


@st.composite
def trees(draw: st.DrawFn, max_nodes: int = 24, vocab: int = 6) -> TokenTree:
    n = draw(st.integers(0, max_nodes))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    tokens = [draw(st.integers(0, vocab - 1)) for _ in range(n)]
    # deterministic: make siblings distinct by rebuilding as a trie of the paths
    raw = TokenTree.build(tokens, parents, base=1)
    return TokenTree.from_sequences([raw.path_tokens(i) for i in range(n)], base=1)


@settings(max_examples=200, deadline=None)
@given(trees())
def test_tree_invariants(t: TokenTree) -> None:
    n = t.num_nodes
    t.validate(6, 64, 64, stochastic=False)
    mask = t.ancestor_mask()
    for i in range(n):
        path = t.path(i)
        assert path[-1] == i and len(path) == t.depth[i]
        assert set(np.flatnonzero(mask[i]).tolist()) == set(path)
    order = t.dfs_order()
    assert sorted(order) == list(range(n))
    seen: set[int] = set()
    for node in order:
        p = int(t.parents[node])
        assert p == -1 or p in seen
        seen.add(node)
    # DFS keeps each subtree contiguous
    for i in range(n):
        sub = [j for j in range(n) if mask[j, i]]
        pos = sorted(order.index(j) for j in sub)
        assert pos == list(range(pos[0], pos[0] + len(sub)))


@settings(max_examples=200, deadline=None)
@given(trees(), trees(), trees())
def test_merge_is_union_idempotent_and_order_independent(a: TokenTree, b: TokenTree, c: TokenTree) -> None:
    m = merge([a, b, c])
    assert m.paths() == a.paths() | b.paths() | c.paths()
    assert merge([c, a, b]).paths() == m.paths()
    assert merge([m, m]).paths() == m.paths()
    assert merge([a]).paths() == a.paths() and merge([a]).num_nodes == a.num_nodes
    m.validate(6, 1024, 64, stochastic=False)


@st.composite
def stochastic_trees(draw: st.DrawFn, drafter: int = 0) -> TokenTree:
    n = draw(st.integers(1, 12))
    parents = [draw(st.integers(-1, i - 1)) for i in range(n)]
    rows: list[SparseDist] = []
    row_of: dict[int, int] = {}
    qrow = []
    tokens = []
    for i in range(n):
        p = parents[i]
        if p not in row_of:
            k = draw(st.integers(1, 4))
            ids_ = sorted(draw(st.sets(st.integers(0, 5), min_size=k, max_size=k)))
            probs = np.zeros(6)
            probs[ids_] = draw(st.lists(st.floats(0.05, 1.0), min_size=k, max_size=k))
            row_of[p] = len(rows)
            rows.append(SparseDist.from_probs(probs))
        row = rows[row_of[p]]
        tokens.append(int(row.ids[draw(st.integers(0, len(row) - 1))]))
        qrow.append(row_of[p])
    draws = Draws(
        np.arange(n, dtype=np.int32),
        np.full(n, drafter, np.int32),
        np.asarray(qrow, np.int32),
        SparseRows.from_rows(rows),
    )
    return TokenTree.build(tokens, parents, base=3, draws=draws)


def _draw_records(t: TokenTree) -> list[tuple[tuple[int, ...], int, tuple[int, ...], tuple[int, ...]]]:
    """Each draw as (path of its node, drafter, q row ids, q row weights), in array order."""
    d = t.draws
    assert d is not None
    out = []
    for k in range(d.num_draws):
        row = d.q.row(int(d.qrow[k]))
        out.append(
            (
                tuple(t.path_tokens(int(d.node[k]))),
                int(d.drafter[k]),
                tuple(row.ids.tolist()),
                tuple(row.weights.tolist()),
            )
        )
    return out


@settings(max_examples=150, deadline=None)
@given(stochastic_trees(0), stochastic_trees(1))
def test_stochastic_merge_preserves_draws(a: TokenTree, b: TokenTree) -> None:
    a.validate(6, 64, 64, stochastic=True)
    m = merge([a, b])
    m.validate(6, 64, 64, stochastic=True)
    assert m.paths() == a.paths() | b.paths()
    # every draw kept, in order: a's draws then b's, each with its own q row
    assert _draw_records(m) == _draw_records(a) + _draw_records(b)
    # per parent, draw order is preserved within each tree
    for parent in [-1, *range(m.num_nodes)]:
        here = m.draws_at(parent)
        assert here == sorted(here)
