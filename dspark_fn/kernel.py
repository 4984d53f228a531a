"""``mx.compile`` for functions over the package's records.

A kernel takes and returns records (``Cache``, ``Proposal``, ``RowSampling``,
``Round``: NamedTuples, nested in lists, tuples and dicts). MLX returns
NamedTuples as they were built, but a NamedTuple argument makes it trace
once more than a plain tuple would, so arguments cross the boundary as
plain tuples and are rebuilt inside, in the types they came in.

``TRACE_COUNTS[name]`` counts the traces of each kernel (its body runs
once per trace), which the tests read to prove that rounds do not retrace;
``TRACES`` says what each trace was for: the kernel (its name and number,
which tells apart kernels of one name, such as the verify of each width)
and the shapes and types of its arguments. MLX keeps compiled kernels per
thread (each thread has its own stream), so a kernel called from a new
thread traces again.
"""

import itertools
import threading
from collections import Counter
from typing import Callable

import mlx.core as mx
from mlx.utils import tree_flatten

from . import cpu_jit
from .threads import note_decoding_thread

cpu_jit.keep_off()  # before any kernel is traced, where DSPARK_CPU_JIT=0 asks (cpu_jit.py)
PRECOMPILING = cpu_jit.precompile_preamble()  # while the model loads, so the first kernels build in a quarter of the time

TRACE_COUNTS: Counter = Counter()
TRACES: list = []  # (name, kernel number, argument signature) of each trace, in order
_kernel_numbers = itertools.count()


def _is_record(value) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def _skeleton(tree):
    """The container types of ``tree`` (records, lists, tuples, dicts), leaves as None."""
    if isinstance(tree, (list, tuple)):
        return type(tree), [_skeleton(value) for value in tree]
    if isinstance(tree, dict):
        return dict, {key: _skeleton(value) for key, value in tree.items()}
    return None


def _plain(tree):
    """``tree`` with every record as a plain tuple."""
    if _is_record(tree) or type(tree) is tuple:
        return tuple(_plain(value) for value in tree)
    if isinstance(tree, list):
        return [_plain(value) for value in tree]
    if isinstance(tree, dict):
        return {key: _plain(value) for key, value in tree.items()}
    return tree


def _rebuilt(skeleton, tree):
    """``tree`` (plain) in the container types of ``skeleton``."""
    if skeleton is None:
        return tree
    kind, children = skeleton
    if kind is dict:
        return {key: _rebuilt(children[key], value) for key, value in tree.items()}
    values = [_rebuilt(child, value) for child, value in zip(children, tree)]
    return kind(*values) if hasattr(kind, "_fields") else kind(values)


def signature(plain) -> tuple:
    """What a trace is for: each array's place, shape and type, and the other leaves as they are."""
    return tuple((place, (tuple(leaf.shape), leaf.dtype) if isinstance(leaf, mx.array) else leaf)
                 for place, leaf in tree_flatten(list(plain)))


def compiled(name: str, fn: Callable) -> Callable:
    """``fn`` compiled, taking its arguments as records; each trace adds one
    to ``TRACE_COUNTS[name]`` and its record to ``TRACES``."""
    number, calling = next(_kernel_numbers), threading.local()

    def traced(*plain):
        TRACE_COUNTS[name] += 1
        TRACES.append((name, number, signature(plain)))
        return fn(*_rebuilt(_skeleton(calling.args), plain))

    kernel = mx.compile(traced)

    def call(*args):
        note_decoding_thread()  # its kernels are released when it ends: the exit waits for that (threads.py)
        # The records' types are read only when MLX traces (walking the parameters on every call costs
        # milliseconds a round); the arguments are held for the call alone, so no cache outlives it.
        calling.args = args
        try:
            return kernel(*_plain(args))
        finally:
            calling.args = None

    return call


def _keeps_traces() -> bool:
    """Whether MLX keeps a compiled function's trace in this process: not
    where compilation is off (``MLX_DISABLE_COMPILE``, or on the CPU without
    its kernel JIT: ``cpu_jit.py``), where the function runs as written on
    every call."""
    calls = []

    def counted(x):
        calls.append(1)
        return x * x  # one operation: nothing for MLX to fuse, so no kernel to build

    kernel = mx.compile(counted)
    for _ in range(2):
        mx.eval(kernel(mx.zeros((1,))))
    return len(calls) == 1


TRACES_KEPT = _keeps_traces()


def compilations() -> int:
    """Kernels compiled so far in this process: its traces where MLX keeps
    them, else none (a trace then compiles nothing: it runs every call)."""
    return sum(TRACE_COUNTS.values()) if TRACES_KEPT else 0
