from __future__ import annotations

import random

import numpy as np
import pytest

from shared import ErrorCode, ProtocolError, SparseDist, SparseRows, TokenTree
from shared.messages import (
    Cancel,
    Error,
    Hello,
    Message,
    Mode,
    Prompt,
    SessionLimits,
    Stale,
    Tree,
    Verdict,
    Welcome,
    decode,
    encode,
)
from shared.protocol import (
    CancelReceived,
    ClientProtocol,
    ClientState,
    ErrorSent,
    HelloReceived,
    PromptReceived,
    ServerProtocol,
    ServerState,
    VerifyTree,
    can_still_match,
    tree_matches,
)
from shared.tree import Draws

V = 50
LIMITS = SessionLimits(max_nodes=8, max_depth=4, max_pending=2, max_bytes=4096, max_context=64)


def _welcome(modes: tuple[Mode, ...] = (Mode.GREEDY, Mode.MATCH, Mode.AR)) -> Welcome:
    return Welcome("s", "m", V, (0,), modes, LIMITS, {1: 1.0})


def _pair(
    modes: tuple[Mode, ...] = (Mode.GREEDY, Mode.MATCH, Mode.AR),
) -> tuple[ServerProtocol, ClientProtocol]:
    srv = ServerProtocol(vocab_size=V, limits=LIMITS)
    cli = ClientProtocol()
    (ev,) = srv.receive(cli.hello(Hello("f" * 64)))
    assert isinstance(ev, HelloReceived)
    srv.welcome(_welcome(modes))
    for f in srv.data_to_send():
        cli.receive(f)
    assert cli.state is ClientState.IDLE and srv.state is ServerState.IDLE
    return srv, cli


def _deliver(srv: ServerProtocol, cli: ClientProtocol) -> list[object]:
    return [cli.receive(f) for f in srv.data_to_send()]


def test_prompt_is_always_answered_then_trees_flow() -> None:
    srv, cli = _pair()
    (ev,) = srv.receive(cli.prompt(Prompt(tokens=np.array([1, 2, 3]), mode=Mode.GREEDY)))
    assert isinstance(ev, PromptReceived) and ev.committed.tolist() == [1, 2, 3]
    # the server must answer the prompt with round 0 before anything else
    assert srv.verdict(Verdict(0, np.array([7]), np.array([]), has_bonus=True, committed_len=4)) is None
    (v0,) = _deliver(srv, cli)
    assert isinstance(v0, Verdict) and v0.round == 0 and cli.committed == [1, 2, 3, 7]
    # round 1: a plain tree, verified at once
    (ev,) = srv.receive(cli.tree(Tree(1, TokenTree.build([8, 9], [-1, 0], base=4))))
    assert isinstance(ev, VerifyTree) and ev.round == 1
    # while round 1 is in flight the edge sends two conditional trees for the likely outcomes
    hit = TokenTree.build([11], [-1], base=4, cond=[8, 9, 10])  # all accepted, bonus 10
    miss = TokenTree.build([12], [-1], base=4, cond=[8, 5])  # one accepted, bonus 5
    assert srv.receive(cli.tree(Tree(2, hit))) == []
    assert srv.receive(cli.tree(Tree(3, miss))) == []
    nxt = srv.verdict(Verdict(1, np.array([8, 9, 10]), np.array([0, 1]), has_bonus=True, committed_len=7))
    assert nxt is not None and nxt.round == 2  # verified with no client message in between
    msgs = _deliver(srv, cli)
    assert isinstance(msgs[0], Stale) and msgs[0].round == 3
    assert isinstance(msgs[1], Verdict) and msgs[1].next_round == 2
    assert cli.in_flight == 2 and cli.outstanding == {2}
    srv.verdict(
        Verdict(
            2, np.array([11, 0]), np.array([0]), has_bonus=True, committed_len=9, done=True, reason="stop"
        )
    )
    (last,) = _deliver(srv, cli)
    assert isinstance(last, Verdict) and last.done
    assert cli.state is ClientState.IDLE and srv.state is ServerState.IDLE
    assert cli.committed == [1, 2, 3, 7, 8, 9, 10, 11, 0]


