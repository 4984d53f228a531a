"""One speculative round as pure functions over fixed shapes, top to bottom:
draft, verify, accept, commit.

A round runs as two compiled kernels: the draft (one per model pair and
sampling mode) and the verify (one per pair, width and sampling mode). The
verify width is static, acceptance only changes array values (the new
``length``), and each row's proposal length is data (``limit``), so every
kernel compiles once per capacity bucket and switching among widths never
retraces. So is where a row's proposal comes from: the draft's, or a copy
of its own context (``Copies``, a point mass); a round of copies alone
skips the draft kernel. Prompts enter through ``prefilling.py``; the cache's
life between rounds is ``buffers.py``.

A constraint (a grammar the output must follow) enters both kernels as data:
bits of the tokens each position allows (``sampling.allowed_tokens``), all
ones for rows without one, so one kernel serves every grammar and rows with
and without constraints share a batch. The host builds them
(``constraints.py``): the verify's position ``j`` allows what the grammar
allows after the row's committed tokens and its first ``j`` proposals, so
every verified position reads the target's constrained distribution. The
draft's masks must be known before it runs, i.e. they cannot depend on the
tokens it drafts: slot ``k``'s distribution ``q_k`` is the draft's under
whatever mask slot ``k`` was given, and that same ``q_k`` is what the verify
divides by, so any such mask keeps rejection sampling exact (the host gives
the first slot the grammar's mask after the anchor and leaves the later
slots open; a later draft the grammar refuses is rejected, its probability
under the constrained target being 0).
"""

from functools import lru_cache

import mlx.core as mx
import numpy as np

from . import rng
from .accept import Verdict, accept
from .buffers import check_free_slots
from .cache import Cache, device_state, settle, write_tokens
from .drafts.heads import DRAFT_VOCAB_KEY, draft_chain
from .kernel import compiled
from .rng import uniforms
from .sampling import (GREEDY, Mode, RowSampling, allowed_tokens, batch_sampling, choose, log_probs, mask_bits,
                       token_log_probs)
from .types import Copies, DraftBlock, PairSpec, Params, Proposal, Round, TokenLogProbs

# ---- 1. draft: a block after each row's anchor, from the target's features in the draft's context


def draft_block(params: Params, cache: Cache, tokens: mx.array, sampling=GREEDY, masks=None) -> DraftBlock:
    """Draft a block after the anchors ``tokens [B]``: the Markov chain picks
    each slot by argmax, or draws it from the row's ``sampling`` distribution
    (one ``Sampling`` for all rows or one per row), among the tokens each
    slot's ``masks`` allow (bits ``[B, G, ceil(V/32)]``, default all). Runs
    eagerly and returns everything the pass computed; ``propose`` is the
    compiled round's draft."""
    masks = mask_bits(masks, (tokens.shape[0], params.spec.block_size), params.spec.target.vocab_size)
    return _draft(params, cache, tokens, *batch_sampling(sampling, tokens.shape[0]), masks)


def _draft(params: Params, cache: Cache, tokens: mx.array, rows: RowSampling, mode: Mode,
           masks: mx.array) -> DraftBlock:
    spec = params.spec
    batch = tokens.shape[0]
    mask = mx.full((batch, spec.block_size - 1), spec.draft.mask_token_id, tokens.dtype)
    block_ids = mx.concatenate([tokens[:, None], mask], axis=1)
    base, hidden = spec.draft_arch.block_forward(spec.draft, params.draft, cache.draft, cache.length, block_ids)
    vocab = params.draft.get(DRAFT_VOCAB_KEY)  # target id of each draft-vocabulary entry
    allowed = allowed_tokens(masks, spec.target.vocab_size)  # [B, G, V]
    if vocab is not None:  # a slot whose allowed tokens all lie outside the draft's vocabulary stays open
        allowed = allowed[..., vocab]
        allowed = allowed | ~allowed.any(axis=-1, keepdims=True)

    def pick(logits, slot):
        draws = uniforms(cache.seeds, cache.length, rng.DRAFT_SLOT + slot, logits.shape[1:]) if mode.sampled else None
        choice = choose(logits, rows, mode, draws, allowed[:, slot])
        return (choice if vocab is None else vocab[choice]).astype(tokens.dtype)

    drafted, logits, confidence = draft_chain(spec.draft, params.draft, base, hidden, tokens, pick)
    distribution = logits
    if mode.sampled:  # q: the distribution each slot was drawn from, under its mask
        distribution = log_probs(logits, rows, mode, allowed)
        if vocab is not None:  # no mass outside the draft vocabulary
            full = mx.full((*distribution.shape[:-1], spec.target.vocab_size), -mx.inf, distribution.dtype)
            full[..., vocab] = distribution
            distribution = full
    return DraftBlock(tokens=drafted, logits=logits, confidence_logits=confidence, base_logits=base, hidden=hidden,
                      log_probs=distribution)


# ---- 2. verify, accept, commit: the target over [anchor, proposals], the longest acceptable prefix kept


