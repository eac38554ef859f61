"""The asyncio shell around the speculation core: drafting thread, socket, and the frame pump.

It runs the core's actions (speculation.actions): draft actions on the client's one drafting
thread, send actions through the client's protocol and transport, and it decodes frames on a
pump task, stamped on arrival, so that the core sees them in order while the protocol (which
the core's abandoned-draft checks read) is never behind the socket.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from edge_client.speculation.actions import DRAFT_ACTIONS, Action, Deliver, SendPrompt, SendTree
from edge_client.speculation.core import SpeculationCore, Steps
from edge_client.speculation.drafting import DraftStep
from shared.messages import Verdict
from shared.protocol import ClientProtocol


class RoundExecutor:
    """Runs one generation's core and yields its verdicts in order.

    send:  sends one encoded frame (the client's transport; raises when the connection drops)
    recv:  receives and decodes one frame (the client's protocol)
    pool:  the one drafting thread
    """

    def __init__(
        self,
        core: SpeculationCore,
        step: DraftStep | None,
        proto: ClientProtocol,
        send: Callable[[bytes], Awaitable[None]],
        recv: Callable[[], Awaitable[Any]],
        pool: concurrent.futures.Executor,
    ) -> None:
        self.core = core
        self.step = step
        self.proto = proto
        self._send = send
        self._recv = recv
        self.pool = pool
        self._out: list[Verdict] = []

    @property
    def cancelled(self) -> bool:
        return self.core.cancelled

    def cancel(self) -> None:
        self.core.cancel()

    async def _run(self, steps: Steps) -> None:
        """Drive one core step to its end, executing each action it yields."""
        result: Any = None
        while True:
            try:
                action = steps.send(result)
            except StopIteration:
                return
            result = await self._execute(action)

    async def _execute(self, action: Action) -> Any:
        if isinstance(action, DRAFT_ACTIONS):
            assert self.step is not None
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self.pool, self.step.run, action)
        if isinstance(action, SendPrompt):
            t_sent = time.perf_counter()
            await self._send(self.proto.prompt(action.prompt))
            return t_sent
        if isinstance(action, SendTree):
            frame = self.proto.tree(action.tree)
            await self._send(frame)
            return len(frame), time.perf_counter()
        if isinstance(action, Deliver):
            self._out.append(action.verdict)
            return None
        raise TypeError(f"unknown action {action!r}")

    async def run(self, prompt: Any) -> AsyncIterator[Verdict]:
        core = self.core
        await self._run(core.start(prompt))
        queue: asyncio.Queue[Any] = asyncio.Queue()
        pump = asyncio.create_task(self._pump(queue))
        try:
            while not core.finished:
                idle = core.idle(quiet=queue.empty())
                if idle is not None:
                    await self._run(idle)
                    continue
                msg, received = await queue.get()
                if isinstance(msg, BaseException):
                    raise msg
                steps = core.receive(msg, received)
                result: Any = None
                while True:  # a verdict is yielded to the client the moment the core delivers it
                    try:
                        action = steps.send(result)
                    except StopIteration:
                        break
                    result = await self._execute(action)
                    while self._out:
                        yield self._out.pop(0)
        finally:
            pump.cancel()

    async def _pump(self, queue: asyncio.Queue[Any]) -> None:
        while True:
            try:
                msg = await self._recv()
            except BaseException as exc:  # a broken connection reaches the loop as an exception
                await queue.put((exc, time.perf_counter()))
                return
            # stamped on arrival: the loop may be busy drafting when it comes, and the round trip
            # (stats, dynamic budgets, the cost gate) must not count that wait
            await queue.put((msg, time.perf_counter()))
