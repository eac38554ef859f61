"""bench.end_to_end.merged's variants: equal total nodes, the merged drafts in turn and (--parallel) at
once."""

from __future__ import annotations

import pytest

from bench.end_to_end.merged import build_parser, variant_shapes


def test_variants_split_the_nodes_over_the_drafts() -> None:
    shapes = variant_shapes(2, 8)
    assert list(shapes) == ["ar", "one", "other", "merged"]
    assert shapes["one"][0] == [0] and shapes["other"][0] == [1]
    idx, trees = shapes["merged"]
    assert idx == [0, 1]
    assert [t.budget for t in trees] == [4, 4]
    assert all(t.kind == "budget" for t in trees)


def test_parallel_adds_the_same_merge_drafted_at_once() -> None:
    shapes = variant_shapes(3, 9, parallel=True)
    assert shapes["merged_parallel"] == shapes["merged"]
    assert [t.budget for t in shapes["merged_parallel"][1]] == [3, 3, 3]


@pytest.mark.parametrize(("n", "nodes", "match"), [(1, 8, "at least two"), (3, 2, "cannot be split")])
def test_sizes_that_cannot_be_merged_are_refused(n: int, nodes: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        variant_shapes(n, nodes)


def test_parallel_flag_is_parsed() -> None:
    a = build_parser().parse_args(["--draft", "a", "--draft", "b", "--parallel"])
    assert a.parallel is True
    assert build_parser().parse_args(["--draft", "a", "--draft", "b"]).parallel is False