def verify_and_commit(params: Params, cache: Cache, block: mx.array, draft_log_probs: mx.array | None,
                      rows: RowSampling, mode: Mode, limit: mx.array | None = None,
                      active: mx.array | None = None,
                      allowed: mx.array | None = None) -> tuple[Cache, Verdict, mx.array]:
    """Run the target on ``block = [anchor, drafts...]``, accept, and commit.

    Every row's K/V and draft context are written; the new ``length`` keeps
    only the anchor and the accepted drafts, which is the whole rollback
    (recurrent layers settle on the state after those same tokens).
    ``limit [B]`` caps each row's accepted drafts; ``active [B]`` rows that
    are False commit nothing (a recurrent state settles on the one before
    the call); ``allowed [B, W, V]`` (default all) constrains each
    position's target distribution. Returns ``(cache, verdict, target
    logits [B, W, V])`` (the logits before the constraint).
    """
    spec = params.spec
    adapter = spec.target_adapter
    hidden, features, target_kv = adapter.forward(spec.target, params.target, cache.target, block, cache.length,
                                                  spec.taps)
    logits = adapter.logits(spec.target, params.target, hidden)
    width = block.shape[1]

    def draws():
        return (
            uniforms(cache.seeds, cache.length, rng.ACCEPT, (width - 1,)),
            uniforms(cache.seeds, cache.length, rng.CORRECTION, (logits.shape[-1],)),
        )

    verdict = accept(block, logits, draft_log_probs, rows, mode, draws, limit, allowed)
    if active is not None:  # rows that finished keep their anchor and emit nothing
        verdict = Verdict(
            accepted=mx.where(active, verdict.accepted, 0),
            next_tokens=mx.where(active, verdict.next_tokens, block[:, 0]),
            emitted=mx.where(active[:, None], verdict.emitted, -1),
        )
    draft_state = spec.draft_arch.extend_context(spec.draft, params.draft, cache.draft, features, cache.length)
    committed = verdict.accepted + 1 if active is None else mx.where(active, verdict.accepted + 1, 0)
    settled = Cache(target=settle(target_kv, committed), draft=draft_state, length=cache.length + committed,
                    seeds=cache.seeds, history=write_tokens(cache.history, block, cache.length))
    return settled, verdict, logits


def point_mass(tokens: mx.array, vocab_size: int) -> mx.array:
    """Log-probabilities ``[..., V]`` of proposals that are certain: 0 at each
    of ``tokens [...]``, -inf elsewhere. Rejection sampling then keeps a
    copied token with the target's probability of it and otherwise draws
    from the target without it (renormalised): exact, as for any draft."""
    return mx.where(mx.arange(vocab_size) == tokens[..., None], 0.0, -mx.inf)


# ---- 3. the two kernels


@lru_cache(maxsize=None)
def _draft_kernel(spec: PairSpec, mode: Mode):
    def draft_(target, draft, cache: Cache, tokens, rows: RowSampling, masks) -> Proposal:
        return _draft(Params(spec, target, draft), cache, tokens, rows, mode, masks).proposal()

    return compiled("draft", draft_)


@lru_cache(maxsize=None)
def _verify_kernel(spec: PairSpec, width: int, mode: Mode, top_log_probs: int | None = None):
    def verify_(target, draft, cache: Cache, tokens, drafts, draft_log_probs, copies: Copies, rows: RowSampling,
                limit, active, masks) -> tuple[Cache, Round]:
        proposed = mx.where(copies.rows[:, None], copies.tokens, drafts[:, : width - 1])
        block = mx.concatenate([tokens[:, None], proposed], axis=1)
        if mode.sampled:
            copied = point_mass(copies.tokens, spec.target.vocab_size)
            draft_log_probs = mx.where(copies.rows[:, None, None], copied, draft_log_probs[:, : width - 1])
        allowed = allowed_tokens(masks, spec.target.vocab_size)  # [B, W, V]: each position's constraint
        committed, verdict, logits = verify_and_commit(
            Params(spec, target, draft), cache, block, draft_log_probs, rows, mode, limit, active, allowed
        )
        scores = None
        if top_log_probs is not None:
            scores = TokenLogProbs(*token_log_probs(logits, verdict.emitted, rows, mode, top_log_probs, allowed))
        return committed, Round(emitted=verdict.emitted, count=committed.length - cache.length,
                                next_tokens=verdict.next_tokens, accepted=verdict.accepted, drafted=block[:, 1:],
                                scores=scores)

    return compiled("verify", verify_)


# ---- 4. the kernels as the API offers them (``policy.speculate`` chooses what they run)


def check_width(spec: PairSpec, width: int) -> None:
    if not 1 <= width <= spec.block_size + 1:
        raise ValueError(f"verify width {width} must be in 1..{spec.block_size + 1}")


def propose(params: Params, cache: Cache, tokens: mx.array, sampling=GREEDY, masks=None) -> Proposal:
    """The compiled draft: the ``Proposal`` of ``draft_block`` (``masks``:
    each slot's allowed tokens, ``[B, G, ceil(V/32)]`` bits, default all)."""
    rows, mode = batch_sampling(sampling, tokens.shape[0])
    masks = mask_bits(masks, (tokens.shape[0], params.spec.block_size), params.spec.target.vocab_size)
    return _draft_kernel(params.spec, mode)(params.target, params.draft, device_state(cache), tokens, rows, masks)


