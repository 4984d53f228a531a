"""The driver: sequences that enter and leave a batch between rounds
(``Decoder``) and the generation loop over it (``generate``).

A caller hands the decoder prompts with tags (``insert``) and reads steps:
each step's tokens by tag, and for each sequence that ended, one record
(``types.Ended``: its tokens, why it ended, its acceptance tally and, when
asked, its cache cut to its tokens), given back as its row is freed. Rows
are the decoder's own: it picks a free row for each new sequence and moves
the sequences when the batch is resized, so no caller keeps a row map.

A sequence's ``Row`` holds its sampling settings, its committed length, its
budget and stop tokens, whether it asked for log-probabilities, its
constraint's matcher and what it emitted so far. Every step cuts
each sequence's tokens by its own rule (``Row.cut``) and says which ended
and why (``Step.finished``); none of ``generate``, the server's engine, the
trainer's answering or the command line cuts tokens or counts a budget of
its own. A round is ``policy.speculate`` over the decoder's cache: what it
proposes, from which source and how wide it verifies is the cache's
policy's to choose, as in a loop of one's own; the decoder adds batching,
admission and the rows' rules.

A sequence under a constraint (``insert(..., constraints=...)``: a compiled
``constraints.Grammar``) owns a ``Matcher`` that has followed every token it
emitted, its anchor included. The decoder builds the masks each kernel
reads from the matchers (its first token's, the verify's along each row's
proposal, the draft's first slot: a batch with a constrained row drafts
after its matchers have followed the last round, never ahead), advances each matcher by the tokens its row
committed; the tokens the grammar forces next are a point source's offer
(``sources.ForcedTokens``, handed the matchers each round). A sequence ends with "stop"
at the grammar's end-of-sequence token (added to its stop tokens) and with
"dead_end" where its grammar admits no token at all: its output is cut
before any token the grammar refuses, so none is ever reported.
"""

import dataclasses
import itertools
from typing import Hashable, Iterator, NamedTuple, Sequence

import mlx.core as mx
import numpy as np

from functools import partial

from .buffers import capacity_for, check_writes, free_row, grow_cache, init_cache, row_cache, take_rows
from .cache import Cache, is_recurrent
from .constraints import Grammar, Matcher, draft_masks, next_masks, verify_masks
from .policy import Policy, speculate
from .prefilling import as_rows, insert, prefill
from .sampling import GREEDY, Sampling, batch_sampling
from .schedule import CostCurve, Settings
from .sources import ForcedTokens, PointSource
from .stats import Tally
from .types import Ended, Event, Params, Round, Step, TokenLogProbs, TokenScore, prompt_key

TOP_LOG_PROBS = 20  # the most likely tokens a round scores when a row asks for log-probabilities (OpenAI's limit)


@dataclasses.dataclass
class Row:
    """One sequence of a batch, from the prefill that brings it in to its end."""

    tag: Hashable
    prompt: list  # its ids (``prompt_key``: an image token paired with its image's content hash)
    sampling: Sampling
    committed: int  # positions its cache row holds
    budget: int | None = None  # tokens it may still emit (None: until released)
    stop_tokens: frozenset = frozenset()  # a token that ends it (kept)
    scoring: int | None = None  # most likely alternatives to list with each token's log-probability, or None
    matcher: Matcher | None = None  # its constraint's state after every token it emitted, when it has one
    keep_cache: bool = False  # give its cache back when it ends
    finish: str | None = None  # "stop", "length", "dead_end" or "cancelled" once it ended
    tokens: list = dataclasses.field(default_factory=list)  # what it emitted so far
    tally: Tally = dataclasses.field(default_factory=Tally)  # its rounds' acceptance

    def cut(self, tokens: list) -> list:
        """Its share of ``tokens``: up to its first stop token (kept) and its
        budget, and before any token its grammar refuses (then it ends with
        "dead_end"; its matcher follows the rest; a grammar that admits no
        token after them ends it "dead_end" too); counts them against the
        budget, notes why it ended and keeps them."""
        kept = tokens if self.budget is None else tokens[: self.budget]
        stop = next((i for i, token in enumerate(kept) if token in self.stop_tokens), None)
        if stop is not None:
            kept, self.finish = kept[: stop + 1], "stop"
        if self.matcher is not None:
            allowed = self.matcher.commit(kept)
            if allowed < len(kept) or (self.finish is None and self.matcher.stuck()):
                kept, self.finish = kept[:allowed], "dead_end"
        if self.budget is not None:
            self.budget -= len(kept)
            if self.finish is None and self.budget <= 0:
                self.finish = "length"
        self.tokens += kept
        return kept

    def advance(self, committed: list, accepted: int, drafted: list, source: str) -> list:
        """A round's share (``cut``), tallied with what it verified."""
        kept = self.cut(committed)
        self.tally.add(len(kept), accepted, len(drafted), source)
        return kept