def test_in_flight_moves_when_a_frame_is_acknowledged() -> None:
    """Frames decoded ahead (acknowledge=False) update the committed sequence and the outstanding
    rounds at once but move `in_flight` only when acknowledged, in order. A verdict that names no
    next round hands it to the latest outstanding tree matching the new sequence (still on its way:
    the server verifies it on arrival); a stale for the round in flight clears it."""
    _, cli = _pair()
    cli.prompt(Prompt(tokens=np.array([1, 2, 3], dtype=np.int32), max_new_tokens=16))
    assert cli.in_flight == 0
    cli.tree(Tree(1, TokenTree.build([11], [-1], base=3, cond=[7])))  # for S = [1, 2, 3, 7]
    cli.tree(Tree(2, TokenTree.build([12], [-1], base=3, cond=[9])))
    assert cli.in_flight == 0  # neither is for the committed sequence
    v0 = cli.receive(
        encode(Verdict(0, np.array([7]), np.array([], dtype=np.int32), has_bonus=True, committed_len=4)),
        acknowledge=False,
    )
    stale2 = cli.receive(encode(Stale(round=2, reason="no match")), acknowledge=False)
    assert cli.committed == [1, 2, 3, 7] and cli.outstanding == {1} and cli.in_flight == 0
    assert cli.matching_outstanding() == 1
    cli.acknowledge(v0)
    assert cli.in_flight == 1
    cli.acknowledge(stale2)  # not the round in flight
    assert cli.in_flight == 1
    stale1 = cli.receive(encode(Stale(round=1, reason="no match")), acknowledge=False)
    assert cli.in_flight == 1 and cli.outstanding == set()
    cli.acknowledge(stale1)
    assert cli.in_flight is None and cli.matching_outstanding() is None
    # receive acknowledges at once by default; a tree for the committed sequence is in flight on sending
    cli.tree(Tree(3, TokenTree.build([4], [-1], base=4)))
    assert cli.in_flight == 3
    done = Verdict(
        3, np.array([4, 0]), np.array([0]), has_bonus=True, committed_len=6, done=True, reason="stop"
    )
    cli.receive(encode(done))
    assert cli.in_flight is None and cli.state is ClientState.IDLE


def test_a_shared_committed_sequence_is_read_not_extended() -> None:
    """With the verifier's list shared, the protocol reads it (the verifier extends it before each
    verdict) and checks committed_len; its trees match against that list; it ends as the context."""
    srv, cli = _pair()
    (ev,) = srv.receive(cli.prompt(Prompt(tokens=np.array([1, 2, 3]), mode=Mode.GREEDY)))
    assert isinstance(ev, PromptReceived)
    with pytest.raises(RuntimeError, match="not the generation's"):
        srv.share_committed([1, 2])
    engine_list = [int(t) for t in ev.committed]
    srv.share_committed(engine_list)
    engine_list.append(7)
    assert srv.verdict(Verdict(0, np.array([7]), np.array([]), has_bonus=True, committed_len=4)) is None
    assert engine_list == [1, 2, 3, 7] and srv.gen is not None and srv.gen.committed is engine_list
    (ev,) = srv.receive(cli.tree(Tree(1, TokenTree.build([8], [-1], base=4))))
    assert isinstance(ev, VerifyTree)
    with pytest.raises(RuntimeError, match="committed_len"):  # the verifier did not extend it
        srv.verdict(Verdict(1, np.array([8, 5]), np.array([0]), has_bonus=True, committed_len=6))
    engine_list.extend([8, 5])
    srv.verdict(
        Verdict(1, np.array([8, 5]), np.array([0]), has_bonus=True, committed_len=6, done=True, reason="stop")
    )
    assert engine_list == [1, 2, 3, 7, 8, 5] and srv.context == engine_list and srv.state is ServerState.IDLE
    _deliver(srv, cli)
    assert cli.committed == engine_list


