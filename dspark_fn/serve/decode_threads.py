"""Threads that decode and never end: an engine's loop runs on one, which
parks when the loop returns and runs the next engine's loop.

MLX keeps compiled kernels per thread and releases them when the thread
ends, which calls into Python: a decoding thread that ended while the
interpreter was finalising (a program that closed its engine and exited at
once) aborted the process ("terminate called without an active
exception"). A parked thread never ends, so it never races the exit; and a
later engine on it reuses the kernels it compiled.
"""

import queue
import threading
import traceback
from typing import Callable

_parked: list["_DecodeThread"] = []
_parked_lock = threading.Lock()


class _DecodeThread:
    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="dspark-engine", daemon=True).start()

    def _serve(self) -> None:
        while True:
            job, finished = self.jobs.get()
            try:
                job()
            except BaseException:  # the job's own failure: the thread stays to serve the next
                traceback.print_exc()
            finally:
                with _parked_lock:
                    _parked.append(self)
                finished.set()


def run_parked(job: Callable[[], None]) -> threading.Event:
    """Runs ``job()`` on a parked decode thread (a new one when none is
    free); the returned event is set once it has returned."""
    with _parked_lock:
        thread = _parked.pop() if _parked else None
    finished = threading.Event()
    (thread or _DecodeThread()).jobs.put((job, finished))
    return finished
