"""Compile-first, proven: kernels trace once per (pair, width, capacity bucket), not per round or prompt."""

from typing import NamedTuple

import mlx.core as mx
import numpy as np
import pytest

from mlx.utils import tree_flatten

import dspark_fn
from dspark_fn.buffers import capacity_for, init_cache
from dspark_fn import kernel as kernel_module
from dspark_fn.kernel import TRACE_COUNTS
from dspark_fn.prefilling import prefill, smallest_chunk
from dspark_fn.schedule import CostCurve
from helpers import build_draft, build_target, draft_config, random_prompt, speculative_tokens, target_config
from numerics import assert_fp32_close

BLOCK = 4


@pytest.fixture(scope="module")
def params(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    config = target_config("qwen3", vocab=192, hidden=32, layers=4, heads=2, kv_heads=1, head_dim=16)
    build_target(root / "target", config, seed=7)
    build_draft(root / "draft", draft_config(config, taps=(0, 2), block_size=BLOCK), seed=7)
    return dspark_fn.load(root / "target", root / "draft")


def traces_during(fn):
    before = TRACE_COUNTS.copy()
    fn()
    return {k: TRACE_COUNTS[k] - before[k] for k in TRACE_COUNTS if TRACE_COUNTS[k] != before[k]}


class Pair(NamedTuple):
    first: mx.array
    second: dict


def test_a_kernel_reads_its_records_types_only_when_it_traces(monkeypatch):
    """Records cross a kernel's boundary as plain tuples and are rebuilt
    inside in their own types; those types are read when MLX traces, not
    on every call (walking the parameters each call costs a round time)."""
    walks = []
    skeleton = kernel_module._skeleton

    def counted(tree):  # recursive: only the walks from a call's arguments count
        if type(tree) is tuple and tree and isinstance(tree[0], Pair):
            walks.append(tree)
        return skeleton(tree)

    monkeypatch.setattr(kernel_module, "_skeleton", counted)

    def swap(pair: Pair) -> Pair:
        assert isinstance(pair, Pair)  # rebuilt in its own type inside the trace
        return Pair(pair.second["x"], {"x": pair.first})

    kernel = kernel_module.compiled("test swap", swap)
    pair = Pair(mx.zeros((2,)), {"x": mx.ones((2,))})
    new = traces_during(lambda: [kernel(pair) for _ in range(3)])
    assert new == {"test swap": 1} and len(walks) == 1
    swapped = kernel(Pair(mx.zeros((3,)), {"x": mx.ones((3,))}))  # a new shape: a new trace reads them again
    assert isinstance(swapped, Pair) and swapped.first.tolist() == [1, 1, 1] and len(walks) == 2


def test_capacity_buckets():
    """Multiples of 256, then of a quarter of the power of two below."""
    expected = {1: 256, 256: 256, 257: 512, 700: 768, 1024: 1024, 1025: 1280, 2049: 2560, 4097: 5120}
    assert {slots: capacity_for(slots) for slots in expected} == expected


def test_long_generation_traces_each_kernel_once(params):
    rng = np.random.default_rng(0)
    prompt = random_prompt(rng, 21, 192)
    events = []
    new = traces_during(lambda: events.extend(dspark_fn.generate(params, prompt, 200, width=None, capacity=512)))
    assert sum(e.kind == "round" for e in events) > 20
    assert new == {"prefill": 1, "draft": 1, "verify": 1}


def test_a_growing_cache_traces_once_per_bucket(params):
    """Prompts of up to 21 tokens + 700 new ones pass the buckets 256, 512
    and 768: three draft and three verify kernels, whatever the number of
    rounds; other prompt lengths then trace nothing. (A batch of two, a shape
    no other test here uses.)"""
    rng = np.random.default_rng(3)
    batch = lambda *lengths: [random_prompt(rng, n, 192) for n in lengths]  # noqa: E731
    new = traces_during(lambda: speculative_tokens(params, batch(21, 9), 700, width=None))
    assert new == {"prefill": 1, "draft": 3, "verify": 3}
    assert traces_during(lambda: speculative_tokens(params, batch(5, 17), 700, width=None)) == {}


def test_other_prompt_lengths_in_the_bucket_trace_nothing(params):
    rng = np.random.default_rng(1)
    speculative_tokens(params, random_prompt(rng, 21, 192), 50, width=None)
    for length in (3, 40, 64, 65, 130):
        prompt = random_prompt(rng, length, 192)
        assert traces_during(lambda: speculative_tokens(params, prompt, 50, width=None)) == {}


def test_a_new_width_traces_one_new_verify_kernel(params):
    prompt = random_prompt(np.random.default_rng(2), 10, 192)
    speculative_tokens(params, prompt, 20, capacity=512, width=2)
    assert traces_during(lambda: speculative_tokens(params, prompt, 20, capacity=512, width=2)) == {}
    assert traces_during(lambda: speculative_tokens(params, prompt, 20, capacity=512, width=3)) == {"verify": 1}


def test_auto_traces_each_width_at_most_once(params):
    """The auto policy switches among widths (and plain rounds) freely:
    never more than one kernel per width, and a second run traces nothing."""
    costs = CostCurve(0.1, {1: 1.0, 2: 1.05, 3: 1.1, 4: 1.15, 5: 1.2})
    prompt = random_prompt(np.random.default_rng(4), 12, 192)
    run = lambda: speculative_tokens(params, prompt, 150, capacity=512, costs=costs)  # noqa: E731
    new = traces_during(run)
    assert new.get("draft", 0) <= 1 and 1 <= new.get("verify", 0) <= BLOCK + 1
    assert traces_during(run) == {}


def test_each_batch_size_traces_once(params):
    """A decoder resized between batch sizes (a server following its load)
    compiles a draft and a verify kernel per size, and nothing on a return."""
    prompts = [random_prompt(np.random.default_rng(5), n, 192) for n in (7, 30)]
    decoder = dspark_fn.Decoder(params, 3, width=None, capacity=512)

    def visit(batch):
        decoder.resize(batch)
        for _ in range(4):
            decoder.step()

    # the first round finds nothing prepared, so it drafts first: width 5 alone
    new = traces_during(lambda: (decoder.insert(prompts), decoder.step(), decoder.step()))
    assert new == {"prefill": 1, "draft": 1, "verify": 1}
    assert traces_during(lambda: (visit(6), visit(5))) == {"draft": 2, "verify": 2}
    assert traces_during(lambda: (visit(3), visit(6), visit(5))) == {}


def test_a_long_prompt_grows_the_cache_as_it_prefills(params):
    """Prompts up to 600 tokens prefilled from a 256-slot cache: chunks of
    256, 256, then six of 16 tokens (four rows' smallest chunk; 8 on the
    bundled BLAS) run in caches of 256, 512 and 768 slots (three chunk
    kernels; a batch of four, a shape no other test here uses), and the
    result is the prefill into 768 slots from the start in chunks of the
    smallest size: the same first tokens, the cache within the fp32 bound (4 target
    layers and the draft layer; sums over 600 keys)."""
    rng = np.random.default_rng(6)
    prompts = [random_prompt(rng, n, 192) for n in (600, 5, 300, 599)]
    grown = []
    new = traces_during(lambda: grown.extend(prefill(params, init_cache(params, 4, 256), prompts, grow=True)))
    assert new == {"prefill": 3}
    whole, tokens = prefill(params, init_cache(params, 4, 768), prompts, chunk_size=smallest_chunk(len(prompts)))
    assert grown[0].capacity == 768 and grown[1].tolist() == tokens.tolist()
    assert grown[0].length.tolist() == whole.length.tolist() == [600, 5, 300, 599]
    for (name, a), (_, b) in zip(tree_flatten((grown[0].target, grown[0].draft)), tree_flatten((whole.target, whole.draft))):
        assert_fp32_close(a, b, name, layers=5, reduction=600)
    with pytest.raises(ValueError, match="does not fit the cache capacity 256"):
        prefill(params, init_cache(params, 4, 256), prompts)
