"""The prompt cache's disk tier (``prompt_cache.disk``, ``dspark serve
--prompt-cache-dir``): conversations evicted from memory, and those in
memory when the engine stops, answer a new engine over the same directory
as a fresh prefill would; the directory keeps to its size bound, least
recently used first, that order surviving a restart; a process killed while
it writes, and files cut short or damaged, leave nothing a lookup uses
wrongly; another pair's files are never read; a hybrid target's file serves
only prompts that start with all of it.

Breaks tried, and the tests that caught them:
- the engine's stop not writing the memory's entries (no ``spill`` in
  ``Engine._run``): test_a_restarted_engine_answers_from_disk_as_a_fresh_prefill
  (one file after the stop, not two);
- an entry evicted from memory dropped instead of written (``_evict``
  without ``keep``): the same test (no file after the eviction);
- the evicted entry's file holding the newest entry's cache: the same test
  (the restarted engine's reply differs from the fresh prefill's);
- ``PromptCache.lookup`` never asking the disk tier: the same test (no token
  reused); a file's cache given whole, not cut to the prefix the prompt
  shares: the same test (the engine had no token left to prefill);
- ``_shrink`` deleting none of this pair's files, or a file used not marked
  so in the index, or not stamped on disk (the order lost at a restart):
  test_the_directory_keeps_to_its_bound_least_recently_used_first (each
  kept the wrong file); an entry larger than the bound written anyway: the
  same test (it took the other files' place, then went itself);
- the signature left unchecked (``check_header`` without it):
  test_a_kill_mid_write_and_damaged_files_leave_nothing_used_wrongly (the
  file with a changed byte loaded, its seed not the prefill's);
- ``read_fields`` without its size check: the same test (the file cut short
  kept by the scan); the scan leaving the killed write's temporary file: the
  same test;
- the files named by the dtype alone (``pair_digest`` without the
  fingerprints): test_another_pairs_files_are_never_used (both pairs took
  one name); the scan without ``check_pair`` (a file of the first target
  under the second's name indexed), or past the bound deleting none of
  another pair's files first: the same test;
- every file indexed as one without recurrent states (``DiskTier.recurrent``
  False): test_a_hybrid_file_serves_only_prompts_that_start_with_all_of_it
  (a prompt parting from the file's tokens got its first 30).
"""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mlx.utils import tree_flatten

import dspark_fn
from dspark_fn.atomic import TEMPORARY
from dspark_fn.buffers import capacity_for, init_cache, row_cache
from dspark_fn.cache import map_slots
from dspark_fn.cli import build_parser
from dspark_fn.serve.engine import Engine, Request
from dspark_fn.prompt_cache.memory import PromptCache
from dspark_fn.prompt_cache.disk import DiskTier, file_name
from helpers import build_draft, build_pair, build_target, random_prompt, target_config
from hybrids import HYBRID_SHAPES, hybrid_draft_config
from test_prompt_files import damaged, flipped, header_end

CONFIG = target_config(hidden=32, layers=3, heads=2, kv_heads=1, head_dim=16)
HYBRID = HYBRID_SHAPES["qwen3_5"]
PROMPT, NEW_TOKENS = 40, 8
BIG = 1 << 30


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    """The pair's target and draft, another target of the same shape beside the same draft, and a hybrid pair."""
    root = tmp_path_factory.mktemp("prompt_cache_disk")
    build_pair(root / "plain", CONFIG, block_size=4)
    build_target(root / "other", CONFIG, seed=1)
    last = HYBRID["num_hidden_layers"] - 1
    build_target(root / "hybrid" / "target", HYBRID, seed=3, vector_spread=0.4)
    build_draft(root / "hybrid" / "draft", hybrid_draft_config(HYBRID, taps=(0, last - 1), block_size=4), seed=1)
    return {"plain": (root / "plain" / "target", root / "plain" / "draft"),
            "other": (root / "other", root / "plain" / "draft"),
            "hybrid": (root / "hybrid" / "target", root / "hybrid" / "draft")}