def test_highest_matching_round_wins() -> None:
    srv, cli = _pair()
    srv.receive(
        cli.prompt(Prompt(tokens=np.array([1, 2]), mode=Mode.GREEDY, tree=TokenTree.build([3], [-1], base=2)))
    )
    a = TokenTree.build([20], [-1], base=2, cond=[3, 4])
    b = TokenTree.build([21, 22], [-1, 0], base=2, cond=[3, 4])
    srv.receive(cli.tree(Tree(1, a)))
    srv.receive(cli.tree(Tree(2, b)))
    nxt = srv.verdict(Verdict(0, np.array([3, 4]), np.array([0]), has_bonus=True, committed_len=4))
    assert nxt is not None and nxt.round == 2
    msgs = _deliver(srv, cli)
    assert [type(m).__name__ for m in msgs] == ["Stale", "Verdict"]
    assert isinstance(msgs[0], Stale)
    assert msgs[0].round == 1 and msgs[0].reason == "superseded"


def test_pending_tree_that_may_still_match_is_kept() -> None:
    srv, cli = _pair()
    srv.receive(cli.prompt(Prompt(tokens=np.array([1, 2]), mode=Mode.GREEDY)))
    srv.verdict(Verdict(0, np.array([3]), np.array([]), has_bonus=True, committed_len=3))
    _deliver(srv, cli)
    srv.receive(cli.tree(Tree(1, TokenTree.build([4], [-1], base=3))))
    two_ahead = TokenTree.build([9], [-1], base=3, cond=[4, 5, 6, 7])
    srv.receive(cli.tree(Tree(2, two_ahead)))
    assert srv.verdict(Verdict(1, np.array([4, 5]), np.array([0]), has_bonus=True, committed_len=5)) is None
    assert [type(m).__name__ for m in _deliver(srv, cli)] == ["Verdict"]
    assert srv.gen is not None and 2 in srv.gen.pending
    ev = srv.receive(cli.tree(Tree(3, TokenTree.build([6], [-1], base=5))))
    assert isinstance(ev[0], VerifyTree)
    nxt = srv.verdict(Verdict(3, np.array([6, 7]), np.array([0]), has_bonus=True, committed_len=7))
    assert nxt is not None and nxt.round == 2


def test_matching_helpers() -> None:
    t = TokenTree.build([1], [-1], base=2, cond=[5, 6])
    assert tree_matches(t, [0, 0, 5, 6])
    assert not tree_matches(t, [0, 0, 5, 7])
    assert not tree_matches(t, [0, 0, 5])
    assert can_still_match(t, [0, 0, 5], growing=True)
    assert can_still_match(t, [0, 0, 5, 6], growing=False)
    assert not can_still_match(t, [0, 0, 5, 6], growing=True)
    assert not can_still_match(t, [0, 0, 4], growing=True)
    assert not can_still_match(t, [0, 0, 5, 6, 1], growing=False)


def _state(srv: ServerProtocol) -> ServerState:
    """The state now (read through a call, so that mypy keeps no narrowing from an earlier assert)."""
    return srv.state


def _expect_error(
    srv: ServerProtocol, frame: bytes, code: ErrorCode, field: str, fatal: bool = False
) -> ProtocolError:
    (ev,) = srv.receive(frame)
    assert isinstance(ev, ErrorSent), ev
    assert ev.error.code is code and ev.error.field == field, ev.error
    assert ev.error.fatal is fatal
    out = [decode(f) for f in srv.data_to_send()]
    assert isinstance(out[-1], Error) and out[-1].code is code
    return ev.error


