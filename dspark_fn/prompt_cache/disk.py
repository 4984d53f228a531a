"""The prompt cache's disk tier: entries evicted from memory, and every
entry when the server stops, kept as prompt-cache files (``files``)
in one directory, so that a restarted server, or one whose memory budget
holds fewer conversations than it serves, still finds them.

Each file is one entry, saved with ``save_prompt_cache`` (written whole or
not at all: beside its name, flushed, renamed over it) and read back with
``load_prompt_cache``, whose checks (the pair's fingerprints and dtype, the
format version, every field, and a signature over every byte under the
directory's own key) refuse anything but what this directory's servers
saved for this pair: such a file is deleted, with a line on stderr, and
never used; nothing found in the directory stops the server. A file's name
is a digest of the pair (both fingerprints and the dtype) and then one of
its scope and tokens, so a server of another target, draft or dtype never
reads it, and the same tokens kept again in the same scope find their file.

The files hold clients' token ids, so the directory is made readable by
its owner alone (0700), its files too (0600), and the key that signs
them (``SECRET``, 32 random bytes made on first use) likewise; a lock
(``locked``: ``LOCK``, which the engine holds while it runs) keeps it to
one server at a time: a second one started on it is refused at once. An entry keeps its scope (``PrefixTrie``) in a signed
label, so a restarted server serves each file to the key that stored it
only.

What is on disk is known without reading any file's buffers: at start the
directory's files of this pair are indexed from their headers (the tokens
are in the metadata: ``files.read_fields``) into the same kind of
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

import fcntl
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
from ..types import Params
from .files import check_pair, load_prompt_cache, pair_fields, read_fields, save_prompt_cache
from .memory import Node, PrefixTrie, tokens_of

DEFAULT_BUDGET = 8 << 30  # bytes of files a directory holds unless told otherwise
PLACEHOLDER_ANCHOR = 0  # the anchor each file records: never read back (the module's docstring says why)
NAME = re.compile(r"[0-9a-f]{16}-[0-9a-f]{32}\.safetensors")  # the pair's digest, then the scope's and tokens'
PARTIAL = re.compile(r"[0-9a-f]{16}-[0-9a-f]{32}\.safetensors\..+" + re.escape(TEMPORARY))  # a write cut short
SECRET, LOCK = "secret", "lock"  # the key that signs the files; the lock one server holds
SCOPE_LABEL = "scope"


class Shelved(NamedTuple):
    """A file as the index holds it."""

    name: str
    size: int  # bytes of the file
    recurrent: bool  # its cache holds recurrent states: it serves only prompts that start with all its tokens
    scored = False  # a file holds no scores: no scored prompt reuses it


def pair_digest(pair: dict) -> str:
    """What names a pair's files: a digest of both models' fingerprints and
    the dtype (``files.pair_fields``)."""
    return hashlib.sha256(json.dumps([pair["target"], pair["draft"], pair["dtype"]]).encode()).hexdigest()[:16]


def file_name(pair: str, scope: str, tokens) -> str:
    """The file of the pair digested as ``pair`` holding ``tokens`` in ``scope``."""
    digest = hashlib.sha256(json.dumps([scope, [int(t) for t in tokens]]).encode()).hexdigest()[:32]
    return f"{pair}-{digest}.safetensors"


def private_directory(directory: Path) -> Path:
    """``directory``, made where missing, readable by its owner alone."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not directory.is_dir() or directory.is_symlink():
        raise ValueError(f"the prompt-cache directory {directory} is not a directory")
    os.chmod(directory, 0o700)
    return directory


def directory_key(directory: Path) -> bytes:
    """The key that signs the directory's files: read, or made (32 random
    bytes, a new file readable by its owner alone, never through a link)."""
    path = directory / SECRET
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        descriptor = None
    if descriptor is not None:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(os.urandom(32))
    descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(descriptor, "rb") as handle:
        key = handle.read(64)
    if len(key) != 32:
        raise ValueError(f"{path} is not the key this directory's files are signed with (32 bytes): delete it and "
                         f"the files it signed, or give another --prompt-cache-dir")
    return key