class Before(NamedTuple):
    """A round's starting point, for a sequence that ends in it and gives its cache back."""

    committed: np.ndarray  # [B] each row's committed positions
    states: list  # per target layer: a recurrent layer's entry (every row), else None


def round_width(width, block_size: int) -> int | None:
    """The rounds' width setting from ``generate``'s: "auto" -> None (chosen
    each round), None -> the whole block, an int as it is."""
    if width == "auto":
        return None
    if width is None:
        return block_size + 1
    if not isinstance(width, int) or isinstance(width, bool):
        raise ValueError(f"verify width must be an integer, None or 'auto', got {width!r}")
    return width


def _initial_capacity(rows: list, max_new_tokens: int, widest: int, capacity: int) -> None:
    """A fixed ``capacity`` must hold the whole generation."""
    longest = max(len(r) for r in rows)
    if longest + max_new_tokens + widest > capacity:
        raise ValueError(
            f"prompt of {longest} tokens + {max_new_tokens} new tokens + verify width "
            f"{widest} exceeds the cache capacity {capacity}"
        )


def token_scores(scored: TokenLogProbs, rows: list, counts: list, tops: list) -> list:
    """Per row of ``rows``: its first ``counts[i]`` scored tokens (a ``TokenScore``
    each, with ``tops[i]`` most likely alternatives), or None where ``tops[i]`` is."""
    values, ids, top_values = (np.array(a) for a in scored)
    return [
        None if top is None else [
            TokenScore(float(value), list(zip(i[:top].tolist(), v[:top].tolist())))
            for value, i, v in zip(values[row, :count], ids[row, :count], top_values[row, :count])
        ]
        for row, count, top in zip(rows, counts, tops)
    ]


def matchers_for(constraints, count: int, vocab_size: int) -> list:
    """A fresh matcher (or None) for each of ``count`` new sequences."""
    grammars = [constraints] * count if constraints is None or isinstance(constraints, Grammar) else list(constraints)
    if len(grammars) != count or not all(g is None or isinstance(g, Grammar) for g in grammars):
        raise ValueError(f"constraints for {count} sequences: one compiled Grammar (constraints.compile_constraint) "
                         f"or None, or one of either per sequence")
    for grammar in grammars:
        if grammar is not None and grammar.vocabulary.size != vocab_size:
            raise ValueError(f"a grammar compiled for a vocabulary of {grammar.vocabulary.size} tokens constrains "
                             f"a model of {vocab_size}: compile it with Vocabulary(tokenizer, {vocab_size})")
    return [None if grammar is None else grammar.matcher() for grammar in grammars]


def first_masks(matchers: list, vocab_size: int) -> np.ndarray | None:
    """Bits of the first tokens new sequences may take (None when none of them has a constraint)."""
    return next_masks(matchers, vocab_size) if any(matchers) else None


