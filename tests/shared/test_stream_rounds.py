"""Stream rounds (PROTOCOL.md `stream`): the target streams tokens one forward each, as the fallback
for a miss or as the round the client chose, and a pending tree that matches ends the stream."""

from __future__ import annotations

import numpy as np
import pytest

from shared import ErrorCode, ProtocolError, TokenTree
from shared.messages import (
    FEATURE_COST,
    FEATURE_STREAM,
    FEATURE_WELCOME_FEATURES,
    Hello,
    Mode,
    Prompt,
    Stale,
    Stream,
    Tree,
    Verdict,
    Welcome,
    decode,
    encode,
)
from shared.protocol import ClientProtocol, ClientState, ServerProtocol, VerifyTree
from shared.tree_match import can_grow_into, reroot
from tests.shared.test_protocol import LIMITS, V, _deliver, _pair

NONE = np.zeros(0, np.int32)


def _token(srv: ServerProtocol, rnd: int, tok: int, length: int, **kw: object) -> VerifyTree | None:
    """The server's verifier produced one stream token."""
    return srv.verdict(Verdict(rnd, np.array([tok]), NONE, has_bonus=True, committed_len=length, **kw))  # type: ignore[arg-type]


def test_a_stream_round_sends_a_verdict_per_token_and_ends_after_k() -> None:
    srv, cli = _pair()
    srv.receive(cli.prompt(Prompt(tokens=np.array([1, 2]), max_new_tokens=16)))
    srv.verdict(Verdict(0, np.array([3]), NONE, has_bonus=True, committed_len=3))
    _deliver(srv, cli)
    (ev,) = srv.receive(cli.stream(Stream(1, 3)))
    assert isinstance(ev, VerifyTree) and ev.round == 1 and ev.tree is None and cli.in_flight == 1
    for i, tok in enumerate((4, 5, 6)):
        nxt = _token(srv, 1, tok, 4 + i)
        (v,) = _deliver(srv, cli)
        assert isinstance(v, Verdict) and v.round == 1
        last = i == 2
        assert v.streaming is not last
        assert (nxt is None) is last and (last or (nxt is not None and nxt.continues and nxt.tree is None))
        assert cli.in_flight == (None if last else 1)
    assert cli.committed == [1, 2, 3, 4, 5, 6] and cli.outstanding == set()


def test_a_matching_tree_ends_the_stream_without_a_round_trip() -> None:
    srv, cli = _pair()
    srv.receive(cli.prompt(Prompt(tokens=np.array([1, 2]), max_new_tokens=16)))
    srv.verdict(Verdict(0, np.array([3]), NONE, has_bonus=True, committed_len=3))
    _deliver(srv, cli)
    srv.receive(cli.stream(Stream(1, 100)))
    # while token 4 is decoded the client drafts below its prediction of it
    right = TokenTree.build([7, 8], [-1, 0], base=3, cond=[4])
    wrong = TokenTree.build([9], [-1], base=3, cond=[5])
    assert srv.receive(cli.tree(Tree(2, right))) == []
    assert srv.receive(cli.tree(Tree(3, wrong))) == []
    nxt = _token(srv, 1, 4, 4)
    assert nxt is not None and nxt.round == 2 and nxt.tree is not None and nxt.tree.tokens.tolist() == [7, 8]
    stale, v = _deliver(srv, cli)
    assert isinstance(stale, Stale) and stale.round == 3
    assert isinstance(v, Verdict) and not v.streaming and v.next_round == 2
    assert cli.in_flight == 2 and cli.outstanding == {2}


