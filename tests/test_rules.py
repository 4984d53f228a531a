"""The leaf rules on small hand-computed cases, so a failure names the rule."""

import math

import mlx.core as mx
import numpy as np
import pytest

from dspark_fn import ops
from dspark_fn.cache import block_mask, causal_mask, prefix_mask, write_rows
from dspark_fn.rng import gumbel_argmax, row_seeds, uniforms, unit_interval
from dspark_fn.sampling import Mode, Sampling, batch_sampling, choose, log_probs
from dspark_fn.accept import accept_greedy, accept_sampled, correction, emitted_tokens, leading_run

V = 6


def one_hot_logits(rows):
    """``[1, W, V]`` logits whose argmax at row j is ``rows[j]``."""
    logits = np.zeros((1, len(rows), V), np.float32)
    for j, token in enumerate(rows):
        logits[0, j, token] = 5.0
    return mx.array(logits)


def test_leading_run():
    matches = mx.array([[True, True, False, True], [False, True, True, True], [True, True, True, True]])
    assert leading_run(matches).tolist() == [2, 0, 4]


def test_emitted_tokens():
    block = mx.array([[9, 1, 2, 3], [9, 1, 2, 3]])
    out = emitted_tokens(block, mx.array([2, 0]), mx.array([7, 8]))
    assert out.tolist() == [[1, 2, 7, -1], [8, -1, -1, -1]]


def test_accept_greedy_keeps_the_matching_prefix_then_the_argmax():
    # the target's argmax after [anchor, 1, 2, 3] is 1, 2, 5, 4: drafts 1, 2 kept, 3 rejected, 5 emitted
    block = mx.array([[0, 1, 2, 3]])
    verdict = accept_greedy(block, one_hot_logits([1, 2, 5, 4]))
    assert verdict.accepted.tolist() == [2]
    assert verdict.next_tokens.tolist() == [5]
    assert verdict.emitted.tolist() == [[1, 2, 5, -1]]


def test_accept_greedy_full_block_emits_the_bonus_and_limit_caps():
    block = mx.array([[0, 1, 2, 3]])
    logits = one_hot_logits([1, 2, 3, 4])
    assert accept_greedy(block, logits).emitted.tolist() == [[1, 2, 3, 4]]
    capped = accept_greedy(block, logits, limit=mx.array([1]))
    assert capped.accepted.tolist() == [1] and capped.emitted.tolist() == [[1, 2, -1, -1]]


def test_correction_is_the_residual_after_a_rejection_and_p_after_a_full_accept():
    p = mx.array([[0.5, 0.3, 0.2]])
    q = mx.array([[0.2, 0.6, 0.2]])
    assert np.allclose(correction(p, q, mx.array([[True]])), [[0.3, 0.0, 0.0]])
    assert np.allclose(correction(p, q, mx.array([[False]])), [[0.5, 0.3, 0.2]])
    assert np.allclose(correction(p, p, mx.array([[True]])), p)  # no residual mass: fall back to p


def test_accept_sampled_keeps_a_draft_equal_to_the_target_and_drops_an_impossible_one():
    rows, mode = batch_sampling(Sampling(1.0), 1)
    logits = mx.array(np.log(np.full((1, 3, V), 1 / V, np.float32)))
    block = mx.array([[0, 2, 4]])
    q = mx.broadcast_to(mx.log(mx.array(1 / V)), (1, 2, V))
    rng = np.random.default_rng(0)
    for _ in range(20):
        accept_u, correction_u = (mx.array(rng.uniform(size=shape), mx.float32) for shape in ((1, 2), (1, V)))
        verdict = accept_sampled(block, logits, q, rows, mode, accept_u, correction_u)
        assert verdict.accepted.tolist() == [2]  # q = p: every draft is kept
        impossible = np.zeros((1, 3, V), np.float32)
        impossible[:, :, 2] = -1e9  # the target never picks 2, the first draft
        verdict = accept_sampled(block, mx.array(impossible), q, rows, mode, accept_u, correction_u)
        assert verdict.accepted.tolist() == [0] and verdict.next_tokens.tolist() != [2]


def test_per_row_settings_mix_greedy_and_drawing_rows():
    rows, mode = batch_sampling([Sampling(), Sampling(1.0, top_k=1), Sampling(2.0)], 3)
    assert mode == Mode(greedy=True, sampled=True, top_k=True, top_p=False)
    logits = mx.array([[0.0, 3.0, 1.0]] * 3)
    u = mx.array(np.random.default_rng(1).uniform(size=(3, 3)), mx.float32)
    picked = choose(logits, rows, mode, u).tolist()
    assert picked[:2] == [1, 1]  # greedy, and top-1 sampling
    probs = np.exp(np.array(log_probs(logits, rows, mode)))
    assert np.allclose(probs[1], [0, 1, 0]) and np.allclose(probs[2], np.exp([0, 1.5, 0.5]) / np.exp([0, 1.5, 0.5]).sum())


