"""Engines decode on threads that never end (``serve.decode_threads``).

MLX releases a thread's compiled kernels when the thread ends, which calls
into Python; a decoding thread that ended while the interpreter was
finalising aborted the process. The first test is a program that serves one
request, closes its engine and exits at once (with the engine's thread
ending on close, it aborted five times out of five); the second shows the
thread is kept: a later engine on the same weights compiles nothing (on a
fresh thread every kernel compiled again).
"""

import subprocess
import sys
import textwrap

import mlx.core as mx
import pytest

from dspark_fn.catalog import load_named
from dspark_fn.kernel import TRACE_COUNTS
from dspark_fn.serve.engine import Engine, Request
from published import qwen3_pair

PROMPT = [5, 17, 42, 8, 99, 23, 61, 7]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode_threads")
    qwen3_pair(tied=True, taps=[1, 2, 3, 4, 5])(root / "target", root / "draft")
    return root / "target", root / "draft"


def served_tokens(engine: Engine) -> list[int]:
    request = engine.submit(Request(PROMPT, NEW_TOKENS))
    tokens = []
    while (update := request.events.get(timeout=120)).kind == "tokens":
        tokens += update.value
    assert update.kind == "done", update
    return tokens


def test_a_program_that_closes_its_engine_and_exits_at_once_exits_cleanly(pair_dirs):
    target, draft = pair_dirs
    program = textwrap.dedent(f"""
        from dspark_fn.catalog import load_named
        from dspark_fn.serve.engine import Engine, Request
        import mlx.core as mx

        params = load_named({str(target)!r}, {str(draft)!r}, dtype=mx.float32)[0]
        engine = Engine(params, max_batch=2, max_context=512, width=4)
        request = engine.submit(Request({PROMPT!r}, {NEW_TOKENS}))
        while request.events.get(timeout=120).kind == "tokens":
            pass
        engine.close()
    """)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "terminate called" not in done.stderr


def test_a_later_engine_runs_on_the_parked_thread_and_compiles_nothing(pair_dirs):
    params = load_named(*map(str, pair_dirs), dtype=mx.float32)[0]
    first = Engine(params, max_batch=2, max_context=512, width=4)
    expected = served_tokens(first)
    first.close()
    compiled = sum(TRACE_COUNTS.values())
    second = Engine(params, max_batch=2, max_context=512, width=4)
    try:
        assert served_tokens(second) == expected
    finally:
        second.close()
    assert sum(TRACE_COUNTS.values()) == compiled