def test_a_waiting_stream_is_the_fallback_for_a_miss() -> None:
    srv, cli = _pair()
    srv.receive(cli.prompt(Prompt(tokens=np.array([1, 2]), max_new_tokens=16)))
    srv.verdict(Verdict(0, np.array([3]), NONE, has_bonus=True, committed_len=3))
    _deliver(srv, cli)
    srv.receive(cli.tree(Tree(1, TokenTree.build([4, 5], [-1, 0], base=3))))
    hit = TokenTree.build([9], [-1], base=3, cond=[4, 5, 6])
    assert srv.receive(cli.tree(Tree(2, hit))) == []
    assert srv.receive(cli.stream(Stream(3, 4))) == []  # waits: a round is in flight
    assert cli.waiting_stream() == 3
    assert srv.receive(cli.stream(Stream(4, 2))) == []  # replaces round 3
    (stale,) = _deliver(srv, cli)
    assert isinstance(stale, Stale) and stale.round == 3 and stale.reason == "superseded"
    # round 1 accepts one node and the bonus differs from the prediction: a miss, the stream runs
    nxt = srv.verdict(Verdict(1, np.array([4, 7]), np.array([0]), has_bonus=True, committed_len=5))
    assert nxt is not None and nxt.round == 4 and nxt.tree is None and not nxt.continues
    msgs = _deliver(srv, cli)
    assert isinstance(msgs[-1], Verdict) and msgs[-1].next_round == 4 and cli.in_flight == 4
    assert _token(srv, 4, 8, 6) is not None
    assert _token(srv, 4, 9, 7) is None  # k = 2
    _deliver(srv, cli)
    assert cli.committed == [1, 2, 3, 4, 7, 8, 9] and cli.in_flight is None and cli.outstanding == set()


def test_the_prompt_can_stream_and_done_ends_the_stream() -> None:
    srv, cli = _pair()
    srv.receive(cli.prompt(Prompt(tokens=np.array([1, 2]), max_new_tokens=3, stream=10)))
    assert _token(srv, 0, 3, 3) is not None
    assert _token(srv, 0, 4, 4) is not None
    assert _token(srv, 0, 5, 5, done=True, reason="length") is None
    msgs = _deliver(srv, cli)
    assert [m.streaming for m in msgs if isinstance(m, Verdict)] == [True, True, False]
    assert cli.committed == [1, 2, 3, 4, 5] and cli.state is ClientState.IDLE


def test_illegal_streams_are_refused() -> None:
    srv, cli = _pair()
    with pytest.raises(ProtocolError):
        cli.stream(Stream(1, 2))  # no generation
    srv.receive(cli.prompt(Prompt(tokens=np.array([1]), mode=Mode.AR, max_new_tokens=4)))
    with pytest.raises(ProtocolError):
        cli.stream(Stream(1, 2))
    (err,) = srv.receive(encode(Stream(1, 2)))
    assert err.error.code is ErrorCode.BAD_ORDER  # type: ignore[union-attr]
    bad = Prompt(tokens=np.array([1]), stream=4, tree=TokenTree.build([2], [-1], base=1))
    srv3, _ = _pair()
    (ev,) = srv3.receive(encode(bad))
    assert ev.error.field == "stream"  # type: ignore[union-attr]


def test_a_client_refuses_a_stream_verdict_that_breaks_the_rules() -> None:
    _, cli = _pair()
    cli.prompt(Prompt(tokens=np.array([1, 2]), max_new_tokens=16))
    cli.receive(encode(Verdict(0, np.array([3]), NONE, has_bonus=True, committed_len=3)))
    cli.tree(Tree(1, TokenTree.build([4], [-1], base=3)))
    with pytest.raises(ProtocolError, match="not a stream"):  # streaming on a tree's round
        cli.receive(encode(Verdict(1, np.array([4]), np.array([0]), True, 4, streaming=True)))
    _, cli = _pair()
    cli.prompt(Prompt(tokens=np.array([1, 2]), max_new_tokens=16))
    cli.receive(encode(Verdict(0, np.array([3]), NONE, has_bonus=True, committed_len=3)))
    cli.stream(Stream(1, 5))
    with pytest.raises(ProtocolError, match="one token"):
        cli.receive(encode(Verdict(1, np.array([4, 5]), NONE, True, 5, streaming=True)))


