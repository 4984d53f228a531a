"""Every launch that writes cache slots checks on the host, before it runs,
that its rows fit the buffers: an internal inconsistency raises a
``ValueError`` naming the row, its length and the capacity (a write out of
bounds would corrupt memory or crash the interpreter instead).

Breaks tried, and the tests that catch them:
- the prefill without its per-chunk check (``check_writes`` in ``prefill``):
  test_a_prefill_chunk_past_the_cache_raises (the chunk writes past the
  buffer; no ValueError);
- the Decoder's verify without ``check_writes`` (in ``Decoder._make_room``):
  test_a_verify_past_the_capacity_raises;
- ``Decoder.step`` without ``_check_lengths`` after the round (in ``Decoder._commit``):
  test_a_row_longer_in_the_cache_than_counted_raises;
- ``Decoder.resize`` taking a row's committed count from the row after it:
  test_resize_keeps_each_rows_count (raised by ``_check_lengths`` in resize);
- ``insert`` without ``check_rows``: test_insert_into_a_row_outside_the_batch_raises.
"""

import numpy as np
import pytest

import dspark_fn
from dspark_fn import buffers, driver, prefilling
from dspark_fn.driver import Decoder
from helpers import build_draft, build_target, draft_config, random_prompt, target_config

CONFIG = target_config("qwen3", vocab=128, hidden=32, layers=3, heads=2, kv_heads=1, head_dim=16)
CAPACITY = 256


@pytest.fixture(scope="module")
def params(tmp_path_factory):
    root = tmp_path_factory.mktemp("checked")
    build_target(root / "target", CONFIG, seed=7)
    build_draft(root / "draft", draft_config(CONFIG, layers=1, taps=(0, 1), block_size=4), seed=2)
    return dspark_fn.load(root / "target", root / "draft")


def prompt(length: int, seed: int = 0) -> list:
    return random_prompt(np.random.default_rng(seed), length, CONFIG["vocab_size"])


def test_a_prefill_chunk_past_the_cache_raises(params, monkeypatch):
    """A growing prefill whose growth stops short (the last chunk of a
    300-token prompt left in 256 slots) is refused before that chunk runs."""
    grow = buffers.grow_cache
    monkeypatch.setattr(prefilling, "grow_cache", lambda p, cache, capacity: grow(p, cache, min(capacity, CAPACITY)))
    cache = buffers.init_cache(params, 1, CAPACITY)
    chunk = prefilling.smallest_chunk(1)  # 64 over OpenBLAS, 8 over the bundled BLAS
    with pytest.raises(ValueError, match=rf"prefill chunk: cache row 0 at length 256 would write {chunk} slots past "
                                         r"the capacity 256"):
        prefilling.prefill(params, cache, prompt(300), grow=True)


def test_a_verify_past_the_capacity_raises(params, monkeypatch):
    """A row the decoder counts at the end of the cache (its count
    inconsistent with the cache) whose room was not made (the growth
    stops short) is refused before the verify writes."""
    decoder = Decoder(params, 2, width=3)
    decoder.start([prompt(5), prompt(9, 1)])
    decoder.rows[1].committed = CAPACITY - 1
    monkeypatch.setattr(driver, "grow_cache", lambda params, cache, capacity: cache)
    with pytest.raises(ValueError, match=r"a verify of width 3: cache row 1 at length 255 would write 3 slots past "
                                         r"the capacity 256"):
        decoder.step()


def test_a_row_longer_in_the_cache_than_counted_raises(params):
    """A count behind the cache's own length (the next verify would write
    where the decoder planned nothing) is refused after the round that reads it."""
    decoder = Decoder(params, 1, width=3, capacity=CAPACITY)
    decoder.start([prompt(7)])
    decoder.rows[0].committed -= 2
    with pytest.raises(ValueError, match=r"cache row 0 holds length \d+ but the decoder counts \d+ committed "
                                         r"positions \(capacity 256\)"):
        decoder.step()


def test_resize_keeps_each_rows_count(params):
    """Rows of different lengths moved by a resize keep their own counts (the
    check in resize reads the moved lengths), and decode on."""
    decoder = Decoder(params, 4, width=3)
    decoder.insert([prompt(5), prompt(9, 2), prompt(40, 1), prompt(12, 3)])
    decoder.step()
    decoder.release(0)
    decoder.release(2)
    counts = decoder.committed[[1, 3]].tolist()
    decoder.resize(2)
    assert decoder.committed.tolist() == counts
    decoder.step()


def test_insert_into_a_row_outside_the_batch_raises(params):
    cache = buffers.init_cache(params, 2, CAPACITY)
    with pytest.raises(ValueError, match="row 5 is not a row of the batch of 2"):
        prefilling.insert(params, cache, [5], [prompt(4)])
    with pytest.raises(ValueError, match=r"2 prompts need 2 distinct rows, got \[1, 1\]"):
        prefilling.insert(params, cache, [1, 1], [prompt(4), prompt(4)])


def test_a_full_batch_or_a_running_tag_is_refused(params):
    decoder = Decoder(params, 2, width=3)
    decoder.insert([prompt(4)], tags=["a"])
    with pytest.raises(ValueError, match=r"2 prompts but 1 free row\(s\) in the batch of 2: resize the batch first"):
        decoder.insert([prompt(4), prompt(5)])
    with pytest.raises(ValueError, match=r"1 sequences need 1 distinct tags that no running sequence has, got \['a'\]"):
        decoder.insert([prompt(4)], tags=["a"])
    with pytest.raises(ValueError, match="no running sequence is tagged 'b'"):
        decoder.release("b")