def test_illegal_orders_and_inputs() -> None:
    srv = ServerProtocol(vocab_size=V, limits=LIMITS)
    _expect_error(srv, encode(Prompt(tokens=np.array([1]))), ErrorCode.BAD_ORDER, "type", fatal=True)
    assert srv.state is ServerState.CLOSED
    srv = ServerProtocol(vocab_size=V, limits=LIMITS)
    _expect_error(srv, encode(Hello("x", version=99)), ErrorCode.BAD_VERSION, "version", fatal=True)

    srv, _ = _pair()
    _expect_error(srv, encode(Tree(1, TokenTree.build([1], [-1], base=1))), ErrorCode.BAD_ORDER, "type")
    _expect_error(
        srv, encode(Prompt(tokens=np.array([1]), mode=Mode.MSS)), ErrorCode.MODE_NOT_ALLOWED, "mode"
    )
    _expect_error(srv, encode(Prompt(tokens=np.array([1, V]))), ErrorCode.OUT_OF_RANGE, "tokens")
    _expect_error(srv, encode(Prompt(tokens=np.array([1] * 64))), ErrorCode.CONTEXT_FULL, "tokens")
    _expect_error(srv, encode(Prompt(tokens=np.array([1]), continue_=True)), ErrorCode.BAD_ORDER, "continue")
    _expect_error(
        srv, encode(Prompt(tokens=np.array([1]), stop_ids=(V + 1,))), ErrorCode.OUT_OF_RANGE, "stop_ids"
    )
    _expect_error(
        srv,
        encode(Prompt(tokens=np.array([1, 2]), tree=TokenTree.build([3], [-1], base=1))),
        ErrorCode.BAD_TREE,
        "tree.base",
    )
    assert _state(srv) is ServerState.IDLE  # none of that was fatal
    srv.receive(encode(Prompt(tokens=np.array([1, 2]))))
    _expect_error(srv, encode(Prompt(tokens=np.array([1, 2]))), ErrorCode.BAD_ORDER, "type")
    srv.verdict(Verdict(0, np.array([3]), np.array([]), has_bonus=True, committed_len=3))
    srv.data_to_send()
    e = _expect_error(
        srv, encode(Tree(5, TokenTree.build([1, 99], [-1, 0], base=3))), ErrorCode.OUT_OF_RANGE, "tree.tokens"
    )
    assert e.round == 5
    _expect_error(srv, encode(Tree(4, TokenTree.build([1], [-1], base=3))), ErrorCode.BAD_ORDER, "round")
    _expect_error(
        srv, encode(Tree(6, TokenTree.build([1, 2], [-1, 1], base=3))), ErrorCode.BAD_TREE, "tree.parents"
    )
    _expect_error(
        srv,
        encode(Tree(7, TokenTree.build(list(range(9)), [-1] * 9, base=3))),
        ErrorCode.LIMIT_EXCEEDED,
        "tree.tokens",
    )
    _expect_error(
        srv,
        encode(Tree(8, TokenTree.chain([1, 2, 3, 4, 5], base=3))),
        ErrorCode.LIMIT_EXCEEDED,
        "tree.parents",
    )
    q = SparseRows.from_rows([SparseDist.from_weights([1], [65536])])
    drawn = TokenTree.build(
        [1], [-1], base=3, draws=Draws(np.zeros(1, np.int32), np.zeros(1, np.int32), np.zeros(1, np.int32), q)
    )
    _expect_error(srv, encode(Tree(9, drawn)), ErrorCode.BAD_TREE, "tree.draws")
    # in flight + max_pending, then one more
    assert isinstance(srv.receive(encode(Tree(10, TokenTree.build([1], [-1], base=3))))[0], VerifyTree)
    srv.receive(encode(Tree(11, TokenTree.build([1], [-1], base=3, cond=[1]))))
    srv.receive(encode(Tree(12, TokenTree.build([2], [-1], base=3, cond=[2]))))
    _expect_error(
        srv,
        encode(Tree(13, TokenTree.build([3], [-1], base=3, cond=[3]))),
        ErrorCode.TOO_MANY_PENDING,
        "round",
    )
    assert _state(srv) is ServerState.GENERATING
    _expect_error(
        srv, encode(Welcome("s", "m", V, (), (), LIMITS, {})), ErrorCode.BAD_ORDER, "type", fatal=True
    )


