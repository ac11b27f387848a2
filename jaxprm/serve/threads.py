"""Handing results from the engine's thread to an asyncio loop that may already have closed.

The engine completes requests on its own thread. When a server shuts down with a request still in
the engine, the loop that waits for it is closed by the time the outcome arrives; a plain
``asyncio.wrap_future`` or ``loop.call_soon_threadsafe`` would then raise on the engine thread
("Event loop is closed"). These helpers drop what can no longer be delivered.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any

__all__ = ["post", "awaitable"]


def post(loop: asyncio.AbstractEventLoop, callback: Callable[..., Any], *args: Any) -> None:
    """``loop.call_soon_threadsafe(callback, *args)``, or nothing once ``loop`` has closed."""
    if loop.is_closed():
        return
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # closed between the check and the call
        pass


def awaitable(fut: concurrent.futures.Future) -> asyncio.Future:
    """An asyncio future of the running loop that takes ``fut``'s outcome (like
    ``asyncio.wrap_future``, but the outcome is dropped when that loop has closed meanwhile)."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def copy(done: concurrent.futures.Future) -> None:
        if waiter.done():
            return
        if done.cancelled():
            waiter.cancel()
        elif done.exception() is not None:
            waiter.set_exception(done.exception())
        else:
            waiter.set_result(done.result())

    fut.add_done_callback(lambda done: post(loop, copy, done))
    return waiter