@pytest.fixture(scope="module")
def params(folders):
    return dspark_fn.load(*folders["plain"])


def prompts(count: int, seed: int = 0, length: int = PROMPT) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [random_prompt(rng, length, CONFIG["vocab_size"]) for _ in range(count)]


def prefilled_row(params, prompt: list):
    """A fresh prefill of ``prompt`` as the server keeps it: one row in buffers of its own."""
    cache, _ = dspark_fn.prefill(params, init_cache(params, 1, capacity_for(1)), prompt, grow=True)
    return row_cache(cache, 0, len(prompt))


def buffer_bytes(cache) -> int:
    return sum(a.nbytes for _, a in tree_flatten((cache.target, cache.draft)))


def held(cache, length: int) -> list:
    """What ``cache`` holds of its first ``length`` positions, buffer by
    buffer (recurrent states whole), and its seed: two caches equal here
    continue alike."""
    kept = map_slots(lambda buffer: buffer[:, :, :length], (cache.target, cache.draft))
    return [np.array(leaf) for _, leaf in tree_flatten(kept)] + [np.array(cache.seeds)]


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b))


def answer(engine: Engine, prompt: list, new_tokens: int = NEW_TOKENS) -> tuple[list, int]:
    """``(the greedy reply, the prompt tokens taken from the prompt cache)``."""
    request = engine.submit(Request(prompt, new_tokens))
    tokens = []
    while (update := request.events.get(timeout=120)).kind == "tokens":
        tokens += update.value
    assert update.kind == "done", update
    return tokens, request.cached_tokens


def engine_of(params, directory=None, memory: int = BIG) -> Engine:
    return Engine(params, max_batch=1, max_context=256, prompt_cache_bytes=memory, prompt_cache_dir=directory,
                  width=4)  # a fixed width: no cost measurement


def files(directory: Path) -> dict:
    """The directory's entry files (and writes cut short) and their sizes; its key and lock aside."""
    return {path.name: path.stat().st_size for path in directory.iterdir() if ".safetensors" in path.name}


