"""Prompt-cache files: one prefilled row of a cache in one safetensors file,
loaded in a later process exactly as the prefill left it.

A file holds the row's target and draft buffers cut to the bucket of its
committed length (``buffers.row_cache``), its seed, the prompt tokens it
holds and the first token chosen after them (the anchor, as ``prefill``
returns it), with string metadata saying what it is: the format and its
version, the dtype, the capacity and the number of rows, and a fingerprint
of the target and of the draft it was made with. Loading compares each with
the pair at hand, and a checksum over the metadata and every tensor's bytes
with the file's contents, and refuses with a ``ValueError`` that names the
mismatch and the fix; a file that loads continues bit for bit as the
prefill it was saved from.

Two ways on from a loaded file: its cache and anchor go straight into
``speculate`` (the same prompt again, with no prefill at all), or
``prompt_prefix`` makes its cache the ``prefix`` of ``insert`` /
``Decoder.insert`` for a prompt that goes on past the saved tokens, so only
the rest is prefilled. A recurrent layer's state is the one after all the
saved tokens and no fewer, so a hybrid target's file serves only prompts
that start with every saved token.
"""

import hashlib
import hmac
import json
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map_with_path

from .. import atomic
from ..buffers import capacity_for, grow_cache, init_cache, row_cache
from ..cache import Cache, map_slots
from ..targets import activation_dtype
from ..types import ImagePrompt, Params

FORMAT = "dspark_fn prompt cache"
VERSION = 1  # raised whenever what a file holds, or how it is laid out, changes
SAMPLES_PER_TENSOR = 16  # elements each parameter tensor adds to a fingerprint, spread over all of it
SEEDS = "seeds"  # the tensor holding the row's random seed; the cache's buffers sit under "target." and "draft."
KEYED = "hmac-sha256"  # the ``keyed`` field of a file signed with a key
REQUIRED = ("tokens", "anchor", "length", "capacity", "rows", "dtype", "target", "draft")
LARGEST_CAPACITY = 1 << 31  # past any cache a file can hold


