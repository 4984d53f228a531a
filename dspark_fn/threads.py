"""Decoding on threads other than the main one.

MLX keeps compiled kernels per thread and releases them when the thread
ends, through Python. A thread that ended just before the program exited
(a closed engine's, a ``ThreadPoolExecutor``'s worker) released them while
the interpreter was finalising, and the process aborted ("terminate called
without an active exception"). Two guards:

- An engine's loop runs on a parked thread (``run_parked``): one that never
  ends, parks when the loop returns, and runs the next engine's loop, which
  then compiles nothing.
- Every thread that runs a kernel is noted (``note_decoding_thread``); at
  exit, before Python finalises, ``wait_for_ended_threads`` waits until
  those that ended are gone (Linux, read from ``/proc``; elsewhere a
  program that decodes on its own threads should end them well before it
  exits).
"""

import atexit
import os
import queue
import threading
import time
import traceback
from typing import Callable

EXIT_WAIT_SECONDS = 5.0  # the most the exit waits for ended threads to finish releasing their kernels

_parked: list["_DecodeThread"] = []
_parked_lock = threading.Lock()
_decoding_threads: set[int] = set()  # native ids of the threads that ran a kernel


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


def note_decoding_thread() -> None:
    _decoding_threads.add(threading.get_native_id())


def wait_for_ended_threads(timeout: float = EXIT_WAIT_SECONDS) -> None:
    """Until every noted thread that Python no longer runs has left the
    process (its kernels released), or ``timeout``."""
    running = {thread.native_id for thread in threading.enumerate()}
    deadline = time.monotonic() + timeout
    for native_id in _decoding_threads - running:
        while os.path.exists(f"/proc/self/task/{native_id}") and time.monotonic() < deadline:
            time.sleep(0.005)


atexit.register(wait_for_ended_threads)  # atexit runs before Python finalises; other threads still get the interpreter
