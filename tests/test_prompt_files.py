"""Prompt-cache files (``dspark_fn.prompt_cache.files``): a prefilled row saved to
one file and loaded, in this process or a new one, continues exactly as the
prefill it was saved from, on a plain target and a hybrid one; a longer
prompt reuses it and prefills only the rest; and every file that does not
fit the pair at hand is refused with a message naming why.

Breaks tried, and the tests that caught them:
- no checksum check in ``check_header``: test_a_file_that_does_not_fit_is_refused[a flipped data byte]
  and [a changed token id] (both loaded, the first continuing from a damaged buffer);
- the fingerprints left unchecked in ``check_pair``: [another target] and [another draft] loaded;
- the dtype left unchecked: [another dtype] met the target's fingerprint check instead, whose
  message names no dtype;
- the version left unchecked: [a newer format version] met the checksum instead;
- ``mx.load``'s RuntimeError not rephrased: [truncated data] and [truncated header] raised it raw;
- the layout left unchecked: [another layout] failed later with a KeyError;
- the draft's context saved as zeros: test_a_loaded_file_continues_as_the_prefill (greedy: the
  drafted proposals differ, the tokens do not) and test_a_new_process_continues_as_the_prefill;
- the seed not saved (the loaded row takes a fresh cache's, ``row_seeds(0, 1)``):
  test_a_loaded_file_continues_as_the_prefill[sampled];
- ``prompt_prefix`` reusing a hybrid file at a shorter length (no recurrent check), or not
  cutting a plain file to the tokens the prompt shares:
  test_a_hybrid_file_serves_only_prompts_that_start_with_all_of_it.
"""

import json
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import dspark_fn
from dspark_fn import prefilling
from dspark_fn.catalog import load_named
from dspark_fn.cli import main
from dspark_fn.prompt_cache.files import checksum
from dspark_fn.sampling import GREEDY, Sampling
from helpers import build_draft, build_target, draft_config, random_prompt, target_config
from hybrids import HYBRID_SHAPES, hybrid_draft_config
from numerics import assert_fp32_close

PLAIN = target_config()
HYBRID = HYBRID_SHAPES["qwen3_5"]
PROMPT, MORE, NEW_TOKENS, TOP = 40, 20, 24, 3
CAPACITY = 256  # fresh and loaded caches alike: the same buffers, so the same kernels on the same data
SEED = 7


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    """Each pair's target and draft directories on disk, and a second target and draft for the plain one."""
    root = tmp_path_factory.mktemp("prompt_files")
    build_target(root / "plain" / "target", PLAIN, seed=0)
    build_draft(root / "plain" / "draft", draft_config(PLAIN), seed=0)
    build_target(root / "other" / "target", PLAIN, seed=1)
    build_draft(root / "other" / "draft", draft_config(PLAIN), seed=1)
    last = HYBRID["num_hidden_layers"] - 1
    build_target(root / "hybrid" / "target", HYBRID, seed=3, vector_spread=0.4)
    build_draft(root / "hybrid" / "draft", hybrid_draft_config(HYBRID, taps=(0, last - 1), block_size=5), seed=1)
    return {name: (root / name / "target", root / name / "draft") for name in ("plain", "other", "hybrid")}


@pytest.fixture(scope="module")
def pairs(folders) -> dict:
    return {name: dspark_fn.load(*folders[name]) for name in ("plain", "hybrid")}


@pytest.fixture(params=["plain", "hybrid"])
def kind(request) -> str:
    return request.param


def prompt_of(params, length: int, seed: int = 0) -> list:
    return random_prompt(np.random.default_rng(seed), length, params.spec.target.vocab_size)


def prefilled(params, prompt: list, sampling=GREEDY):
    """``(cache, anchor)`` after a fresh prefill of ``prompt`` (a seed of its own, not a fresh cache's)."""
    return dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, CAPACITY, seed=SEED), prompt, sampling=sampling)