def test_a_restarted_engine_answers_from_disk_as_a_fresh_prefill(params, tmp_path):
    """Two conversations on an engine whose memory holds one: the first is
    evicted to disk when the second is kept, the second written at the
    engine's stop. A new engine over the directory answers each follow-up
    from its file, token for token as an engine that prefills it afresh."""
    first, second = prompts(2)
    kept_length = PROMPT + NEW_TOKENS - 1  # what a reply leaves in the cache: all but its last token
    one_entry = buffer_bytes(row_cache(init_cache(params, 1, capacity_for(kept_length)), 0, kept_length))
    engine = engine_of(params, tmp_path, memory=one_entry * 3 // 2)
    try:
        replies = [answer(engine, prompt)[0] for prompt in (first, second)]
        assert len(files(tmp_path)) == 1 and engine.stats()["prompt_cache"]["disk"]["entries"] == 1
    finally:
        engine.close()
    assert len(files(tmp_path)) == 2 and not any(name.endswith(TEMPORARY) for name in files(tmp_path))

    # the first conversation's tokens as kept (its file cut by one: the prompt's last token is prefilled), the
    # second's followed up (its file whole)
    follow_ups = [(first + replies[0][:-1], kept_length - 1), (second + replies[1] + [7, 8, 9], kept_length)]
    restarted, fresh = engine_of(params, tmp_path), engine_of(params, memory=0)
    try:
        disk = restarted.stats()["prompt_cache"]["disk"]
        assert (disk["entries"], disk["bytes"]) == (2, sum(files(tmp_path).values()))
        for follow_up, reused in follow_ups:
            tokens, cached = answer(restarted, follow_up)
            assert cached == reused
            assert tokens == answer(fresh, follow_up)[0]
        state = restarted.stats()["prompt_cache"]
        assert state["disk"]["hits"] == 2 and state["entries"] >= 2  # kept in memory again
    finally:
        restarted.close()
        fresh.close()


def test_the_directory_keeps_to_its_bound_least_recently_used_first(params, tmp_path):
    """Room for two files of three: the one used least recently goes, and
    that order is the files' own, so a restart with room for one keeps the
    file used last, not the one written last. An entry larger than the
    whole bound is not written, and takes no file's place."""
    rows = {tuple(p): prefilled_row(params, p) for p in prompts(3, seed=1)}
    (a, b, c), caches = list(rows), list(rows.values())
    measure = DiskTier(tmp_path / "measure", params)
    measure.keep(a, caches[0], buffer_bytes(caches[0]))
    size = measure.used  # every file here is as large: the same length, the same buffers
    directory = tmp_path / "cache"
    tier = DiskTier(directory, params, budget_bytes=size * 5 // 2)
    memory = PromptCache(0, disk=tier)  # keeps nothing: every lookup goes to disk
    for tokens, cache in zip((a, b), caches):
        tier.keep(tokens, cache, buffer_bytes(cache))
    assert memory.lookup(list(a) + [1]) is not None  # a is used: b is now the least recently used
    tier.keep(c, caches[2], buffer_bytes(caches[2]))
    assert sorted(files(directory)) == sorted(file_name(tier.prefix, "", t) for t in (a, c))
    assert sum(files(directory).values()) == tier.used <= tier.budget
    assert memory.lookup(list(b) + [1]) is None
    assert memory.lookup(list(a) + [1]) is not None  # a again: now used after c was written

    restarted = DiskTier(directory, params, budget_bytes=size * 3 // 2)
    assert list(files(directory)) == [file_name(tier.prefix, "", a)] and len(restarted) == 1
    assert sum(files(directory).values()) <= restarted.budget

    long = prompts(1, seed=1, length=10 * PROMPT)[0]  # a capacity of 512 slots, where the others have 256
    large = prefilled_row(params, long)
    assert buffer_bytes(large) > restarted.budget
    restarted.keep(tuple(long), large, buffer_bytes(large))  # it would take the place of every file, and not fit
    assert list(files(directory)) == [file_name(tier.prefix, "", a)] and len(restarted) == 1


WRITER = """
import sys, time
sys.path.insert(0, {tests!r})
import dspark_fn  # before mlx: the same BLAS as this process, so the same prefill bit for bit
import mlx.core as mx
from dspark_fn.prompt_cache.disk import DiskTier
from test_prompt_cache_disk import buffer_bytes, prefilled_row, prompts

params = dspark_fn.load({target!r}, {draft!r})
tier = DiskTier({directory!r}, params)
save, written = mx.save_safetensors, []


def torn(handle, tensors, metadata):
    # the last file: half of it on disk, then the process waits for its kill, its rename never made
    save(handle, tensors, metadata=metadata)
    written.append(handle.name)
    if len(written) == {count}:
        handle.flush()
        handle.truncate(handle.tell() // 2)
        handle.flush()
        print("torn", flush=True)
        time.sleep(600)


mx.save_safetensors = torn
for prompt in prompts({count}, seed=2):
    cache = prefilled_row(params, prompt)
    tier.keep(tuple(prompt), cache, buffer_bytes(cache))
"""


def test_a_kill_mid_write_and_damaged_files_leave_nothing_used_wrongly(folders, params, tmp_path, capsys):
    """A process writing entries killed (SIGKILL) in the middle of its fourth
    file, then two files of this process damaged as a disk could leave them:
    one cut short under its final name, one with a byte changed. A new
    cache over the directory deletes the temporary file and the one cut
    short at its start, the damaged one when a lookup reaches it; each
    lookup of every prompt misses or gives exactly the prefill's cache."""
    written = prompts(4, seed=2)
    command = [sys.executable, "-c", WRITER.format(tests=str(Path(__file__).parent), target=str(folders["plain"][0]),
                                                   draft=str(folders["plain"][1]), directory=str(tmp_path),
                                                   count=len(written))]
    writer = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "torn", writer.stderr.read()
        os.kill(writer.pid, signal.SIGKILL)
    finally:
        writer.kill()
        writer.wait(timeout=60)
    partial = [name for name in files(tmp_path) if name.endswith(TEMPORARY)]
    assert len(partial) == 1 and len(files(tmp_path)) == len(written)  # three whole files and the torn one

    cut, changed = prompts(2, seed=3)
    tier = DiskTier(tmp_path, params)
    for prompt in (cut, changed):
        cache = prefilled_row(params, prompt)
        tier.keep(tuple(prompt), cache, buffer_bytes(cache))
    cut_file, changed_file = (tmp_path / file_name(tier.prefix, "", p) for p in (cut, changed))
    cut_file.write_bytes(cut_file.read_bytes()[: cut_file.stat().st_size * 2 // 3])
    damaged(changed_file, lambda data: flipped(data, header_end(data) + 2)).replace(changed_file)  # a held value
    capsys.readouterr()

    restarted = DiskTier(tmp_path, params)
    assert not any(name.endswith(TEMPORARY) for name in files(tmp_path)) and not cut_file.exists()
    assert len(restarted) == len(written)  # the three the writer finished, and the changed one
    cache = PromptCache(BIG, disk=restarted)
    found = {}
    for prompt in written + [cut, changed]:
        loaded = cache.lookup(prompt + [1])
        if loaded is not None:
            assert int(loaded.length[0]) == PROMPT
            assert same(held(loaded, PROMPT), held(prefilled_row(params, prompt), PROMPT))
        found[tuple(prompt)] = loaded is not None
    assert list(found.values()) == [True, True, True, False, False, False]
    assert restarted.refused == 2 and not changed_file.exists()
    log = capsys.readouterr().err
    assert f"deleted {cut_file.name}" in log and "truncated or corrupt" in log
    assert f"deleted {changed_file.name}" in log and "does not match the signature made with the key" in log


def test_another_pairs_files_are_never_used(folders, params, tmp_path, capsys):
    """Another target of the same shape over the same directory: the first
    one's files are not its own (by name), one copied under its name is
    refused by its fingerprints, and past the bound the other pair's files
    go before its own."""
    other = dspark_fn.load(*folders["other"])
    prompt, own = prompts(2, seed=4)
    first = DiskTier(tmp_path, params)
    cache = prefilled_row(params, prompt)
    first.keep(tuple(prompt), cache, buffer_bytes(cache))
    size = first.used

    second = DiskTier(tmp_path, other)
    assert second.prefix != first.prefix and len(second) == 0 and second.other_bytes == size
    assert PromptCache(BIG, disk=second).lookup(prompt + [1]) is None

    shutil.copy(tmp_path / file_name(first.prefix, "", prompt), tmp_path / file_name(second.prefix, "", prompt))
    capsys.readouterr()
    again = DiskTier(tmp_path, other)
    assert len(again) == 0 and again.refused == 1 and "saved for another target" in capsys.readouterr().err
    assert not (tmp_path / file_name(second.prefix, "", prompt)).exists()
    assert PromptCache(BIG, disk=again).lookup(prompt + [1]) is None

    bounded = DiskTier(tmp_path, other, budget_bytes=size * 3 // 2)
    mine = prefilled_row(other, own)
    bounded.keep(tuple(own), mine, buffer_bytes(mine))
    assert list(files(tmp_path)) == [file_name(second.prefix, "", own)]


def test_a_hybrid_file_serves_only_prompts_that_start_with_all_of_it(folders, tmp_path):
    """A recurrent state holds after all the file's tokens: a prompt that
    parts from them inside finds nothing on disk."""
    hybrid = dspark_fn.load(*folders["hybrid"])
    prompt = prompts(1, seed=5)[0]
    cache = prefilled_row(hybrid, prompt)
    DiskTier(tmp_path, hybrid).keep(tuple(prompt), cache, buffer_bytes(cache))
    memory = PromptCache(BIG, disk=DiskTier(tmp_path, hybrid))
    parting = prompt[:30] + [(prompt[30] + 1) % HYBRID["vocab_size"]] + prompt[31:]
    assert memory.lookup(parting) is None
    loaded = memory.lookup(prompt + [1, 2])
    assert loaded.recurrent and int(loaded.length[0]) == PROMPT
    assert same(held(loaded, PROMPT), held(cache, PROMPT))


def test_entries_are_kept_apart_by_scope_across_a_restart(params, tmp_path):
    """An entry written in one scope is found, after a restart, from that
    scope only; the directory and its files are readable by their owner
    alone."""
    prompt = prompts(1, seed=6)[0]
    cache = prefilled_row(params, prompt)
    DiskTier(tmp_path, params).keep(tuple(prompt), cache, buffer_bytes(cache), scope="alice")
    restarted = PromptCache(BIG, disk=DiskTier(tmp_path, params))
    assert restarted.lookup(prompt + [1], scope="bob") is None and restarted.lookup(prompt + [1]) is None
    assert int(restarted.lookup(prompt + [1], scope="alice").length[0]) == PROMPT
    assert (tmp_path.stat().st_mode & 0o777) == 0o700
    assert all((path.stat().st_mode & 0o777) == 0o600 for path in tmp_path.iterdir())


def test_a_planted_file_is_dropped_and_a_second_server_refused(params, tmp_path, capsys):
    """A file named as an entry but holding anything else, and an entry
    signed with another directory's key, are deleted at start, never fatal;
    an engine on a directory another engine holds refuses to start."""
    prompt = prompts(1, seed=7)[0]
    cache = prefilled_row(params, prompt)
    other = tmp_path / "other"
    DiskTier(other, params).keep(tuple(prompt), cache, buffer_bytes(cache))
    mine = DiskTier(tmp_path / "mine", params)
    for name in files(other):  # a real entry, signed with the other directory's key
        shutil.copy(other / name, tmp_path / "mine" / name)
    (tmp_path / "mine" / file_name(mine.prefix, "", [1, 2, 3])).write_bytes(os.urandom(300))
    capsys.readouterr()
    cache_ = PromptCache(BIG, disk=DiskTier(tmp_path / "mine", params))
    assert cache_.lookup(prompt + [1]) is None
    assert not files(tmp_path / "mine") and "deleted" in capsys.readouterr().err
    first = engine_of(params, tmp_path / "mine")
    try:
        with pytest.raises(ValueError, match="another server uses the prompt-cache directory"):
            engine_of(params, tmp_path / "mine")
    finally:
        first.close()
    engine_of(params, tmp_path / "mine").close()  # free again once the first has stopped


def test_the_command_line_and_the_engine_take_a_directory(params, tmp_path):
    """``dspark serve --prompt-cache-dir DIR [--prompt-cache-dir-bytes N]``;
    under mlx.launch (each rank holding its share of the caches) refused."""
    parser = build_parser()
    args = parser.parse_args(["serve", "--prompt-cache-dir", str(tmp_path), "--prompt-cache-dir-bytes", "1000"])
    assert (args.prompt_cache_dir, args.prompt_cache_dir_bytes) == (str(tmp_path), 1000)
    assert parser.parse_args(["serve"]).prompt_cache_dir_bytes == 8 << 30

    class TwoRanks:
        def size(self) -> int:
            return 2

    with pytest.raises(ValueError, match="drop --prompt-cache-dir under mlx.launch"):
        Engine(params, prompt_cache_dir=tmp_path, group=TwoRanks())