def test_stochastic_modes_with_trusted_modes() -> None:
    srv, cli = _pair(modes=(Mode.GREEDY, Mode.MSS, Mode.RRS))
    q = SparseRows.from_rows([SparseDist.from_weights([3, 4], [60000, 5536])])
    dup = TokenTree.build(
        [3, 3],
        [-1, -1],
        base=2,
        draws=Draws(np.array([0, 1], np.int32), np.zeros(2, np.int32), np.zeros(2, np.int32), q),
    )
    (ev,) = srv.receive(cli.prompt(Prompt(tokens=np.array([1, 2]), mode=Mode.MSS, temperature=1.0, tree=dup)))
    assert isinstance(ev, PromptReceived)
    srv.verdict(Verdict(0, np.array([3, 9]), np.array([0]), has_bonus=True, committed_len=4, done=True))
    _deliver(srv, cli)
    # the same duplicate draws are illegal without replacement
    (ev,) = srv.receive(cli.prompt(Prompt(tokens=np.array([1, 2]), mode=Mode.RRS, temperature=1.0, tree=dup)))
    assert isinstance(ev, ErrorSent) and ev.error.field == "tree.draws.node"
    _deliver(srv, cli)
    assert cli.state is ClientState.IDLE  # the client saw its prompt refused


def test_cancel_and_late_trees() -> None:
    srv, cli = _pair()
    srv.receive(cli.prompt(Prompt(tokens=np.array([1, 2]))))
    srv.verdict(Verdict(0, np.array([3]), np.array([]), has_bonus=True, committed_len=3))
    _deliver(srv, cli)
    srv.receive(cli.tree(Tree(1, TokenTree.build([4], [-1], base=3))))
    srv.receive(cli.tree(Tree(2, TokenTree.build([5], [-1], base=3, cond=[4, 4]))))
    (ev,) = srv.receive(cli.cancel())
    assert isinstance(ev, CancelReceived) and ev.in_flight
    srv.verdict(Verdict(1, np.array([4, 7]), np.array([0]), has_bonus=True, committed_len=5))
    msgs = _deliver(srv, cli)
    assert isinstance(msgs[0], Stale) and msgs[0].reason == "cancelled"
    assert isinstance(msgs[-1], Verdict) and msgs[-1].done and msgs[-1].reason == "cancelled"
    assert cli.state is ClientState.IDLE
    # cancel with nothing in flight: answered at once with a round-0 done verdict
    srv.receive(cli.prompt(Prompt(tokens=np.array([9]), continue_=True)))
    srv.verdict(Verdict(0, np.array([3]), np.array([]), has_bonus=True, committed_len=7))
    _deliver(srv, cli)
    (ev,) = srv.receive(cli.cancel())
    assert isinstance(ev, CancelReceived) and not ev.in_flight
    (v,) = _deliver(srv, cli)
    assert isinstance(v, Verdict) and v.round == 0 and v.done
    # a tree sent before the client saw the end: a stale, not an error
    late = encode(Tree(3, TokenTree.build([1], [-1], base=7)))
    cli.outstanding.add(3)
    assert srv.receive(late) == []
    (s,) = _deliver(srv, cli)
    assert isinstance(s, Stale) and s.reason == "no generation"


def test_ar_mode_streams_round_zero() -> None:
    srv, cli = _pair()
    srv.receive(cli.prompt(Prompt(tokens=np.array([1]), mode=Mode.AR, max_new_tokens=3)))
    for i in range(3):
        srv.verdict(
            Verdict(0, np.array([5 + i]), np.array([]), has_bonus=True, committed_len=2 + i, done=i == 2)
        )
        _deliver(srv, cli)
    assert cli.committed == [1, 5, 6, 7] and cli.state is ClientState.IDLE
    with pytest.raises(ProtocolError):
        _srv2, cli2 = _pair()
        cli2.prompt(Prompt(tokens=np.array([1]), mode=Mode.AR))
        cli2.tree(Tree(1, TokenTree.build([1], [-1], base=1)))


def test_client_refuses_an_illegal_server() -> None:
    _, cli = _pair()
    with pytest.raises(ProtocolError):
        cli.receive(encode(Verdict(3, np.array([1]), np.array([]), has_bonus=True, committed_len=1)))
    cli.prompt(Prompt(tokens=np.array([1, 2])))
    with pytest.raises(ProtocolError):  # committed_len disagrees
        cli.receive(encode(Verdict(0, np.array([1]), np.array([]), has_bonus=True, committed_len=9)))
    with pytest.raises(ProtocolError):
        cli.receive(encode(Stale(4, "x")))
    with pytest.raises(ProtocolError):
        cli.receive(encode(Prompt(tokens=np.array([1]))))