def under_constraints(params: Params, matchers: list) -> dict:
    """What a round of rows with these matchers (None: no constraint) passes
    to ``speculate``: nothing without a constraint; else the draft's masks
    (its first slot under each grammar), the verify's masks along each
    row's proposal, and the grammars' forced tokens as a point source."""
    if not any(matchers):
        return {}
    spec = params.spec
    return {"draft_masks": draft_masks(matchers, spec.block_size, spec.target.vocab_size),
            "masks": partial(verify_masks, matchers, vocab_size=spec.target.vocab_size),
            "sources": (ForcedTokens(matchers),)}


def checked_tags(tags: list, count: int, running: set) -> list:
    """``count`` distinct tags that no running sequence has."""
    if len(tags) != count or len(set(tags)) != count or running & set(tags):
        raise ValueError(f"{count} sequences need {count} distinct tags that no running sequence has, got {tags}")
    return tags


def round_start(cache: Cache, rows: list, committed: np.ndarray) -> Before | None:
    """The committed counts and recurrent states before this round, when
    the target keeps recurrent states and a sequence gives its cache
    back (references, no copies)."""
    if not cache.recurrent or not any(row.keep_cache for row in rows if row is not None):
        return None
    return Before(committed, [entry if is_recurrent(entry) else None for entry in cache.target])


def kept_cache(cache: Cache, row: int, entry: Row, before: Before | None) -> Cache:
    """The row's cache cut to the sequence's tokens. Attention slots serve
    any shorter prefix, but a recurrent state holds only after every
    committed token: a round that committed past the sequence's end
    (drafts accepted beyond its stop token or budget) gives back the
    states from before that round, at the length they were taken."""
    context = len(entry.prompt) + len(entry.tokens)
    if before is not None and entry.committed > context:
        return row_cache(cache, row, int(before.committed[row]), before.states)
    return row_cache(cache, row, min(entry.committed, context))


def with_room(params: Params, cache: Cache, committed: np.ndarray, live: np.ndarray, width: int,
              growing: bool) -> Cache:
    """``cache`` with ``width`` free slots for every live row (grown; a
    fixed one refuses), every row's write checked on the host."""
    slots = int(committed[live].max()) + width
    if slots > cache.capacity:
        if not growing:
            raise ValueError(f"{slots} positions exceed the fixed cache capacity {cache.capacity}")
        cache = grow_cache(params, cache, capacity_for(slots))
    check_writes(committed, width, cache.capacity, f"a verify of width {width}")
    return cache


def check_lengths(cache: Cache, counted: np.ndarray) -> None:
    """The host plans every write from the rows' committed counts: each
    must be the cache's own length (a row longer on the device than
    counted would be written past the slots made for it)."""
    lengths = np.array(cache.length)
    wrong = np.flatnonzero(lengths != counted)
    if wrong.size:
        row = int(wrong[0])
        raise ValueError(
            f"cache row {row} holds length {lengths[row]} but the decoder counts {counted[row]} "
            f"committed positions (capacity {cache.capacity})"
        )


