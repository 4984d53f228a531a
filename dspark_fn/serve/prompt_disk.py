"""The prompt cache's disk tier: entries evicted from memory, and every
entry when the server stops, kept as prompt-cache files (``prompt_files``)
in one directory, so that a restarted server, or one whose memory budget
holds fewer conversations than it serves, still finds them.

Each file is one entry, saved with ``save_prompt_cache`` (written whole or
not at all: beside its name, flushed, renamed over it) and read back with
``load_prompt_cache``, whose checks (the pair's fingerprints and dtype, the
format version, a checksum over every byte) refuse anything but what was
saved for this pair: such a file is deleted, with a line on stderr, and
never used. A file's name is a digest of the pair (both fingerprints and
the dtype) and then one of its tokens, so a server of another target, draft
or dtype never reads it, and the same tokens kept again find their file.

What is on disk is known without reading any file's buffers: at start the
directory's files of this pair are indexed from their headers (the tokens
are in the metadata: ``prompt_files.read_fields``) into the same kind of
trie the memory uses (``prompt_cache.PrefixTrie``), so a lookup walks the
prompt once, whatever the number of files. Files are ordered by last use,
across restarts by their modification times (a file used is touched), and
past ``budget_bytes`` the least recently used go first, other pairs' files
before any of this pair's: this server cannot use those. A file written or
used is stamped with a time past every stamp before it (a filesystem's
clock may give two files written in a row the same time). The directory
belongs to one server at a time; servers of several pairs may take turns.

A file records its anchor (the first token chosen after its tokens) as 0,
in place of one the server never knows: a reused prefix always leaves the
prompt's last token to prefill (``PromptCache.lookup``), whose logits choose
the first new token, so the anchor is never read back. Given to ``dspark
generate --prompt-cache`` such a file serves as any other (the same rule
applies there); ``speculate`` from its anchor would not continue the prompt.
"""

import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import NamedTuple

from ..atomic import TEMPORARY
from ..buffers import holds_recurrent_states
from ..cache import Cache
from ..prompt_files import check_pair, load_prompt_cache, pair_fields, read_fields, save_prompt_cache
from ..types import Params
from .prompt_cache import Node, PrefixTrie, tokens_of

DEFAULT_BUDGET = 8 << 30  # bytes of files a directory holds unless told otherwise
PLACEHOLDER_ANCHOR = 0  # the anchor each file records: never read back (the module's docstring says why)
NAME = re.compile(r"[0-9a-f]{16}-[0-9a-f]{32}\.safetensors")  # the pair's digest, then the tokens'


class Shelved(NamedTuple):
    """A file as the index holds it."""

    name: str
    size: int  # bytes of the file
    recurrent: bool  # its cache holds recurrent states: it serves only prompts that start with all its tokens
    scored = False  # a file holds no scores: no scored prompt reuses it


def pair_digest(pair: dict) -> str:
    """What names a pair's files: a digest of both models' fingerprints and
    the dtype (``prompt_files.pair_fields``)."""
    return hashlib.sha256(json.dumps([pair["target"], pair["draft"], pair["dtype"]]).encode()).hexdigest()[:16]


def file_name(pair: str, tokens) -> str:
    """The file of the pair digested as ``pair`` holding ``tokens``."""
    return f"{pair}-{hashlib.sha256(json.dumps([int(t) for t in tokens]).encode()).hexdigest()[:32]}.safetensors"


def has_images(tokens) -> bool:
    """A ``prompt_key`` with image tokens: each is a pair (id, the image's content hash)."""
    return any(isinstance(token, tuple) for token in tokens)


def log(message: str) -> None:
    print(f"dspark: prompt cache on disk: {message}", file=sys.stderr, flush=True)


