"""A blocking iterator served on the event loop (the actor's streamed rollouts, in process and over
gRPC alike)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

_DONE = object()


async def iterate_in_thread(make_iterator: Callable[[], Iterator[Any]]) -> AsyncIterator[Any]:
    """Run a blocking iterator on a thread of its own and yield its items on the event loop.

    Its own thread, not the shared executor: an iterator that holds a lock between items (the
    actor's model lock during a rollout) must not wait for a pool slot that callers queued on that
    lock already hold. Closing the async iterator (a cancelled call) stops the thread after the item
    in flight and closes the blocking iterator there, where it runs.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stop = threading.Event()

    def post(item: Any) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is gone (shutdown): nobody is listening
            pass

    def produce() -> None:
        try:
            iterator = make_iterator()
            try:
                for item in iterator:
                    post(item)
                    if stop.is_set():
                        break
            finally:
                close = getattr(iterator, "close", None)
                if close is not None:
                    close()
            post(_DONE)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting side
            post(exc)

    threading.Thread(target=produce, name="stream-producer", daemon=True).start()
    try:
        while (item := await queue.get()) is not _DONE:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