class Decoder:
    """The driver between rounds: a batch of ``batch`` rows, each holding a
    sequence that enters with ``insert`` (or a whole batch at once with
    ``start``), advances one round per ``step`` until its stop token or
    budget (or ``release``), and leaves as an ``Ended`` record. The cache
    grows in ``capacity_for`` buckets unless fixed.

    A round is ``policy.speculate`` over the decoder's cache, whose policy
    chooses it (``Policy``). ``sources``: point sources proposing beside
    the draft and the built-in copies (``sources.PointSource``, e.g. a
    store's answers); the tokens a constrained row's grammar forces are one
    more. ``width`` ("auto": chosen each round; an int: fixed; None: the
    whole block), ``proposals`` ("auto", "draft" or "copy": the point
    sources alone) and ``confidence_threshold`` are the rounds' settings
    (``schedule.Settings``); ``costs`` fixes the round costs the policy
    plans with, a ``CostCurve`` or ``"prior"`` (default: learned as rounds
    run, ``costs.RoundCosts``)."""

    def __init__(self, params: Params, batch: int, *, width="auto", capacity: int | None = None,
                 confidence_threshold: float = 0.0, costs: CostCurve | str | None = None, seed: int = 0,
                 proposals: str = "auto", sources: Sequence[PointSource] | None = None):
        self.params = params
        self.settings = Settings(params.spec.block_size, round_width(width, params.spec.block_size), proposals,
                                 confidence_threshold).checked()
        self.sources = tuple(sources or ())
        self.growing = capacity is None
        self.cache = init_cache(params, batch, capacity or capacity_for(1), seed)._replace(
            policy=Policy.start(params, batch, costs))
        self.rows: list[Row | None] = [None] * batch  # None: a free row
        self.tokens = mx.zeros((batch,), mx.int32)  # each row's anchor
        self._sampling = batch_sampling(GREEDY, batch)
        self._tags = itertools.count()  # tags handed out when the caller gives none

    @property
    def batch(self) -> int:
        return len(self.rows)

    @property
    def widest(self) -> int:
        """The widest verify a round may run (anchor included)."""
        return self.settings.max_width

    @property
    def live(self) -> np.ndarray:
        """``[B]`` the rows holding a sequence."""
        return np.array([row is not None for row in self.rows])

    @property
    def busy(self) -> bool:
        """Whether a sequence is still generating (another ``step`` has work)."""
        return bool(self.live.any())

    @property
    def free(self) -> int:
        """How many more sequences ``insert`` takes now."""
        return self.rows.count(None)

    @property
    def committed(self) -> np.ndarray:
        """``[B]`` the positions each row's cache holds (0 for a free row)."""
        return np.array([row.committed if row is not None else 0 for row in self.rows])

    def forget(self) -> None:
        """Forget what the rounds measured of the proposals (the learned costs
        stay): a sequence that runs alone from here follows the decisions a
        fresh decoder would, so with fixed costs its seeded samples repeat."""
        self.cache = self.cache._replace(policy=self.cache.policy.forgetting())

    # ---- sequences in

    def start(self, prompts: list, sampling=GREEDY, *, tags: Sequence[Hashable] | None = None,
              max_new_tokens: int | None = None, stop_tokens: Sequence[int] = (), constraints=None) -> Step:
        """Prefill a whole batch of sequences at once (batched) into the
        empty decoder, one a row, each with its budget of ``max_new_tokens``
        (default: none), ``stop_tokens`` and ``constraints`` (see
        ``insert``), tagged ``tags`` (default: the decoder hands out 0, 1,
        ...); returns the step of their first tokens."""
        if self.live.any():
            raise ValueError("start fills an empty decoder; insert adds sequences to a running one")
        matchers = matchers_for(constraints, len(prompts), self.params.spec.target.vocab_size)
        settings = [sampling] * self.batch if isinstance(sampling, Sampling) else list(sampling)
        self.cache, self.tokens = prefill(self.params, self.cache, prompts, sampling=settings, grow=self.growing,
                                          masks=first_masks(matchers, self.params.spec.target.vocab_size))
        self._sampling = batch_sampling(settings, self.batch)
        rows = range(self.batch)
        return self._enter(rows, tags, prompts, settings, self.tokens.tolist(), None, matchers=matchers,
                           max_new_tokens=max_new_tokens, stop_tokens=stop_tokens, top_log_probs=None,
                           keep_cache=False)

    def insert(self, prompts: list, *, tags: Sequence[Hashable] | None = None, sampling=GREEDY,
               seeds: Sequence[int] = (), prefix: Cache | None = None, top_log_probs: int | None = None,
               max_new_tokens: int | None = None, stop_tokens: Sequence[int] = (), keep_cache: bool = False,
               constraints=None) -> Step:
        """New sequences between rounds, in free rows the decoder picks
        (prefilled together; a prompt is a token list or an ``ImagePrompt``,
        a prompt with images), tagged ``tags`` (default: handed out), each
        with its budget of ``max_new_tokens`` (default: none) and
        ``stop_tokens``; returns the step of their first tokens.
        ``sampling`` and ``seeds``: one setting for all or one each;
        ``prefix``: see ``prefilling.insert``. With ``top_log_probs``
        (0..20) these sequences' tokens are scored (``Step.log_probs``); with
        ``keep_cache`` each gives its cache back when it ends
        (``Ended.cache``). ``constraints``: a compiled ``Grammar`` every new
        sequence's output must match, or one ``Grammar`` or None per
        sequence (default: none); each sequence takes its own matcher, and
        the grammar's end-of-sequence tokens join its stop tokens."""
        rows = [row for row, entry in enumerate(self.rows) if entry is None][: len(prompts)]
        if len(rows) < len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(rows)} free row(s) in the batch of {self.batch}: "
                             f"resize the batch first")
        vocab_size = self.params.spec.target.vocab_size
        matchers = matchers_for(constraints, len(prompts), vocab_size)
        settings = [sampling] * len(rows) if isinstance(sampling, Sampling) else list(sampling)
        self.cache, tokens, *scored = insert(
            self.params, self.cache, rows, prompts, sampling=settings, seeds=seeds, prefix=prefix, grow=self.growing,
            top_log_probs=None if top_log_probs is None else TOP_LOG_PROBS, masks=first_masks(matchers, vocab_size),
        )
        self.tokens[mx.array(rows)] = tokens
        first = tokens.tolist()
        scores = None
        if top_log_probs is not None:
            one = TokenLogProbs(*(a[:, None] for a in scored[0]))  # one position a row
            scores = token_scores(one, list(range(len(rows))), [1] * len(rows), [top_log_probs] * len(rows))
        return self._enter(rows, tags, prompts, settings, first, scores, matchers=matchers,
                           max_new_tokens=max_new_tokens, stop_tokens=stop_tokens, top_log_probs=top_log_probs,
                           keep_cache=keep_cache)

    def _enter(self, rows: Sequence[int], tags, prompts: list, settings: list, first: list, scores: list | None, *,
               matchers: list, max_new_tokens: int | None, stop_tokens, top_log_probs: int | None,
               keep_cache: bool) -> Step:
        """The sequences just prefilled into ``rows`` take their rows; the step of their first tokens."""
        running = {row.tag for row in self.rows if row is not None}
        tags = checked_tags([next(self._tags) for _ in rows] if tags is None else list(tags), len(rows), running)
        for row, tag, prompt, setting, token, matcher in zip(rows, tags, prompts, settings, first, matchers):
            ends = frozenset() if matcher is None else frozenset(matcher.grammar.vocabulary.eos)
            self.rows[row] = Row(tag=tag, prompt=prompt_key(prompt), sampling=setting, committed=len(prompt),
                                 budget=max_new_tokens, stop_tokens=frozenset(stop_tokens) | ends,
                                 scoring=top_log_probs, keep_cache=keep_cache, matcher=matcher)
        self._sampling = batch_sampling([row.sampling if row else GREEDY for row in self.rows], self.batch)
        entered = [self.rows[row] for row in rows]
        emitted = [entry.cut([token]) for entry, token in zip(entered, first)]
        return Step(kind="prefill", tags=tags, emitted=emitted, accepted=[0] * len(entered),
                    drafted=[[] for _ in entered], width=0, sources=[""] * len(entered),
                    finished=[entry.finish for entry in entered], log_probs=scores,
                    ended=[self._end(row) for row in rows if self.rows[row].finish is not None])

    # ---- one round

    def step(self) -> Step:
        """One round over the live sequences (``policy.speculate``: the
        cache's policy chooses the proposals and the width), after making
        room; then each sequence's tokens cut by its own rule, and the
        sequences that finished ended (``Step.ended``; their rows take the
        next ``insert``). Rows under a constraint draft after their matchers
        have followed the last round, under their grammars' masks, and
        verify under them."""
        live = self.live
        if not live.any():
            raise ValueError("no sequence is generating: insert a prompt first")
        self.cache = with_room(self.params, self.cache, self.committed, live, self.widest, self.growing)
        before = round_start(self.cache, self.rows, self.committed)
        constrained = under_constraints(self.params, [row.matcher if row is not None else None for row in self.rows])
        self.cache, result = speculate(
            self.params, self.cache, self.tokens, width=self.settings.width, sampling=self._sampling,
            active=mx.array(live), proposals=self.settings.proposals, threshold=self.settings.threshold,
            sources=self.sources + constrained.pop("sources", ()), **constrained,
            top_log_probs=TOP_LOG_PROBS if any(row.scoring is not None for row in self.rows if row) else None,
        )
        self.tokens = result.next_tokens
        counts, accepted = result.count.tolist(), result.accepted.tolist()
        committed = [tokens[:count] for tokens, count in zip(result.emitted.tolist(), counts)]
        for row, tokens in zip(self.rows, committed):
            if row is not None:
                row.committed += len(tokens)
        check_lengths(self.cache, self.committed)
        return self._cut(result, committed, accepted, before)

    def _cut(self, result: Round, committed: list, accepted: list, before: Before | None) -> Step:
        """The round's step: each sequence's committed tokens cut by its own
        rule, then the records of those that ended."""
        rows = [row for row, entry in enumerate(self.rows) if entry is not None]
        drafted = result.drafted.tolist()
        proposed = [drafted[row][: result.limits[row]] for row in rows]
        sources = [result.sources[row] for row in rows]
        entries = [self.rows[row] for row in rows]
        emitted = [entry.advance(committed[row], accepted[row], verified, source)
                   for entry, row, verified, source in zip(entries, rows, proposed, sources)]
        scores = None
        if result.scores is not None:
            scores = token_scores(result.scores, rows, [len(committed[row]) for row in rows],
                                  [entry.scoring for entry in entries])
        return Step(kind="round", tags=[entry.tag for entry in entries], emitted=emitted,
                    accepted=[accepted[row] for row in rows], drafted=proposed, width=result.emitted.shape[1],
                    sources=sources, finished=[entry.finish for entry in entries], log_probs=scores,
                    ended=[self._end(row, before) for row in rows if self.rows[row].finish is not None])

    # ---- sequences out, and the batch between rounds

    def release(self, tag: Hashable) -> Ended:
        """End sequence ``tag`` now ("cancelled"): its record, its row freed."""
        row = next((row for row, entry in enumerate(self.rows) if entry is not None and entry.tag == tag), None)
        if row is None:
            raise ValueError(f"no running sequence is tagged {tag!r}")
        self.rows[row].finish = "cancelled"
        return self._end(row)

    def _end(self, row: int, before: Before | None = None) -> Ended:
        """The record of the sequence in ``row``, which is then free (its point sources finish it)."""
        entry = self.rows[row]
        cache = kept_cache(self.cache, row, entry, before) if entry.keep_cache else None
        if entry.sampling.greedy and entry.finish in ("stop", "length"):  # the target's own habits, whole or cut
            for source in self.sources:
                source.learn(entry.tokens)
        self.rows[row] = None
        self.cache = free_row(self.cache, row)
        return Ended(entry.tag, entry.prompt, entry.tokens, entry.finish, entry.tally, cache)

    def resize(self, batch: int) -> None:
        """Move the live sequences into a batch of ``batch`` rows (with their
        rows' policy: measured rates and prepared proposals; the costs are
        learned per batch size). Kernels are per batch size, so a server
        runs only as many rows as it has requests (each size compiles once)."""
        live = np.flatnonzero(self.live).tolist()
        if len(live) > batch:
            raise ValueError(f"{len(live)} active rows do not fit in a batch of {batch}")
        self.cache, self.tokens = take_rows(self.cache, live, batch), take_rows(self.tokens, live, batch)
        self.rows = [self.rows[row] for row in live] + [None] * (batch - len(live))
        self._sampling = batch_sampling([row.sampling if row else GREEDY for row in self.rows], batch)
        check_lengths(self.cache, self.committed)