def dtype_name(dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def fingerprint(spec, tree: dict) -> str:
    """A digest of one model that any process computes alike, without the
    paths it was loaded from: its static spec, and for every parameter
    tensor (in key order) its name, shape, dtype and a few elements spread
    over it. No tensor is read whole, so it costs the same for any size;
    weights trained apart differ in every tensor, so the samples tell them apart."""
    digest = hashlib.sha256(repr(spec).encode())
    leaves = sorted(tree_flatten(tree), key=lambda leaf: leaf[0])
    samples = [
        value.reshape(-1)[mx.array(np.unique(np.linspace(0, value.size - 1, SAMPLES_PER_TENSOR).astype(np.int64)))]
        if isinstance(value, mx.array) and value.size else None
        for _, value in leaves
    ]
    mx.eval([sample for sample in samples if sample is not None])
    for (name, value), sample in zip(leaves, samples):
        if isinstance(value, mx.array):
            digest.update(f"{name} {value.shape} {dtype_name(value.dtype)}".encode())
            if sample is not None:
                digest.update(memoryview(sample))
        else:
            digest.update(f"{name} {value!r}".encode())
    return digest.hexdigest()


def describe(spec) -> str:
    """A model in words, for refusals: its type and size."""
    layers = getattr(spec, "num_layers", None)
    return (f"{spec.model_type}" + (f", {layers} layers" if layers is not None else "")
            + f", hidden size {spec.hidden_size}, vocabulary {spec.vocab_size}")


def pair_fields(params: Params) -> dict:
    """What a file records of the pair it was made with: the cache's dtype and each model's fingerprint and name."""
    spec = params.spec
    return {
        "dtype": dtype_name(activation_dtype(spec.target_adapter.layout, params.target)),
        "target": fingerprint(spec.target, params.target), "target_model": describe(spec.target),
        "draft": fingerprint(spec.draft, params.draft), "draft_model": describe(spec.draft),
    }


def checksum(fields: dict, tensors: dict, key: bytes | None = None) -> str:
    """sha256 over the metadata (but the checksum itself) and every tensor's
    name, dtype, shape and bytes in name order: a changed byte anywhere in
    the file changes it, or stops the file from parsing at all. With a
    ``key``, an HMAC-SHA256 under it over the same bytes."""
    metadata = json.dumps({k: v for k, v in fields.items() if k != "checksum"}, sort_keys=True).encode()
    digest = hashlib.sha256(metadata) if key is None else hmac.new(key, metadata, hashlib.sha256)
    for name in sorted(tensors):
        tensor = tensors[name]
        digest.update(f"{name} {dtype_name(tensor.dtype)} {tensor.shape}".encode())
        digest.update(memoryview(tensor))
    return digest.hexdigest()


def save_prompt_cache(path, params: Params, cache: Cache, tokens, anchor, *, row: int = 0,
                      key: bytes | None = None, labels: dict | None = None) -> Path:
    """Save row ``row`` of a prefilled ``cache`` to the file ``path`` (written
    whole or not at all): its buffers cut to its committed length, its seed,
    the prompt ``tokens`` it holds (exactly ``cache.length[row]`` of them)
    and ``anchor``, the first token chosen after them (an int, or the
    ``tokens [B]`` ``prefill`` returns, whose entry ``row`` is taken).
    ``key``: sign the file (an HMAC under the key), for a file that crosses
    a trust boundary. ``labels``: strings of the caller's, kept (and signed)
    as the fields ``label.NAME`` (``read_fields`` gives them back). Returns
    the path."""
    if isinstance(tokens, ImagePrompt):
        raise ValueError("a prompt with images cannot be saved to a prompt-cache file: it holds token ids only")
    tokens = [int(t) for t in (tokens.tolist() if isinstance(tokens, mx.array) else tokens)]
    length = int(cache.length[row])
    if len(tokens) != length:
        raise ValueError(f"cache row {row} holds {length} tokens but {len(tokens)} were given: give exactly the "
                         f"prompt tokens it was prefilled with")
    first = anchor if isinstance(anchor, int) else int(mx.array(anchor).reshape(-1)[row])
    vocabulary = params.spec.target.vocab_size
    if not all(0 <= t < vocabulary for t in [*tokens, first]):
        raise ValueError(f"token ids must be in 0..{vocabulary - 1}")
    one = row_cache(cache, row, length)
    tensors = dict(tree_flatten({"target": one.target, "draft": one.draft})) | {SEEDS: one.seeds}
    mx.eval(tensors)
    fields = {"format": FORMAT, "version": str(VERSION), "tokens": json.dumps(tokens), "anchor": str(first),
              "length": str(length), "capacity": str(one.capacity), "rows": "1"} | pair_fields(params)
    fields |= {f"label.{name}": str(value) for name, value in (labels or {}).items()}
    if key is not None:
        fields["keyed"] = KEYED
    fields["checksum"] = checksum(fields, tensors, key)

    def write(partial: Path) -> None:
        with partial.open("wb") as handle:  # a file object: MLX would add a suffix to a path
            mx.save_safetensors(handle, tensors, metadata=fields)

    return atomic.write_with(path, write)


def load_prompt_cache(path, params: Params, *, capacity: int | None = None,
                      key: bytes | None = None) -> tuple[Cache, list[int], mx.array]:
    """``(cache, tokens, anchor)`` from a file ``save_prompt_cache`` wrote for
    this pair: a one-row cache holding ``tokens`` (its length) in buffers
    of ``capacity`` slots (default: the bucket that also holds a round of
    the widest verify), and ``anchor [1]``, the first token after them, as
    ``prefill`` returns it: ``speculate(params, cache, anchor)`` goes on as
    it would have after that prefill. Refuses (``ValueError``, naming the
    mismatch and the fix) a truncated or corrupt file, another format
    version, a file made for another target, draft or dtype, or one whose
    buffers do not have this pair's layout."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no prompt-cache file at {path}")
    try:
        tensors, fields = mx.load(str(path), format="safetensors", return_metadata=True)
        mx.eval(tensors)
    except (RuntimeError, ValueError) as error:
        raise ValueError(f"{path} cannot be read: a truncated or corrupt prompt-cache file ({error}); save it "
                         f"again") from None
    check_header(path, fields, tensors, key)
    saved = checked_fields(path, fields, params.spec.target.vocab_size)
    check_pair(path, fields, pair_fields(params))
    tokens, length, stored = saved.tokens, saved.length, saved.capacity
    template = init_cache(params, 1, stored)  # lazy: its shapes, nothing allocated
    shapes = {"target": template.target, "draft": template.draft}
    check_layout(path, dict(tree_flatten(shapes)) | {SEEDS: template.seeds}, tensors)
    filled = tree_map_with_path(lambda name, _: tensors[name], shapes)
    history = mx.zeros((1, stored), mx.int32)
    history[0, :length] = mx.array(tokens, mx.int32)
    cache = Cache(target=filled["target"], draft=filled["draft"], length=mx.array([length], mx.int32),
                  seeds=tensors[SEEDS], history=history)
    wanted = capacity or capacity_for(length + params.spec.block_size + 1)
    if wanted <= length:
        raise ValueError(f"a capacity of {wanted} slots does not hold the {length} saved tokens and one more")
    if wanted < stored:  # the slots past the saved length hold nothing a later round reads
        cache = cache._replace(target=map_slots(lambda b: b[:, :, :wanted], cache.target),
                               draft=map_slots(lambda b: b[:, :, :wanted], cache.draft), history=history[:, :wanted])
    return grow_cache(params, cache, wanted), tokens, mx.array([saved.anchor], mx.int32)


def read_fields(path) -> dict:
    """A prompt-cache file's metadata (its tokens, length, fingerprints) read
    from its header alone, none of its buffers: what an index of many files
    needs. Refuses (``ValueError``) a header that does not parse, a file of
    another length than the one its header describes (cut short by a crash,
    say), another format or another format version. The checksum over the
    buffers is ``load_prompt_cache``'s to compare."""
    path = Path(path)
    whole = path.stat().st_size
    with path.open("rb") as handle:
        size = int.from_bytes(handle.read(8), "little")  # safetensors: the header's length, then the header
        text = handle.read(size) if size <= whole else b""  # a length past the file's end: not a header
    try:
        header = json.loads(text)
        fields = header.pop("__metadata__", {})
        end = 8 + size + max((int(entry["data_offsets"][1]) for entry in header.values()), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as error:
        raise ValueError(f"{path} cannot be read: a truncated or corrupt prompt-cache file (its header: {error}); "
                         f"save it again") from None
    if whole != end:
        raise ValueError(f"{path} cannot be read: a truncated or corrupt prompt-cache file ({whole} bytes where "
                         f"its header describes {end}); save it again")
    check_format(path, fields)
    return fields


def check_format(path: Path, fields: dict) -> None:
    """The file is a prompt cache of this format version."""
    if fields.get("format") != FORMAT:
        raise ValueError(f"{path} is not a dspark_fn prompt-cache file (no prompt-cache metadata): give a file "
                         f"saved by save_prompt_cache or `dspark generate --save-prompt-cache`")
    if fields.get("version") != str(VERSION):
        raise ValueError(f"{path} is a prompt-cache file of format version {fields.get('version')}, and this "
                         f"dspark_fn reads version {VERSION}: save it again with this version")


def check_header(path: Path, fields: dict, tensors: dict, key: bytes | None = None) -> None:
    """The file is a prompt cache of this format version, and its contents
    are those it was saved with (signed with ``key``, when one is given)."""
    check_format(path, fields)
    keyed = fields.get("keyed") == KEYED
    if keyed and key is None:
        raise ValueError(f"{path} was signed with a key: give load_prompt_cache(..., key=) the key it was saved with")
    if key is not None and not keyed:
        raise ValueError(f"{path} is not signed, and a key was given: save it again with save_prompt_cache(..., "
                         f"key=) to load it across a trust boundary")
    if not hmac.compare_digest(str(fields.get("checksum", "")), checksum(fields, tensors, key)):
        if keyed:
            raise ValueError(f"{path} does not match the signature made with the key: changed since it was signed, "
                             f"or signed with another key")
        raise ValueError(f"{path} is corrupt: its contents do not match the checksum saved with them (changed or "
                         f"damaged since it was written); save it again")


class Saved(NamedTuple):
    """What a file's fields say it holds, checked."""

    tokens: list
    anchor: int
    length: int
    capacity: int


def whole_number(path: Path, fields: dict, name: str) -> int:
    value = fields[name]
    if not (isinstance(value, str) and value.lstrip("-").isdigit() and len(value) < 20):
        raise ValueError(f"{path}: its {name} {value!r} is not a whole number; save it again")
    return int(value)


def checked_fields(path: Path, fields: dict, vocab_size: int) -> Saved:
    """Every field a load reads, present and in range for a vocabulary of
    ``vocab_size``: a ``ValueError`` naming the first that is not."""
    missing = [name for name in REQUIRED if name not in fields]
    if missing:
        raise ValueError(f"{path} has no {missing[0]} among its fields: not a whole prompt-cache file; save it again")
    try:
        tokens = json.loads(fields["tokens"])
    except ValueError:
        tokens = None
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocab_size for t in tokens):
        raise ValueError(f"{path}: its tokens are not token ids of this vocabulary (0..{vocab_size - 1}); save it again")
    anchor = fields["anchor"]
    if not (anchor.isdigit() and len(anchor) < 20 and int(anchor) < vocab_size):
        raise ValueError(f"{path}: its anchor {anchor!r} is not a token id of this vocabulary (0..{vocab_size - 1}); "
                         f"save it again")
    length, capacity, rows = (whole_number(path, fields, name) for name in ("length", "capacity", "rows"))
    if rows != 1 or length != len(tokens):
        raise ValueError(f"{path} holds {rows} rows and its length {length} positions for {len(tokens)} tokens: a "
                         f"file holds one row, one position a token")
    if not 0 < capacity < LARGEST_CAPACITY or length > capacity:
        raise ValueError(f"{path}: its length {length} exceeds its capacity {capacity}, or the capacity is out of "
                         f"range; save it again")
    return Saved(tokens, int(anchor), length, capacity)


def check_pair(path: Path, fields: dict, here: dict) -> None:
    """The file was made with the target and draft whose ``pair_fields`` are
    ``here``, computing in their dtype (the fields computed once serve as
    many files as there are)."""
    if fields["dtype"] != here["dtype"]:
        raise ValueError(f"{path} holds a {fields['dtype']} cache and this target computes in {here['dtype']}: load "
                         f"the model in {fields['dtype']} (--dtype {fields['dtype']}), as when the file was saved, or "
                         f"save it again")
    for part in ("target", "draft"):
        if fields[part] != here[part]:
            raise ValueError(f"{path} was saved for another {part} ({fields[part + '_model']}, fingerprint "
                             f"{fields[part][:12]}) than this one ({here[part + '_model']}, fingerprint "
                             f"{here[part][:12]}): load the {part} it was saved with, or save it again with this one")


def check_layout(path: Path, expected: dict, tensors: dict) -> None:
    """The file's buffers are those this pair's cache has: the same names, shapes and dtypes."""
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        raise ValueError(f"{path} holds a cache of another layout ({len(tensors)} buffers, this pair's has "
                         f"{len(expected)}: {'no ' + missing[0] if missing else 'an extra ' + extra[0]}); save it "
                         f"again with this model")
    for name in sorted(expected):
        want, got = expected[name], tensors[name]
        if want.shape != got.shape or want.dtype != got.dtype:
            raise ValueError(f"{path} holds a cache of another layout: {name} is {tuple(got.shape)} "
                             f"{dtype_name(got.dtype)} there and {tuple(want.shape)} {dtype_name(want.dtype)} for "
                             f"this pair; save it again with this model")


def prompt_prefix(cache: Cache, held: list, prompt) -> Cache:
    """A loaded ``cache`` (holding the tokens ``held``) as the ``prefix`` of
    ``insert`` / ``Decoder.insert`` for ``prompt``: cut to the tokens the
    prompt shares with it, and to leave at least the prompt's last token to
    prefill (its logits choose the first new token). A cache with recurrent
    states holds them after all its tokens, so it serves only a prompt that
    starts with every one of them and goes on. Raises ``ValueError`` where
    the cache serves none of the prompt."""
    if isinstance(prompt, ImagePrompt):
        raise ValueError("a prompt with images cannot resume a prompt-cache file: the file holds token ids only")
    prompt = list(prompt)
    shared = next((i for i, (a, b) in enumerate(zip(held, prompt)) if a != b), min(len(held), len(prompt)))
    usable = min(shared, len(prompt) - 1)
    if cache.recurrent and usable < len(held):
        where = f"parts from them after {shared}" if shared < min(len(held), len(prompt)) else \
            f"has {len(prompt)} tokens"
        raise ValueError(f"the prompt-cache file holds recurrent states after all {len(held)} of its tokens, and the "
                         f"prompt {where}: a hybrid target resumes only a prompt that starts with every saved token "
                         f"and goes on past them; prefill this prompt afresh, or save a file for it")
    if usable < 1:
        raise ValueError("the prompt does not start with the prompt-cache file's first token: prefill it afresh")
    return cache._replace(length=mx.array([usable], mx.int32))