def continuation(params, cache, anchor, sampling=GREEDY) -> dict:
    """``NEW_TOKENS`` or a few more tokens of rounds from ``(cache, anchor)``:
    what each round drafted and accepted, the tokens, their log-probabilities
    and the target's most likely tokens there."""
    width, out = params.spec.block_size + 1, {"drafted": [], "accepted": [], "tokens": [], "log_probs": [], "top": []}
    while len(out["tokens"]) < NEW_TOKENS:
        proposal = dspark_fn.propose(params, cache, anchor, sampling)
        cache, step = dspark_fn.verify(params, cache, anchor, proposal, width, sampling=sampling, top_log_probs=TOP)
        count = step.count.item()
        out["drafted"].append(step.drafted[0].tolist())
        out["accepted"].append(step.accepted.item())
        out["tokens"] += step.emitted[0, :count].tolist()
        out["log_probs"] += step.scores.log_probs[0, :count].tolist()
        out["top"] += step.scores.top_ids[0, :count].tolist()
        anchor = step.next_tokens
    return out


@pytest.mark.numerics
@pytest.mark.parametrize("sampling", [GREEDY, Sampling(temperature=0.8)], ids=["greedy", "sampled"])
def test_a_loaded_file_continues_as_the_prefill(pairs, kind, sampling, tmp_path):
    """Bit for bit: the same buffers, seed and anchor, so the same kernels run on the same data."""
    params = pairs[kind]
    prompt = prompt_of(params, PROMPT)
    cache, anchor = prefilled(params, prompt, sampling)
    file = dspark_fn.save_prompt_cache(tmp_path / "prompt.safetensors", params, cache, prompt, anchor)
    loaded, held, first = dspark_fn.load_prompt_cache(file, params, capacity=CAPACITY)
    assert held == prompt and first.tolist() == anchor.tolist() and loaded.length.tolist() == [PROMPT]
    assert loaded.capacity == CAPACITY and loaded.recurrent == (kind == "hybrid")
    assert continuation(params, loaded, first, sampling) == continuation(params, cache, anchor, sampling)


CHILD = """
import json, sys
sys.path.insert(0, {tests!r})
import dspark_fn
from test_prompt_files import CAPACITY, continuation

out = {{}}
for name, (target, draft, file) in json.loads(sys.argv[1]).items():
    params = dspark_fn.load(target, draft)
    cache, held, anchor = dspark_fn.load_prompt_cache(file, params, capacity=CAPACITY)
    out[name] = dict(continuation(params, cache, anchor), held=held)
print(json.dumps(out))
"""


