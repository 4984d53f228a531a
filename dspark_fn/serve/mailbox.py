"""Where the engine thread leaves a request's updates for whoever waits on them.

The engine thread ``put``s; a request handler on the event loop awaits
``receive()``, which holds no thread while it waits: each ``put`` wakes it
through ``loop.call_soon_threadsafe``. A plain thread (a test, a library
user without asyncio) may block in ``get`` instead.
"""

import asyncio
import queue
import threading
from collections import deque


class Mailbox:
    def __init__(self):
        self._items: deque = deque()
        self._arrived = threading.Condition()
        self._waker: tuple | None = None  # (event loop, asyncio.Event) of the coroutine receiving, once one is

    def put(self, item) -> None:
        """Leave ``item`` (from any thread) and wake the receiver."""
        with self._arrived:
            self._items.append(item)
            self._arrived.notify()
            waker = self._waker
        if waker is not None:
            loop, event = waker
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the loop has closed: nobody is left to wake
                pass

    def get(self, timeout: float | None = None):
        """The next item, blocking this thread up to ``timeout`` seconds (``queue.Empty`` past it)."""
        with self._arrived:
            if not self._arrived.wait_for(lambda: self._items, timeout):
                raise queue.Empty
            return self._items.popleft()

    async def receive(self):
        """The next item, awaited on the running event loop without holding a thread."""
        if self._waker is None:
            with self._arrived:
                self._waker = (asyncio.get_running_loop(), asyncio.Event())
        event = self._waker[1]
        while True:
            event.clear()  # before looking: a put after the look sets it again
            with self._arrived:
                if self._items:
                    return self._items.popleft()
            await event.wait()
