"""``mx.compile`` for functions over the package's records.

A kernel takes and returns records (``Cache``, ``Proposal``, ``RowSampling``,
``Round``: NamedTuples, nested in lists, tuples and dicts). MLX returns
NamedTuples as they were built, but a NamedTuple argument makes it trace
once more than a plain tuple would, so arguments cross the boundary as
plain tuples and are rebuilt inside, in the types they came in.

``TRACE_COUNTS[name]`` counts the traces of each kernel (its body runs
once per trace), which the tests read to prove that rounds do not retrace.
"""

from collections import Counter
from typing import Callable

import mlx.core as mx

TRACE_COUNTS: Counter = Counter()


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


def compiled(name: str, fn: Callable) -> Callable:
    """``fn`` compiled, taking its arguments as records; each trace adds one to ``TRACE_COUNTS[name]``."""
    arguments = {}

    def traced(*plain):
        TRACE_COUNTS[name] += 1
        return fn(*_rebuilt(arguments["skeleton"], plain))

    kernel = mx.compile(traced)

    def call(*args):
        arguments["skeleton"] = _skeleton(args)
        return kernel(*_plain(args))

    return call