def no_proposal(batch_size: int) -> Proposal:
    """What a width-1 verify (the target alone) reads instead of a draft."""
    empty = mx.zeros((batch_size, 0))
    return Proposal(tokens=empty.astype(mx.int32), confidence_logits=empty, log_probs=empty[..., None])


def undrafted(params: Params, batch_size: int, mode: Mode) -> Proposal:
    """What a wider verify reads in a round without a draft pass (every row
    copies or verifies nothing): zeros shaped as the draft's proposal, so
    the round runs the same compiled kernel."""
    slots = params.spec.block_size
    log_probs = mx.zeros((batch_size, slots, params.spec.target.vocab_size) if mode.sampled else (0,))
    return Proposal(tokens=mx.zeros((batch_size, slots), mx.int32), confidence_logits=mx.zeros((batch_size, slots)),
                    log_probs=log_probs)


def verify(params: Params, cache: Cache, tokens: mx.array, proposal: Proposal, width: int, *, sampling=GREEDY,
           limit: mx.array | None = None, active: mx.array | None = None, copies: Copies | None = None,
           top_log_probs: int | None = None, check_room: bool = True, masks=None) -> tuple[Cache, Round]:
    """Verify ``width`` tokens (anchor + the first ``width - 1`` drafts of
    ``proposal``), accept at most ``limit[b]`` drafts per row, commit.
    ``copies`` (default none) gives rows their own proposals instead of
    the draft's, each a point mass (certain) under rejection sampling.
    ``masks`` (bits ``[B, width, ceil(V/32)]``, default all ones) constrain
    each verified position: position ``j`` allows the tokens a row's grammar
    allows after its anchor and its first ``j`` verified proposals
    (``constraints.verify_masks`` builds them); acceptance, the residual draw,
    the bonus token and ``scores`` all read the constrained distribution.
    ``top_log_probs`` (K, default none) fills the round's ``scores``: each
    emitted token's log-probability and the target's K most likely tokens at
    its position (``sampling.token_log_probs``), from the target logits the
    verify computed anyway.

    ``active`` (default all) marks the rows still generating; the others
    keep their state. Every row needs ``width`` free slots; a cache without
    them raises ``ValueError`` before anything runs (``grow_cache`` makes
    room). ``check_room=False`` skips that check (it reads the lengths from
    the device) for a caller that checked each row's room from the lengths
    it tracks, as the ``Decoder`` does.
    """
    check_width(params.spec, width)
    if check_room:
        check_free_slots(cache.capacity, np.array(cache.length), width)
    batch = tokens.shape[0]
    rows, mode = batch_sampling(sampling, batch)
    limit = mx.full((batch,), width - 1, mx.int32) if limit is None else limit
    active = mx.ones((batch,), mx.bool_) if active is None else active
    if copies is None:
        copies = Copies(tokens=mx.zeros((batch, width - 1), mx.int32), rows=mx.zeros((batch,), mx.bool_))
    # Greedy rules never read the draft's distribution: a fixed stand-in keeps
    # one kernel whatever proposed (the draft's logits, or no draft at all).
    draft_log_probs = proposal.log_probs if mode.sampled else mx.zeros((0,))
    masks = mask_bits(masks, (batch, width), params.spec.target.vocab_size)
    kernel = _verify_kernel(params.spec, width, mode, top_log_probs)
    committed, result = kernel(params.target, params.draft, device_state(cache), tokens,
                               proposal.tokens.astype(mx.int32), draft_log_probs,
                               copies._replace(tokens=copies.tokens.astype(mx.int32)), rows, limit, active, masks)
    return committed._replace(policy=cache.policy), result


def verify_block(params: Params, cache: Cache, block: mx.array, *, draft_log_probs: mx.array | None = None,
                 sampling=GREEDY, masks=None) -> tuple[Cache, Round]:
    """Verify a caller-chosen ``block [B, W] = [anchor, proposals...]`` and commit.

    The same verify/accept/commit as ``speculate``, for proposals that do not
    come from the draft (replays, tests, external drafters). Sampling needs
    the proposals' distribution ``draft_log_probs [B, W - 1, V]``. ``masks``
    (bits ``[B, W, ceil(V/32)]``) constrain the verified positions (``verify``).
    """
    batch, width = block.shape
    if draft_log_probs is None:
        if batch_sampling(sampling, batch).mode.sampled:
            raise ValueError("rejection sampling needs draft_log_probs, the distribution the proposals came from")
        draft_log_probs = mx.zeros((batch, width - 1, params.spec.target.vocab_size))
    proposal = Proposal(tokens=block[:, 1:], confidence_logits=mx.zeros((batch, width - 1)), log_probs=draft_log_probs)
    return verify(params, cache, block[:, 0], proposal, width, sampling=sampling, masks=masks)
