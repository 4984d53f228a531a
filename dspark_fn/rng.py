"""Per-row random numbers as a pure function of (row seed, row position, stream).

Every row of a batch draws from its own counter-based stream: a uniform is
the 32-bit hash (murmur3's finaliser, applied twice) of the row's seed, the
row's committed length when it draws, a stream id naming the draw site, and
the element index. So a row's samples depend on its seed and its own
history only: not on the other rows, their number or its place in the
batch, which is what lets requests join and leave a running batch and stay
reproducible. Rows advance their length every round, so no draw repeats.
"""

import mlx.core as mx

GOLDEN = 0x9E3779B9
M1, M2, M3 = 0x85EBCA6B, 0xC2B2AE35, 0x27D4EB2F

# Draw sites (the draft's slot k uses DRAFT_SLOT + k).
PREFILL = 1
ACCEPT = 2
CORRECTION = 3
DRAFT_SLOT = 16


def _u32(value: int) -> mx.array:
    return mx.array(value & 0xFFFFFFFF, mx.uint32)


def fmix32(h: mx.array) -> mx.array:
    h = h ^ (h >> 16)
    h = h * _u32(M1)
    h = h ^ (h >> 13)
    h = h * _u32(M2)
    return h ^ (h >> 16)


def row_seeds(seed: int, rows: int) -> mx.array:
    """``[rows]`` distinct seeds derived from one integer (row b of ``generate``'s batch)."""
    base = fmix32(_u32(seed) ^ _u32(GOLDEN))
    return fmix32(base + mx.arange(rows, dtype=mx.uint32) * _u32(M3))


def uniforms(seeds: mx.array, position: mx.array, stream: int, shape: tuple) -> mx.array:
    """``[B, *shape]`` independent uniforms in (0, 1): row b's from ``seeds[b]``
    at ``position[b]``, for draw site ``stream``."""
    count = 1
    for size in shape:
        count *= size
    counter = fmix32(position.astype(mx.uint32) * _u32(GOLDEN) ^ _u32(stream * M3))
    index = mx.arange(count, dtype=mx.uint32) * _u32(M2)
    h = fmix32(seeds[:, None] ^ fmix32(counter[:, None] + index))
    return unit_interval(h).reshape(seeds.shape[0], *shape)


def unit_interval(h: mx.array) -> mx.array:
    """uint32 hashes -> float32 uniforms strictly inside (0, 1): the 23 high
    bits, centred in their bin. Every centre is exact in float32; with 24
    bits the top bin's centre, 1 - 2^-25, would round to 1.0, and a Gumbel
    key of u = 1 is infinite: that token would be drawn whatever its
    probability (one draw in about 340 over a 49k vocabulary, and a token
    outside a constraint's mask)."""
    return ((h >> 9).astype(mx.float32) + 0.5) * 2.0**-23


def gumbel_argmax(log_probs: mx.array, u: mx.array) -> mx.array:
    """One draw per row from ``softmax(log_probs)`` (Gumbel-max), ``u`` uniforms of the same shape."""
    return mx.argmax(log_probs - mx.log(-mx.log(u)), axis=-1).astype(mx.int32)