def test_row_noise_depends_on_the_row_seed_and_position_only():
    seeds = row_seeds(7, 3)
    position = mx.array([5, 5, 9])
    alone = uniforms(seeds[1:2], position[1:2], 3, (4,))
    together = uniforms(seeds, position, 3, (4,))
    assert np.array_equal(np.array(alone)[0], np.array(together)[1])
    assert not np.array_equal(np.array(together)[0], np.array(together)[1])
    assert not np.array_equal(np.array(uniforms(seeds, position + 1, 3, (4,))), np.array(together))
    values = np.array(uniforms(row_seeds(0, 64), mx.zeros((64,), mx.int32), 1, (1000,))).ravel()
    assert 0 < values.min() and values.max() < 1 and abs(values.mean() - 0.5) < 0.01


def test_uniforms_never_reach_0_or_1():
    """The extreme hashes map strictly inside (0, 1): a uniform of 1 gives a
    Gumbel key of +inf (its token drawn whatever its probability, even one a
    constraint masks out), one of 0 a NaN."""
    extremes = np.array(unit_interval(mx.array([0, 1, 0xFFFFFFFE, 0xFFFFFFFF], mx.uint32)))
    assert extremes.dtype == np.float32 and (0 < extremes).all() and (extremes < 1).all()
    assert np.isfinite(np.array(gumbel_argmax(mx.array([[0.0, -mx.inf]]), mx.array(extremes[[0, 3]])[None])))
    assert gumbel_argmax(mx.array([[0.0, -mx.inf]]), mx.array(extremes[[0, 3]])[None]).item() == 0


def test_masks():
    positions = mx.array([[2, 3]])
    assert causal_mask(positions, 5)[0, 0].tolist() == [[True] * 3 + [False] * 2, [True] * 4 + [False]]
    assert causal_mask(positions, 5, window=2)[0, 0].tolist() == [
        [False, True, True, False, False], [False, False, True, True, False]
    ]
    assert prefix_mask(mx.array([3]), 5)[0, 0, 0].tolist() == [True, True, True, False, False]
    assert prefix_mask(mx.array([3]), 5, window=2)[0, 0, 0].tolist() == [False, True, True, False, False]
    mask = block_mask(mx.array([1]), 3, 2)[0, 0]
    assert mask.tolist() == [[True, False, False, True, True]] * 2


def test_write_rows_puts_each_row_at_its_own_offset():
    buffer = mx.zeros((2, 1, 4, 1))
    rows = mx.array([[[[1.0], [2.0]]], [[[3.0], [4.0]]]])
    written = write_rows(buffer, rows, mx.array([0, 2]))
    assert written[:, 0, :, 0].tolist() == [[1, 2, 0, 0], [0, 0, 3, 4]]


def test_rope_rotates_half_split_pairs_by_position_times_frequency():
    inv_freq = ops.rope_inv_freq(4, {"rope_theta": 100.0})
    assert np.allclose(inv_freq, [1.0, 0.1])
    x = mx.array([[[[1.0, 0.0, 0.0, 1.0]]]])  # pairs (x0, x2) = (1, 0) and (x1, x3) = (0, 1)
    out = np.array(ops.apply_rope(x, mx.array([[3]]), inv_freq))[0, 0, 0]
    a, b = 3.0, 0.3
    expected = [math.cos(a), -math.sin(b), math.sin(a), math.cos(b)]
    assert np.allclose(out, expected, atol=1e-6)


def test_proportional_rope_leaves_the_tail_unrotated():
    inv_freq = ops.rope_inv_freq(8, {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 100.0})
    assert np.allclose(inv_freq, [1.0, 100 ** -0.25, 0.0, 0.0])


@pytest.mark.parametrize("bits, group, mode", [(4, 32, "affine"), (8, 64, "affine"), (4, 128, "affine"),
                                               (8, 32, "mxfp8"), (4, 32, "mxfp4"), (4, 16, "nvfp4")])
def test_quantization_is_read_from_the_packed_shapes(bits, group, mode):
    w = mx.random.normal((8, 256))
    p = dict(zip(("weight", "scales", "biases"), mx.quantize(w, group_size=group, bits=bits, mode=mode)))
    assert ops.quantization(p, 256) == (group, bits, mode)
    x = mx.random.normal((3, 256))
    dense = x @ mx.dequantize(p["weight"], p["scales"], p.get("biases"), group_size=group, bits=bits, mode=mode).T
    assert mx.allclose(ops.linear(p, x), dense, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="not an MLX quantization of 100 columns"):
        ops.quantization(p, 100)


def test_affine_scales_without_biases_are_refused():
    weight, scales, _ = mx.quantize(mx.random.normal((8, 256)), group_size=64, bits=4)
    with pytest.raises(ValueError, match="not an MLX quantization"):
        ops.quantization({"weight": weight, "scales": scales}, 256)
