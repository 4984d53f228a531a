"""Decoding on threads other than the main one (``dspark_fn.threads``).

MLX evaluates a pending array only on the thread that built it, and
releases a thread's compiled kernels when the thread ends, through Python:
a thread that ended just before the program exited aborted it. Each test
breaks when its guard goes: a program that serves one request, closes its
engine and exits at once (aborted five times out of five with the engine's
thread ending on close and no wait at exit); a pair loaded on the main
thread decoding on a pool's worker (without ``materialised`` at load:
"There is no Stream(cpu, 0) in current thread"; without the exit's wait
for the ended worker: aborted in two runs of three); a later engine on
the same weights compiling nothing (on a fresh thread every kernel
compiled again).
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
from test_serve_supervision import NEW_TOKENS, PROMPT, answered, new_engine


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode_threads")
    qwen3_pair(tied=True, taps=[1, 2, 3, 4, 5])(root / "target", root / "draft")
    return root / "target", root / "draft"


def served_tokens(engine: Engine) -> list[int]:
    return answered(engine, Request(PROMPT, NEW_TOKENS), wait=120)


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


def test_a_pair_loaded_on_one_thread_decodes_on_a_pool_thread_and_the_program_exits_cleanly(pair_dirs):
    target, draft = pair_dirs
    program = textwrap.dedent(f"""
        from concurrent.futures import ThreadPoolExecutor
        from dspark_fn import generate
        from dspark_fn.catalog import load_named

        params = load_named({str(target)!r}, {str(draft)!r})[0]
        def tokens():
            return [t for event in generate(params, {PROMPT!r}, {NEW_TOKENS}, width=4) for t in event.emitted]
        on_main = tokens()
        with ThreadPoolExecutor(1) as pool:  # its worker ends here, and the program exits at once
            on_worker = pool.submit(tokens).result()
        print("same" if on_worker == on_main else f"differ: {{on_worker}} against {{on_main}}")
    """)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "same"
    assert "terminate called" not in done.stderr


def test_a_later_engine_runs_on_the_parked_thread_and_compiles_nothing(pair_dirs):
    params = load_named(*map(str, pair_dirs), dtype=mx.float32)[0]
    first = new_engine(params)
    expected = served_tokens(first)
    first.close()
    compiled = sum(TRACE_COUNTS.values())
    second = new_engine(params)
    try:
        assert served_tokens(second) == expected
    finally:
        second.close()
    assert sum(TRACE_COUNTS.values()) == compiled