# ------------------------------------------------------------------------------------ fuzz


def _seed_frames() -> list[bytes]:
    q = SparseRows.from_rows([SparseDist.from_weights([3, 4], [60000, 5536])])
    drawn = TokenTree.build(
        [3, 4],
        [-1, 0],
        base=3,
        draws=Draws(np.array([0, 1], np.int32), np.array([0, 0], np.int32), np.array([0, 0], np.int32), q),
    )
    msgs: list[Message] = [
        Hello("f" * 64),
        Prompt(tokens=np.array([1, 2, 3])),
        Prompt(tokens=np.array([1, 2]), mode=Mode.MSS, tree=drawn),
        Tree(1, TokenTree.build([4, 5], [-1, 0], base=3)),
        Tree(2, drawn),
        Tree(3, TokenTree.build([6], [-1], base=3, cond=[1])),
        Cancel(),
        Verdict(1, np.array([1, 2]), np.array([0]), True, 5),
        Stale(2, "x"),
        Error(ErrorCode.BAD_TREE, "m", "f"),
        _welcome(),
    ]
    return [encode(m) for m in msgs]


def _mutate(rng: random.Random, frame: bytes) -> bytes:
    b = bytearray(frame)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        if op == 0 and b:
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
        elif op == 1 and b:
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op == 2:
            b.insert(rng.randrange(len(b) + 1), rng.randrange(256))
        elif op == 3 and b:
            del b[rng.randrange(len(b))]
        elif op == 4:
            b = b[: rng.randrange(len(b) + 1)]
        else:
            i = rng.randrange(len(b) + 1)
            b[i:i] = rng.randbytes(rng.randint(1, 16))
    return bytes(b)


def test_fuzz_decoder_and_server_state_machine() -> None:
    """>= 100,000 random and mutated frames: only ProtocolError, never an over-limit frame accepted."""
    rng = random.Random(1234)
    seeds = _seed_frames()
    lim = LIMITS
    accepted = 0

    def fresh() -> ServerProtocol:
        s = ServerProtocol(vocab_size=V, limits=lim)
        s.receive(encode(Hello("f" * 64)))
        s.welcome(_welcome((Mode.GREEDY, Mode.MSS)))
        s.receive(encode(Prompt(tokens=np.array([1, 2, 3]))))
        s.verdict(Verdict(0, np.array([4]), np.array([]), True, 4))
        s.data_to_send()
        return s

    srv = fresh()
    n = 100_000
    for i in range(n):
        kind = i % 4
        if kind == 0:
            frame = rng.randbytes(rng.randint(0, 64))
        elif kind == 3 and i % 400 == 3:
            frame = seeds[0] + rng.randbytes(lim.max_bytes)  # over the limit
        else:
            frame = _mutate(rng, rng.choice(seeds))
        try:
            msg = decode(frame, srv.wire)
            accepted += 1
            assert len(frame) <= lim.max_bytes
            if isinstance(msg, Tree):
                assert msg.tree.num_nodes <= srv.wire.max_nodes
        except ProtocolError:
            pass
        events = srv.receive(frame)  # must not raise
        for ev in events:
            if isinstance(ev, VerifyTree):
                assert srv.gen is not None
                srv.verdict(Verdict(ev.round, np.array([1]), np.array([]), True, len(srv.gen.committed) + 1))
            if isinstance(ev, PromptReceived):
                srv.verdict(Verdict(0, np.array([1]), np.array([]), True, len(ev.committed) + 1))
        srv.data_to_send()
        if srv.state in (ServerState.CLOSED, ServerState.AWAIT_HELLO) or i % 50 == 0:
            srv = fresh()
    assert accepted > 1000  # the mutations also produce valid frames, so the state machine is exercised