def generate(
    params: Params,
    prompt,
    max_new_tokens: int,
    *,
    width: int | str | None = "auto",
    stop_tokens: Sequence[int] = (),
    capacity: int | None = None,
    sampling=GREEDY,
    seed: int = 0,
    confidence_threshold: float = 0.0,
    costs: CostCurve | str | None = None,
    proposals: str = "auto",
    constraint=None,
    prefix: Cache | None = None,
    sources: Sequence[PointSource] | None = None,
) -> Iterator[Event]:
    """DSpark generation for one prompt or a batch of prompts (a list of
    token lists; a prompt with images is an ``ImagePrompt``, from
    ``vision.image_prompt``), one ``Event`` per sequence per step, tagged
    with its prompt's index.

    ``width``: "auto" (default: draft only when the measured acceptance and
    costs say it pays, then Algorithm 1 picks the length), an int (fixed) or
    None (block size + 1); with ``confidence_threshold`` each row's draft
    ends at its first slot with a lower confidence. ``proposals``: where
    rows' proposals come from, "auto" (default: under the "auto" width, per
    row and round the draft or a copy of an earlier stretch of the row's
    context, whichever is expected to pay more), "draft" or "copy" (see
    ``schedule.Settings``); ``sources``: point sources proposing beside the
    draft and the copies (``sources.PointSource``, e.g. a store's answers);
    ``costs`` fixes the round costs: a ``CostCurve``, or ``"prior"`` (the
    pair's shape alone: the same decisions on every run and machine, so
    seeded samples repeat); default: learned as rounds run, whose choices
    near a tie follow the machine's timing.
    ``sampling`` is one ``Sampling`` for every row or one per row; row b draws with its own
    seed (derived from ``seed`` and b). Greedy output equals greedy decoding
    of the target alone, row by row; sampled output is distributed as
    sampling the target alone. Sequences that finish stop emitting while
    the others go on. ``capacity`` fixes the cache size; by default the cache
    grows in ``capacity_for`` buckets with the context. ``constraint``: a
    compiled ``constraints.Grammar`` every output must match, or one
    ``Grammar`` or None per prompt (``Decoder.insert``); a constrained
    sequence ends at its grammar's end-of-sequence token ("stop") or where
    its grammar admits no token ("dead_end"), and its greedy output equals
    the target's greedy decoding under the same grammar. ``prefix``: a
    one-row cache holding the first tokens of the one prompt (a prompt-cache
    file's, ``prompt_cache.files.prompt_prefix``): only the rest is prefilled, and
    the row draws with ``seed`` itself.
    """
    rows = as_rows(prompt)
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be at least 1")
    decoder = Decoder(
        params, len(rows), width=width, capacity=capacity, confidence_threshold=confidence_threshold, costs=costs,
        seed=seed, proposals=proposals, sources=sources,
    )
    if capacity is not None:
        _initial_capacity(rows, max_new_tokens, decoder.widest, capacity)
    if prefix is None:
        step = decoder.start(rows, sampling, tags=range(len(rows)), max_new_tokens=max_new_tokens,
                             stop_tokens=stop_tokens, constraints=constraint)
    elif len(rows) == 1:
        step = decoder.insert(rows, tags=[0], sampling=sampling, seeds=[seed], prefix=prefix,
                              max_new_tokens=max_new_tokens, stop_tokens=stop_tokens, constraints=constraint)
    else:
        raise ValueError(f"a prefix continues one prompt; {len(rows)} were given")
    yield from step.events()
    while decoder.busy:
        yield from decoder.step().events()
