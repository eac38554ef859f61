"""The round executor's frame pump stops when the generation ends, whatever frame is arriving then.

Seen in bench.end_to_end.network at RTT 100 (2 of 1,000 generations): a frame arrived in the same loop turn as
the end of the generation cancelled the pump. Under Python 3.11's
asyncio.wait_for the cancel was swallowed, the pump read on, and the generation only ended when the
verifier closed the idle session 300 s later.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Awaitable, Callable
from types import SimpleNamespace
from typing import Any

from edge_client.speculation.executor import RoundExecutor


def _frames_then_silence(first: asyncio.Future[Any]) -> Callable[[], Awaitable[Any]]:
    """A recv whose first frame is `first`'s result, and then nothing."""
    calls = 0

    async def recv() -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            return await first
        await asyncio.Event().wait()  # no frame ever again (the generation is over)

    return recv


def test_a_frame_arriving_as_the_pump_is_cancelled_does_not_keep_it_reading() -> None:
    async def main() -> tuple[bool, list[Any]]:
        loop = asyncio.get_running_loop()
        first: asyncio.Future[Any] = loop.create_future()
        core = SimpleNamespace(clock=time.monotonic, proto=None, stats=SimpleNamespace(trace=None))

        async def send(_: bytes) -> None: ...

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            ex = RoundExecutor(core, None, send, _frames_then_silence(first), pool, 30.0)  # type: ignore[arg-type]
            queue: asyncio.Queue[Any] = asyncio.Queue()
            pump = asyncio.create_task(ex._pump(queue))
            await asyncio.sleep(0.01)  # the pump waits for a frame
            first.set_result("a frame")
            await asyncio.sleep(0)  # the frame's read completes; the pump has not run on yet
            pump.cancel()
            await asyncio.wait([pump], timeout=2.0)
            got = []
            while not queue.empty():
                got.append((await queue.get())[0])
            stopped = pump.done()
            pump.cancel()
            await asyncio.wait([pump])
            return stopped, got

    stopped, got = asyncio.run(main())
    assert stopped, "the pump kept reading after it was cancelled"
    # the frame that came is handed on, then the cancel that ended the pump
    assert got[0] == "a frame" and isinstance(got[-1], asyncio.CancelledError) and len(got) == 2