def test_features_are_honoured_only_when_asked() -> None:
    cli = ClientProtocol()
    srv = ServerProtocol(vocab_size=V, limits=LIMITS)
    srv.receive(cli.hello(Hello("f" * 64, features=(FEATURE_WELCOME_FEATURES, FEATURE_STREAM, "x.unknown"))))
    srv.welcome(Welcome("s", "m", V, (0,), (Mode.GREEDY,), LIMITS, {1: 1.0}))
    (w,) = srv.data_to_send()
    welcome = decode(w)
    assert isinstance(welcome, Welcome) and welcome.features == (FEATURE_WELCOME_FEATURES, FEATURE_STREAM)
    # cost maps go out only to a client that asked for them
    cli.receive(w)
    srv.receive(cli.prompt(Prompt(tokens=np.array([1]), max_new_tokens=4)))
    srv.verdict(Verdict(0, np.array([2]), NONE, True, 2, forward_ms={0: 5.0, 1: 6.0}, marginal_ms={0: 5.0}))
    (v,) = _deliver(srv, cli)
    assert isinstance(v, Verdict) and v.forward_ms is None
    srv2, cli2 = _pair()
    srv2.features = frozenset({FEATURE_COST})
    srv2.receive(cli2.prompt(Prompt(tokens=np.array([1]), max_new_tokens=4)))
    srv2.verdict(Verdict(0, np.array([2]), NONE, True, 2, forward_ms={0: 5.0, 1: 6.0}, marginal_ms={0: 5.0}))
    (v2,) = _deliver(srv2, cli2)
    assert isinstance(v2, Verdict) and v2.forward_ms == {0: 5.0, 1: 6.0} and v2.marginal_ms == {0: 5.0}


def test_reroot_keeps_the_subtree_below_the_committed_tokens_with_their_positions() -> None:
    #        row 0 (S = [1, 2, 3])
    #       /        \
    #     4 (0)      9 (1)
    #    /    \         \
    #  5 (2)  6 (3)     7 (4)
    #  |
    #  8 (5)
    tree = TokenTree.build([4, 9, 5, 6, 7, 8], [-1, -1, 0, 0, 1, 2], base=3)
    same = reroot(tree, [1, 2, 3])
    assert same is not None and same[0] is tree
    rooted = reroot(tree, [1, 2, 3, 4])
    assert rooted is not None
    sub, orig = rooted
    assert sub.tokens.tolist() == [5, 6, 8] and sub.parents.tolist() == [-1, -1, 0]
    assert orig.tolist() == [2, 3, 5] and sub.cond.tolist() == [4] and sub.base == 3
    assert sub.positions.tolist() == tree.positions[orig].tolist()  # nodes keep their positions
    assert reroot(tree, [1, 2, 3, 4, 6]) is None  # the path ends at a leaf: nothing to verify
    assert reroot(tree, [1, 2, 3, 7]) is None  # no node spells the token
    assumed = TokenTree.build([4, 5], [-1, 0], base=2, cond=[3])
    assert reroot(assumed, [1, 2, 7, 4]) is None  # the sequence contradicts its cond
    deeper = reroot(tree, [1, 2, 3, 4, 5])
    assert deeper is not None and deeper[0].tokens.tolist() == [8] and deeper[1].tolist() == [5]
    assert can_grow_into(tree, [1, 2, 3]) and can_grow_into(tree, [1, 2, 3, 4])
    assert not can_grow_into(tree, [1, 2, 3, 9])  # 9 has the child 7, a leaf: one more token ends it


def test_a_tree_sent_during_a_stream_is_re_rooted_below_the_streamed_token() -> None:
    srv, cli = _pair()
    srv.receive(cli.prompt(Prompt(tokens=np.array([1, 2]), max_new_tokens=16)))
    srv.verdict(Verdict(0, np.array([3]), NONE, has_bonus=True, committed_len=3))
    _deliver(srv, cli)
    srv.receive(cli.stream(Stream(1, 100)))
    # drafted below S = [1, 2, 3] while the target decodes the token after 3
    tree = TokenTree.build([4, 9, 5, 6], [-1, -1, 0, 2], base=3)
    assert srv.receive(cli.tree(Tree(2, tree))) == []  # pending: it may re-root
    nxt = _token(srv, 1, 4, 4)
    assert nxt is not None and nxt.round == 2 and nxt.tree is not None
    assert nxt.tree.tokens.tolist() == [5, 6] and nxt.tree.cond.tolist() == [4]
    (v,) = _deliver(srv, cli)
    assert isinstance(v, Verdict) and v.next_round == 2 and cli.in_flight == 2
    # its verdict's accepted nodes index the subtree: both accepted, then the bonus
    srv.verdict(Verdict(2, np.array([5, 6, 7]), np.array([0, 1]), has_bonus=True, committed_len=7))
    (v2,) = _deliver(srv, cli)
    assert isinstance(v2, Verdict) and cli.committed == [1, 2, 3, 4, 5, 6, 7]
    # a client refuses accepted nodes that are not a path of the re-rooted tree
    srv, cli = _pair()
    srv.receive(cli.prompt(Prompt(tokens=np.array([1, 2]), max_new_tokens=16)))
    srv.verdict(Verdict(0, np.array([3]), NONE, has_bonus=True, committed_len=3))
    _deliver(srv, cli)
    srv.receive(cli.stream(Stream(1, 100)))
    srv.receive(cli.tree(Tree(2, tree)))
    _token(srv, 1, 4, 4)
    _deliver(srv, cli)
    with pytest.raises(ProtocolError, match="path"):
        cli.receive(encode(Verdict(2, np.array([6, 7]), np.array([1]), True, 6)))