class DiskTier:
    """The prompt-cache files of ``params``'s pair in ``directory`` (made
    where missing), at most ``budget_bytes`` of files there in all. Used by
    one thread, the engine's, after it is built."""

    def __init__(self, directory, params: Params, budget_bytes: int = DEFAULT_BUDGET):
        if budget_bytes < 0:
            raise ValueError(f"a prompt-cache directory's budget is a number of bytes, 0 or more, not {budget_bytes}")
        self.directory, self.params, self.budget = Path(directory), params, budget_bytes
        self.directory.mkdir(parents=True, exist_ok=True)
        self.pair = pair_fields(params)
        self.prefix = pair_digest(self.pair)
        self.recurrent = holds_recurrent_states(params)
        self.index = PrefixTrie()  # this pair's files by their tokens
        self.nodes: dict[str, Node] = {}  # a file's name -> its node in the index
        self.others: dict[str, int] = {}  # other pairs' files -> their bytes, least recently used first
        self.other_bytes = 0
        self.hits = self.refused = 0  # files loaded; files deleted as unusable
        self.clock = time.time_ns()  # the last stamp given: the next is later (``_stamp``)
        self._scan()
        self._shrink()

    def __len__(self) -> int:
        return len(self.index)

    @property
    def used(self) -> int:
        """Bytes of the files the budget counts: this pair's and the others'."""
        return self.index.used + self.other_bytes

    def stats(self) -> dict:
        return {"entries": len(self.index), "bytes": self.index.used,  # no path: /health answers without a key
                "other_pairs_bytes": self.other_bytes, "budget_bytes": self.budget, "hits": self.hits,
                "refused": self.refused}

    def _scan(self) -> None:
        """Index the directory: this pair's files from their headers, other
        pairs' by their size, all in their order of last use; delete what a
        write cut short (a process killed before its rename)."""
        found = []
        for path in self.directory.iterdir():
            try:
                if path.name.endswith(TEMPORARY) and NAME.fullmatch(path.name.removesuffix(TEMPORARY)):
                    path.unlink()
                elif NAME.fullmatch(path.name):
                    found.append((path.stat().st_mtime_ns, path))
            except OSError:  # gone meanwhile
                continue
        found.sort()
        self.clock = max([self.clock] + [stamp for stamp, _ in found])
        for _, path in found:
            if not path.name.startswith(self.prefix):
                self._note_other(path)
                continue
            try:
                fields = read_fields(path)
                check_pair(path, fields, self.pair)
                tokens = tuple(json.loads(fields["tokens"]))
                if file_name(self.prefix, tokens) != path.name:
                    raise ValueError(f"{path} holds other tokens than its name says")
                self._note(path.name, tokens, path.stat().st_size)
            except (ValueError, KeyError, TypeError) as error:
                self._drop(path, error)
            except OSError:
                continue

    def _note_other(self, path: Path) -> None:
        try:
            self.others[path.name] = path.stat().st_size
            self.other_bytes += self.others[path.name]
        except OSError:
            pass

    def _note(self, name: str, tokens: tuple, size: int) -> None:
        """Index the file ``name`` holding ``tokens``, the most recently used."""
        self.nodes[name] = self.index.put(tokens, Shelved(name, size, self.recurrent))

    def _forget(self, node: Node) -> Path:
        """Take ``node``'s file out of the index; its path."""
        name = node.entry.name
        del self.nodes[name]
        self.index.remove(node)
        return self.directory / name

    def _drop(self, path: Path, why) -> None:
        """Delete a file that failed its checks, saying so."""
        self.refused += 1
        log(f"deleted {path.name}, which cannot be used: {why}")
        path.unlink(missing_ok=True)

    def _touch(self, node: Node) -> None:
        """Mark ``node``'s file the most recently used, here and on disk (for the next start)."""
        self.index.lru.move_to_end(node)
        self._stamp(self.directory / node.entry.name)

    def _stamp(self, path: Path) -> None:
        """Set ``path``'s modification time past every one given before."""
        self.clock = max(time.time_ns(), self.clock + 1)
        try:
            os.utime(path, ns=(self.clock, self.clock))
        except OSError:
            pass  # gone: its load will say so

    def _shrink(self) -> None:
        """Delete files until those left fit the budget: other pairs' first,
        then this pair's least recently used."""
        while self.others and self.used > self.budget:
            name = next(iter(self.others))
            self.other_bytes -= self.others.pop(name)
            (self.directory / name).unlink(missing_ok=True)
        while self.index.lru and self.used > self.budget:
            self._forget(self.index.oldest()).unlink(missing_ok=True)

    def keep(self, tokens: tuple, cache: Cache, size: int) -> None:
        """Write ``cache`` (one row holding exactly ``tokens``; ``size``: its
        buffers' bytes) to its file, then delete files past the budget. A
        file of the same tokens already there serves as well: it is only
        marked used. A failed write costs the entry, never the server."""
        if has_images(tokens) or size > self.budget:
            return  # a file holds token ids only, not an image's content hash; and one too big would empty the rest
        name = file_name(self.prefix, tokens)
        if (node := self.nodes.get(name)) is not None:
            self._touch(node)
            return
        path = self.directory / name
        try:
            save_prompt_cache(path, self.params, cache, list(tokens), PLACEHOLDER_ANCHOR)
            self._stamp(path)
            written = path.stat().st_size
        except (OSError, ValueError, RuntimeError) as error:  # a full disk, say; RuntimeError: MLX's own
            log(f"{len(tokens)} tokens not written to {path.name}: {error}")
            path.with_name(name + TEMPORARY).unlink(missing_ok=True)
            return
        self._note(name, tuple(int(t) for t in tokens), written)
        self._shrink()

    def longest(self, prompt: list, resumable=None) -> tuple[int, Node | None]:
        """The longest prefix of ``prompt`` a file can serve, and that file's node (``PrefixTrie.longest``)."""
        return self.index.longest(prompt, resumable)

    def load(self, node: Node) -> Cache | None:
        """The cache in ``node``'s file, checked (``load_prompt_cache``: the
        pair, the format, the checksum; and the tokens the index holds it
        under), and the file marked used; None where it fails a check (the
        file is then deleted, said on stderr, and out of the index)."""
        tokens = tokens_of(node)
        path = self.directory / node.entry.name
        try:
            cache, held, _ = load_prompt_cache(path, self.params)
            if tuple(held) != tokens:
                raise ValueError(f"{path} holds other tokens than its name says")
        except (ValueError, KeyError, OSError) as error:
            self._forget(node)
            self._drop(path, error)
            return None
        self.hits += 1
        self._touch(node)
        return cache