def locked(directory: Path):
    """The lock on ``directory``, held for this process's life (an open file);
    a ``ValueError`` naming the directory when another process holds it."""
    handle = open(os.open(directory / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600), "r+b")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        raise ValueError(f"another server uses the prompt-cache directory {directory}: give this one a "
                         f"--prompt-cache-dir of its own") from None
    return handle


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
        self.directory, self.params, self.budget = private_directory(Path(directory)), params, budget_bytes
        self.key = directory_key(self.directory)
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
                if PARTIAL.fullmatch(path.name):  # this server holds the lock: no other is writing it
                    path.unlink()
                elif NAME.fullmatch(path.name) and not path.is_symlink():
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
                tokens, scope = json.loads(fields["tokens"]), fields.get(f"label.{SCOPE_LABEL}", "")
                if not isinstance(tokens, list) or file_name(self.prefix, scope, tokens) != path.name:
                    raise ValueError(f"{path} holds other tokens than its name says")
                self._note(path.name, tuple(tokens), path.stat().st_size, scope)
            except OSError:
                continue
            except Exception as error:  # anything a planted file holds: never fatal, the file goes
                self._drop(path, error)

    def _note_other(self, path: Path) -> None:
        try:
            self.others[path.name] = path.stat().st_size
            self.other_bytes += self.others[path.name]
        except OSError:
            pass

    def _note(self, name: str, tokens: tuple, size: int, scope: str) -> None:
        """Index the file ``name`` holding ``tokens`` in ``scope``, the most recently used."""
        self.nodes[name] = self.index.put(tokens, Shelved(name, size, self.recurrent), scope)

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

    def keep(self, tokens: tuple, cache: Cache, size: int, scope: str = "") -> None:
        """Write ``cache`` (one row holding exactly ``tokens`` of ``scope``;
        ``size``: its buffers' bytes) to its file, then delete files past the
        budget. A file of the same tokens already there serves as well: it
        is only marked used. A failed write costs the entry, never the server."""
        if has_images(tokens) or size > self.budget:
            return  # a file holds token ids only, not an image's content hash; and one too big would empty the rest
        name = file_name(self.prefix, scope, tokens)
        if (node := self.nodes.get(name)) is not None:
            self._touch(node)
            return
        path = self.directory / name
        try:
            save_prompt_cache(path, self.params, cache, list(tokens), PLACEHOLDER_ANCHOR, key=self.key,
                              labels={SCOPE_LABEL: scope})
            self._stamp(path)
            written = path.stat().st_size
        except (OSError, ValueError, RuntimeError) as error:  # a full disk, say; RuntimeError: MLX's own
            log(f"{len(tokens)} tokens not written to {path.name}: {error}")
            return
        self._note(name, tuple(int(t) for t in tokens), written, scope)
        self._shrink()

    def longest(self, prompt: list, resumable=None, scope: str = "") -> tuple[int, Node | None]:
        """The longest prefix of ``prompt`` a file of ``scope`` can serve, and that file's node
        (``PrefixTrie.longest``)."""
        return self.index.longest(prompt, resumable, scope)

    def load(self, node: Node) -> Cache | None:
        """The cache in ``node``'s file, checked (``load_prompt_cache``: the
        pair, the format, the checksum; and the tokens the index holds it
        under), and the file marked used; None where it fails a check (the
        file is then deleted, said on stderr, and out of the index)."""
        tokens = tokens_of(node)
        path = self.directory / node.entry.name
        try:
            cache, held, _ = load_prompt_cache(path, self.params, key=self.key)
            if tuple(held) != tokens:
                raise ValueError(f"{path} holds other tokens than its name says")
        except Exception as error:  # whatever the file holds, it costs the entry, never the server
            self._forget(node)
            self._drop(path, error)
            return None
        self.hits += 1
        self._touch(node)
        return cache
