"""A scripted session for the speculation core: the test plays the verifier, nothing is patched.

The core's actions run inline (drafts with a real DraftStep on the given drafter, sends through a
real ClientProtocol); the test then answers the trees with verdicts, stales and errors, encoded
and decoded as on the wire, in whatever order it likes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edge_client.drafters.base import Drafter
from edge_client.speculation import (
    Ask,
    Deliver,
    Delivered,
    DrafterProfile,
    DraftStep,
    Learned,
    PrespecConfig,
    Request,
    Send,
    Sent,
    SpeculationCore,
    Steps,
)
from edge_client.speculation.actions import DRAFT_ACTIONS, Drafted, FinishLeaves
from edge_client.stats import GenerationStats
from edge_client.trees import DraftResult
from shared.errors import ErrorCode
from shared.messages import (
    Error,
    Hello,
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
from shared.protocol import ClientProtocol, can_still_match
from shared.tree import TokenTree


@dataclass
class ScriptedClock:
    """The core's clock in a scripted session: time moves only when the test moves it, a verdict
    is verified (5 ms), or a draft runs (Scripted.draft_ms)."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, ms: float) -> None:
        self.now += ms / 1e3


@dataclass
class Scripted:
    """One generation of the core against a scripted verifier (see the module docstring)."""

    drafter: Drafter
    req: Request
    prespec: PrespecConfig | None = None
    limits: SessionLimits = field(default_factory=lambda: SessionLimits(max_pending=6))
    learned: Learned = field(default_factory=Learned)
    temperature: float = 0.0
    clock: ScriptedClock = field(default_factory=ScriptedClock)
    draft_ms: float | None = None  # every tree drafted takes this long on the clock (None: no time)
    eval_ms: Callable[[int], float | None] | None = None  # the drafter's cost curve (None: measured)
    verify_cost_ms: dict[int, float] = field(default_factory=lambda: {1: 10.0, 64: 20.0})  # in welcome

    def __post_init__(self) -> None:
        self.proto = ClientProtocol()
        self.proto.hello(Hello(vocab_fingerprint=""))
        welcome = Welcome(
            session_id="s",
            model_id="scripted",
            vocab_size=self.drafter.vocab_size,
            eos_ids=(0,),
            allowed_modes=tuple(Mode),
            limits=self.limits,
            verify_cost_ms=self.verify_cost_ms,
        )
        self.proto.receive(encode(welcome))
        self.stats = GenerationStats()
        self.step = DraftStep([self.drafter], self.req, self.limits, costs=self.learned.drafter_costs(1))
        self.core = SpeculationCore(
            self.proto,
            welcome,
            self.req,
            self.prespec,
            self.learned,
            self.stats,
            DrafterProfile(self.step.max_nodes, self.step.ms_per_node, self.eval_ms or self.step.eval_ms),
            self.temperature,
            clock=self.clock,
        )
        self.trees: dict[int, TokenTree] = {}  # every tree sent, by round (0: the prompt's)
        self.delivered: list[Verdict] = []
        self.actions: list[Ask[object]] = []

    # ------------------------------------------------------------------ running the core
    def _run(self, steps: Steps | None) -> None:
        result: object = None
        while steps is not None:
            try:
                action = steps.send(result)
            except StopIteration:
                return
            self.actions.append(action)
            result = self._execute(action)

    def _execute(self, action: Ask[object]) -> object:
        if isinstance(action, DRAFT_ACTIONS):
            return self._timed(self.step.run(action))
        if isinstance(action, Send):
            # the verifier's side of the wire: the frame as the server would decode it
            msg = decode(action.frame)
            if isinstance(msg, Prompt):
                if msg.tree is not None:
                    self.trees[0] = msg.tree
            elif isinstance(msg, Tree):
                self.trees[msg.round] = msg.tree
            else:
                raise AssertionError(f"the core sent a {type(msg).__name__}")
            return Sent(len(action.frame), self.clock())
        if isinstance(action, Deliver):
            self.delivered.append(action.verdict)
            return Delivered()
        raise TypeError(action)

    def _timed(self, out: object) -> object:
        """With `draft_ms`, every tree in a draft's result took that long, on the scripted clock."""
        ms = self.draft_ms
        if ms is None:
            return out
        if isinstance(out, DraftResult):
            self.clock.advance(ms)
            return dataclasses.replace(out, draft_ms=ms)
        if isinstance(out, Drafted):
            done = tuple(None if d is None else dataclasses.replace(d, draft_ms=ms) for d in out.results)
            self.clock.advance(ms * sum(d is not None for d in done))
            return dataclasses.replace(out, results=done)
        return out

    def sent_trees(self) -> list[Tree]:
        """The trees the core sent, in order, as the server decodes them."""
        out = []
        for a in self.actions:
            if isinstance(a, Send) and a.kind == "tree":
                msg = decode(a.frame)
                assert isinstance(msg, Tree)
                out.append(msg)
        return out

    def start(self, tokens: list[int], max_new_tokens: int = 64) -> None:
        prompt = Prompt(
            tokens=np.asarray(tokens, dtype=np.int32), mode=self.req.mode, max_new_tokens=max_new_tokens
        )
        self._run(self.core.start(prompt))

    def idle(self, limit: int = 50) -> int:
        """Let the core work while nothing arrives, until it has nothing left to do; returns the
        number of steps it took."""
        n = 0
        while n < limit:
            steps = self.core.idle(quiet=True)
            if steps is None:
                return n
            self._run(steps)
            n += 1
        raise AssertionError(f"the core kept working for {limit} idle steps")

    def _receive(self, msg: Verdict | Stale | Error) -> None:
        decoded = self.proto.receive(encode(msg), acknowledge=False)
        self._run(self.core.receive(decoded, self.clock()))

    # ------------------------------------------------------------------ the verifier's answers
    def outstanding_trees(self) -> dict[int, TokenTree]:
        return {r: self.trees[r] for r in sorted(self.proto.outstanding)}

    def verdict(
        self,
        rnd: int,
        path: list[int],
        bonus: int,
        *,
        next_round: int | None = None,
        done: bool = False,
        stales_first: bool = True,
    ) -> Verdict:
        """Answer tree `rnd`: the nodes `path` (root to node) accepted, then `bonus`. The stales
        that follow are decoded before the core takes the verdict up, or with `stales_first=False`
        after it (still on their way)."""
        tree = self.trees[rnd]
        tokens = [int(tree.tokens[i]) for i in path] + [bonus]
        self.clock.advance(5.0)  # verify_ms
        v = Verdict(
            round=rnd,
            tokens=np.asarray(tokens, dtype=np.int32),
            accepted_nodes=np.asarray(path, dtype=np.int32),
            has_bonus=True,
            committed_len=len(self.proto.committed) + len(tokens),
            next_round=next_round,
            verify_ms=5.0,
            done=done,
            reason="length" if done else None,
        )
        # the server then sends `stale` for every tree that can no longer match; the executor's
        # pump decodes those ahead of the core, as here (the core acknowledges each as it takes it up)
        decoded = self.proto.receive(encode(v), acknowledge=False)
        if not stales_first:
            self._run(self.core.receive(decoded, self.clock()))
        stales = []
        if not done:
            for r in sorted(self.proto.outstanding):
                if r != next_round and not can_still_match(
                    self.trees[r], self.proto.committed, next_round is not None
                ):
                    stales.append(
                        self.proto.receive(encode(Stale(round=r, reason="no match")), acknowledge=False)
                    )
        if stales_first:
            self._run(self.core.receive(decoded, self.clock()))
        for st in stales:
            self._run(self.core.receive(st, self.clock()))
        return v

    def verdict_to(self, rnd: int, full: tuple[int, ...], **kw: Any) -> Verdict:
        """Answer tree `rnd` so that the committed sequence becomes `full`: the tree's nodes along
        full's next tokens are accepted, the token after them is the bonus."""
        committed = list(self.proto.committed)
        assert tuple(full[: len(committed)]) == tuple(committed) and len(full) > len(committed)
        tree, rest = self.trees[rnd], list(full[len(committed) :])
        path: list[int] = []
        node = -1
        for tok in rest[:-1]:
            kids = [c for c in tree.children_of(node) if int(tree.tokens[c]) == tok]
            assert kids, f"tree {rnd} has no path to {full}"
            node = kids[0]
            path.append(node)
        assert not [c for c in tree.children_of(node) if int(tree.tokens[c]) == rest[-1]]
        return self.verdict(rnd, path, rest[-1], **kw)

    def stale(self, rnd: int) -> None:
        self._receive(Stale(round=rnd, reason="no match"))

    def too_many_pending(self, rnd: int) -> None:
        self._receive(Error(ErrorCode.TOO_MANY_PENDING, "no room", "round", False, rnd))

    def draft_actions(self, kind: type) -> list[Any]:
        return [a for a in self.actions if isinstance(a, kind)]

    def leaves_asked(self) -> list[FinishLeaves]:
        return self.draft_actions(FinishLeaves)