def test_a_conditional_tree_for_a_shorter_outcome_re_roots_after_a_longer_one() -> None:
    """Pre-speculation drafted for "one node accepted, bonus 5"; the round accepted more along the
    conditional tree's own path: its subtree is verified at once instead of going stale."""
    srv, cli = _pair()
    srv.receive(cli.prompt(Prompt(tokens=np.array([1, 2]), max_new_tokens=16)))
    srv.verdict(Verdict(0, np.array([3]), NONE, has_bonus=True, committed_len=3))
    _deliver(srv, cli)
    srv.receive(cli.tree(Tree(1, TokenTree.build([4, 5, 6], [-1, 0, 1], base=3))))
    cond = TokenTree.build([6, 7, 8], [-1, 0, 1], base=3, cond=[4, 5])
    assert srv.receive(cli.tree(Tree(2, cond))) == []
    nxt = srv.verdict(
        Verdict(1, np.array([4, 5, 6, 7]), np.array([0, 1, 2]), has_bonus=True, committed_len=7)
    )
    assert nxt is not None and nxt.round == 2 and nxt.tree is not None and nxt.tree.tokens.tolist() == [8]
    _deliver(srv, cli)
    assert cli.in_flight == 2


def test_stochastic_trees_are_never_re_rooted() -> None:
    draws = TokenTree.build([4, 5], [-1, 0], base=3)
    assert reroot(draws, [1, 2, 3, 4]) is not None  # deterministic: re-rooted
    srv, cli = _pair((Mode.GREEDY, Mode.MSS))
    srv.receive(
        cli.prompt(Prompt(tokens=np.array([1, 2]), mode=Mode.MSS, temperature=1.0, max_new_tokens=16))
    )
    assert srv.gen is not None
    assert srv._usable(srv.gen, TokenTree.build([4, 5], [-1, 0], base=1, cond=[])) is None  # not for S


def test_an_earlier_tree_that_still_re_roots_may_be_verified_after_a_later_one() -> None:
    """Two trees drafted below S during a stream: the later one is verified first, the earlier
    stays pending (it may still re-root) and is verified next when the later one's tokens follow
    its path; the client takes its verdict (the verdict before named it)."""
    srv, cli = _pair()
    srv.receive(cli.prompt(Prompt(tokens=np.array([1, 2]), max_new_tokens=16)))
    srv.verdict(Verdict(0, np.array([3]), NONE, has_bonus=True, committed_len=3))
    _deliver(srv, cli)
    srv.receive(cli.stream(Stream(1, 100)))
    early = TokenTree.chain([4, 5, 6, 7], base=3)
    late = TokenTree.chain([4, 5], base=3)
    srv.receive(cli.tree(Tree(2, early)))
    srv.receive(cli.tree(Tree(3, late)))
    nxt = _token(srv, 1, 4, 4)
    assert nxt is not None and nxt.round == 3
    _deliver(srv, cli)
    nxt = srv.verdict(Verdict(3, np.array([5, 6]), np.array([0]), has_bonus=True, committed_len=6))
    assert nxt is not None and nxt.round == 2 and nxt.tree is not None and nxt.tree.tokens.tolist() == [7]
    _deliver(srv, cli)
    srv.verdict(Verdict(2, np.array([7, 9]), np.array([0]), has_bonus=True, committed_len=8))
    (v,) = _deliver(srv, cli)
    assert isinstance(v, Verdict) and cli.committed == [1, 2, 3, 4, 5, 6, 7, 9]