@pytest.mark.numerics
def test_a_new_process_continues_as_the_prefill(folders, pairs, tmp_path):
    """Both pairs' files read by a fresh interpreter, which continues bit for bit as this process does."""
    expected, jobs = {}, {}
    for name, params in pairs.items():
        prompt = prompt_of(params, PROMPT, seed=1)
        cache, anchor = prefilled(params, prompt)
        file = dspark_fn.save_prompt_cache(tmp_path / f"{name}.safetensors", params, cache, prompt, anchor)
        expected[name] = dict(continuation(params, cache, anchor), held=prompt)
        jobs[name] = [str(folders[name][0]), str(folders[name][1]), str(file)]
    child = CHILD.format(tests=str(Path(__file__).parent))
    result = subprocess.run([sys.executable, "-c", child, json.dumps(jobs)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == expected


@pytest.mark.numerics
def test_a_longer_prompt_prefills_only_the_rest(pairs, kind, tmp_path, monkeypatch):
    """A file of P serving P + Q: only Q is prefilled, and the result is the
    in-memory prefix's bit for bit, and a fresh prefill of P + Q's tokens
    (its log-probabilities to float32 rounding: the chunks split otherwise)."""
    params = pairs[kind]
    prompt = prompt_of(params, PROMPT + MORE, seed=2)
    cache, anchor = prefilled(params, prompt[:PROMPT])
    file = dspark_fn.save_prompt_cache(tmp_path / "prompt.safetensors", params, cache, prompt[:PROMPT], anchor)
    loaded, held, _ = dspark_fn.load_prompt_cache(file, params, capacity=CAPACITY)
    prefix = dspark_fn.prompt_prefix(loaded, held, prompt)
    assert prefix.length.tolist() == [PROMPT]

    prefilled_rows, prefill = [], prefilling.prefill

    def counting(params, cache, rows, **options):
        prefilled_rows.extend(len(row) for row in rows)
        return prefill(params, cache, rows, **options)

    monkeypatch.setattr(prefilling, "prefill", counting)
    results = {}
    for source, part in (("file", prefix), ("memory", cache)):
        empty = dspark_fn.init_cache(params, 1, CAPACITY)
        state, first, scores = dspark_fn.insert(params, empty, [0], [prompt], prefix=part, top_log_probs=TOP)
        results[source] = (first.tolist(), scores.log_probs.tolist(), continuation(params, state, first))
    assert prefilled_rows == [MORE, MORE]
    assert results["file"] == results["memory"]

    state, first, scores = prefill(params, dspark_fn.init_cache(params, 1, CAPACITY), prompt, top_log_probs=TOP)
    fresh = continuation(params, state, first)
    resumed = results["file"][2]
    assert first.tolist() == results["file"][0] and fresh["tokens"] == resumed["tokens"]
    budget = dict(layers=params.spec.target.num_layers, reduction=params.spec.target.vocab_size)
    assert_fp32_close(np.array(results["file"][1]), np.array(scores.log_probs), "first token", **budget)
    assert_fp32_close(np.array(resumed["log_probs"]), np.array(fresh["log_probs"]), "continuation", **budget)


def test_a_hybrid_file_serves_only_prompts_that_start_with_all_of_it(pairs, tmp_path):
    """A recurrent state holds after all the saved tokens; attention slots hold any shorter prefix too."""
    for kind, params in pairs.items():
        prompt = prompt_of(params, PROMPT, seed=3)
        cache, anchor = prefilled(params, prompt)
        file = dspark_fn.save_prompt_cache(tmp_path / f"{kind}.safetensors", params, cache, prompt, anchor)
        loaded, held, _ = dspark_fn.load_prompt_cache(file, params)
        parting = prompt[:30] + [(prompt[30] + 1) % params.spec.target.vocab_size] + prompt[31:]
        shorter, itself, longer = prompt[:25], prompt, prompt + [1, 2]
        if kind == "hybrid":
            for other, where in ((parting, "parts from them after 30"), (shorter, "has 25 tokens"),
                                 (itself, "has 40 tokens")):
                with pytest.raises(ValueError, match=f"recurrent states after all 40 of its tokens.*{where}"):
                    dspark_fn.prompt_prefix(loaded, held, other)
        else:
            for other, length in ((parting, 30), (shorter, 24), (itself, 39)):
                assert dspark_fn.prompt_prefix(loaded, held, other).length.tolist() == [length]
            with pytest.raises(ValueError, match="does not start with the prompt-cache file's first token"):
                dspark_fn.prompt_prefix(loaded, held, [(prompt[0] + 1) % params.spec.target.vocab_size] + prompt)
        assert dspark_fn.prompt_prefix(loaded, held, longer).length.tolist() == [40]


def rewritten(file: Path, change) -> Path:
    """A copy of ``file`` with its tensors and metadata passed through ``change(tensors, fields)``."""
    tensors, fields = mx.load(str(file), format="safetensors", return_metadata=True)
    change(tensors, fields)
    copy = file.with_name("rewritten.safetensors")
    with copy.open("wb") as handle:
        mx.save_safetensors(handle, tensors, metadata=fields)
    return copy


def damaged(file: Path, change) -> Path:
    """A copy of ``file`` whose bytes went through ``change(bytes) -> bytes``."""
    copy = file.with_name("damaged.safetensors")
    copy.write_bytes(change(file.read_bytes()))
    return copy


def flipped(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]


def header_end(data: bytes) -> int:
    return 8 + int.from_bytes(data[:8], "little")


def forged_without_a_buffer(tensors, fields):
    """A file of another cache layout that is otherwise whole: a buffer gone, the checksum made anew."""
    del tensors["draft.1.0"]
    fields["checksum"] = checksum(fields, tensors)


def another_version(tensors, fields):
    fields["version"] = "99"


def forged(**changes):
    """A file whose metadata fields take ``changes`` (None: the field gone),
    its checksum made anew: what anyone can write, since the checksum is a
    plain digest."""
    def change(tensors, fields):
        for name, value in changes.items():
            if value is None:
                fields.pop(name)
            else:
                fields[name] = value(fields) if callable(value) else value
        fields["checksum"] = checksum(fields, tensors)
    return change


def swapped_prompt(fields) -> str:
    """Another prompt of the same length, each token one higher."""
    return json.dumps([token + 1 for token in json.loads(fields["tokens"])])


FORGERIES = {  # each an edited file whose checksum was recomputed
    "an anchor past the vocabulary": (forged(anchor=str(10**6)), r"anchor .*1000000.* not a token id"),
    "a negative anchor": (forged(anchor="-3"), r"anchor .*-3.* not a token id"),
    "an anchor that is not a number": (forged(anchor="seven"), r"anchor .*'seven'.* not a token id"),
    "a token past the vocabulary": (forged(tokens=lambda f: json.dumps([10**6] + json.loads(f["tokens"])[1:])),
                                    r"tokens .* not token ids"),
    "tokens that are not a list": (forged(tokens='{"a": 1}'), r"tokens .* not token ids"),
    "a length past the capacity": (forged(length="200", capacity="64", tokens=json.dumps([1] * 200)),
                                   r"its length 200 exceeds its capacity 64"),
    "a length past the tokens": (forged(length="41"), r"its length 41 positions for 40 tokens"),
    "a huge length": (forged(length=str(10**30)), r"its length '1000000000000000000000000000000' is not a whole"),
    "no anchor": (forged(anchor=None), r"no anchor"),
    "no length": (forged(length=None), r"no length"),
    "a capacity that is not a number": (forged(capacity="wide"), r"capacity 'wide'"),
    "a keyed file loaded without its key": (forged(keyed="hmac-sha256"), r"signed with a key: give load_prompt_cache"),
}


def forged_case(change):
    return lambda f, folders: (rewritten(f, change), None)


REFUSALS_FORGED = {name: (forged_case(change), message) for name, (change, message) in FORGERIES.items()}


REFUSALS = {
    "another target": (lambda f, folders: (f, load_pair(folders["other"][0], folders["plain"][1])),
                       "saved for another target .* load the target it was saved with"),
    "another draft": (lambda f, folders: (f, load_pair(folders["plain"][0], folders["other"][1])),
                      "saved for another draft .* load the draft it was saved with"),
    "another dtype": (lambda f, folders: (f, load_pair(*folders["plain"], dtype=mx.bfloat16)),
                      "holds a float32 cache and this target computes in bfloat16: .*--dtype float32"),
    "truncated data": (lambda f, folders: (damaged(f, lambda d: d[:-100]), None), "truncated or corrupt"),
    "truncated header": (lambda f, folders: (damaged(f, lambda d: d[:50]), None), "truncated or corrupt"),
    "a flipped data byte": (lambda f, folders: (damaged(f, lambda d: flipped(d, (header_end(d) + len(d)) // 2)),
                                                None), "corrupt: its contents do not match the checksum"),
    "a changed token id": (lambda f, folders: (damaged(f, lambda d: flipped(d, d.index(b'"tokens":"[') + 11)), None),
                           "corrupt: its contents do not match the checksum"),
    "a newer format version": (lambda f, folders: (rewritten(f, another_version), None),
                               "format version 99, and this dspark_fn reads version 1"),
    "another layout": (lambda f, folders: (rewritten(f, forged_without_a_buffer), None),
                       "another layout .*no draft.1.0"),
    "no prompt cache": (lambda f, folders: (rewritten(f, lambda tensors, fields: fields.clear()), None),
                        "not a dspark_fn prompt-cache file"),
} | REFUSALS_FORGED


def load_pair(target, draft, dtype=None):
    return load_named(str(target), str(draft), dtype=dtype)[0]


@pytest.fixture(scope="module")
def saved(pairs, tmp_path_factory) -> Path:
    """A file of the plain pair's prefilled prompt, which every refusal changes a copy of."""
    params = pairs["plain"]
    prompt = prompt_of(params, PROMPT)
    cache, anchor = prefilled(params, prompt)
    return dspark_fn.save_prompt_cache(tmp_path_factory.mktemp("saved") / "prompt.safetensors", params, cache,
                                       prompt, anchor)


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_file_that_does_not_fit_is_refused(folders, pairs, saved, case):
    make, message = REFUSALS[case]
    bad, other = make(saved, folders)
    with pytest.raises(ValueError, match=message):
        dspark_fn.load_prompt_cache(bad, other or pairs["plain"])


def test_a_forged_file_passes_the_checksum_but_not_a_key(pairs, saved, tmp_path):
    """The checksum detects damage, not tampering: a file whose metadata
    names another prompt than its buffers hold, its checksum recomputed,
    loads (as the prompt it names). Saved with a key, the same forgery is
    refused, and so is the right file loaded with another key or none."""
    params = pairs["plain"]
    forgery = rewritten(saved, forged(tokens=swapped_prompt))
    _, held, _ = dspark_fn.load_prompt_cache(forgery, params)
    assert held == [token + 1 for token in prompt_of(params, PROMPT)]
    cache, anchor = prefilled(params, prompt_of(params, PROMPT))
    signed = dspark_fn.save_prompt_cache(tmp_path / "signed.safetensors", params, cache, prompt_of(params, PROMPT),
                                         anchor, key=b"a secret")
    _, held, _ = dspark_fn.load_prompt_cache(signed, params, key=b"a secret")
    assert held == prompt_of(params, PROMPT)
    with pytest.raises(ValueError, match="does not match the signature made with the key"):
        dspark_fn.load_prompt_cache(rewritten(signed, forged(tokens=swapped_prompt)), params, key=b"a secret")
    with pytest.raises(ValueError, match="does not match the signature made with the key"):
        dspark_fn.load_prompt_cache(signed, params, key=b"another secret")
    with pytest.raises(ValueError, match="signed with a key: give load_prompt_cache"):
        dspark_fn.load_prompt_cache(signed, params)


def test_saving_takes_the_tokens_the_row_holds_and_writes_whole(pairs, tmp_path):
    params = pairs["plain"]
    prompt = prompt_of(params, PROMPT)
    cache, anchor = prefilled(params, prompt)
    with pytest.raises(ValueError, match="holds 40 tokens but 39 were given"):
        dspark_fn.save_prompt_cache(tmp_path / "prompt.safetensors", params, cache, prompt[:-1], anchor)
    with pytest.raises(FileNotFoundError, match="no prompt-cache file"):
        dspark_fn.load_prompt_cache(tmp_path / "prompt.safetensors", params)
    file = dspark_fn.save_prompt_cache(tmp_path / "deeper" / "prompt.bin", params, cache, prompt, anchor)
    assert sorted(p.name for p in file.parent.iterdir()) == ["prompt.bin"]  # no suffix added, no temporary left
    _, fields = mx.load(str(file), format="safetensors", return_metadata=True)
    assert json.loads(fields["tokens"]) == prompt and fields["anchor"] == str(anchor.item())
    assert (fields["dtype"], fields["rows"], fields["length"], fields["capacity"]) == ("float32", "1", "40", "256")


def generated(capsys, target, draft, prompt: list, *flags) -> tuple[list, str]:
    """``dspark generate --json``'s tokens for ``prompt`` (a fixed width: no cost curve is timed), and its stderr."""
    code = main(["generate", "--model", str(target), "--draft", str(draft), "--prompt-tokens",
                 ",".join(map(str, prompt)), "--max-tokens", "12", "--width", "4", "--json", *map(str, flags)])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)["tokens"], err


@pytest.mark.numerics
def test_the_command_line_saves_and_resumes(folders, pairs, kind, tmp_path, capsys):
    """The run that saves, the runs that resume the same prompt and a longer
    one, all greedy as the plain run; a damaged file is one line on stderr."""
    target, draft = folders[kind]
    prompt = prompt_of(pairs[kind], PROMPT, seed=4)
    longer = prompt + prompt_of(pairs[kind], MORE, seed=5)
    file = tmp_path / "prompt.safetensors"
    plain, _ = generated(capsys, target, draft, prompt)
    saving, err = generated(capsys, target, draft, prompt, "--save-prompt-cache", file)
    assert saving == plain and f"[prompt cache: 39 tokens saved to {file}]" in err
    resumed, err = generated(capsys, target, draft, prompt, "--prompt-cache", file)
    assert resumed == plain and f"[prompt cache: 39 of the prompt's 40 tokens read from {file}]" in err
    resumed, err = generated(capsys, target, draft, longer, "--prompt-cache", file)
    assert resumed == generated(capsys, target, draft, longer)[0] and "39 of the prompt's 60 tokens" in err

    bad = damaged(file, lambda d: flipped(d, len(d) - 1))
    code = main(["generate", "--model", str(target), "--draft", str(draft), "--prompt-tokens", "1,2,3",
                 "--prompt-cache", str(bad)])
    error = capsys.readouterr().err
    assert code == 2 and error.startswith("dspark: ") and "corrupt" in error and error.count("\n") == 1
