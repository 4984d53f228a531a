"""Rolling back a recurrent layer: two designs measured side by side on one
gated delta-net layer at Qwen3.5-4B-like dimensions (hidden 2560, 16 key
heads and 32 value heads of 128, convolution kernel 4), verify width 8.

- history (what the library does): the verify's scan keeps the state after
  every position, ``[B, W + 1, Hv, Dv, Dk]``; the round then picks, row by
  row, the one after the accepted tokens (``cache.settle``);
- re-advance: the verify's scan keeps only its inputs (q, k, v, decay, beta
  per position); the round then runs a second, masked scan from the round's
  starting state over the accepted prefix.

Both are compiled whole (a verify's scan plus its rollback, as in the
round kernel), fed random states and inputs, with accepted counts that
differ per row. Also timed: the same scan with no rollback at all (the
floor) and the whole layer's forward at width 8 (projections included), to
show the rollback's share. Times are the fastest of several runs.

    python bench/rollback.py            # batch sizes 1 and 4
    BATCHES=1 python bench/rollback.py
"""

import os

import dspark_fn  # noqa: F401  before mlx: OpenBLAS then serves MLX's matmuls (dspark_fn/blas.py)
import mlx.core as mx

from dspark_fn.cache import settle_entry
from dspark_fn.layers.gated_delta import DeltaGeometry, delta_state, delta_rule_step, gated_delta_net
from dspark_fn.layers.recurrent import scan
from workloads import fastest_seconds

HIDDEN, WIDTH, LAYERS = 2560, 8, 24  # a 4B-like hybrid has 24 delta-net layers of 32
GEOMETRY = DeltaGeometry(num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, conv_kernel=4)
BATCHES = [int(b) for b in os.environ.get("BATCHES", "1,4").split(",")]
MIB = 2**20


def scan_inputs(batch: int):
    g = GEOMETRY
    heads = (batch, WIDTH, g.num_v_heads)
    q, k = (mx.random.normal((*heads, g.head_k_dim)) * 0.1 for _ in range(2))
    v = mx.random.normal((*heads, g.head_v_dim))
    return q, k, v, mx.random.uniform(0.5, 1.0, heads), mx.random.uniform(0.0, 1.0, heads)


def with_history(state, inputs, count):
    y, pending = scan(delta_rule_step, state, inputs, None)
    return y, settle_entry(pending, count)


def re_advanced(state, inputs, count):
    y, _ = scan(delta_rule_step, state, inputs, mx.full(count.shape, WIDTH))
    _, settled = scan(delta_rule_step, state, inputs, count)
    return y, settled


def no_rollback(state, inputs, count):
    return scan(delta_rule_step, state, inputs, None)[0]


def layer_params():
    g, scale = GEOMETRY, HIDDEN**-0.5
    dense = lambda rows, cols: {"weight": mx.random.normal((rows, cols)) * scale}  # noqa: E731
    return {
        "in_proj_qkv": dense(g.conv_dim, HIDDEN), "in_proj_z": dense(g.num_v_heads * g.head_v_dim, HIDDEN),
        "in_proj_b": dense(g.num_v_heads, HIDDEN), "in_proj_a": dense(g.num_v_heads, HIDDEN),
        "conv1d": {"weight": mx.random.normal((g.conv_dim, g.conv_kernel, 1)) * 0.5},
        "A_log": mx.zeros((g.num_v_heads,)), "dt_bias": mx.ones((g.num_v_heads,)),
        "norm": {"weight": mx.ones((g.head_v_dim,))},
        "out_proj": dense(HIDDEN, g.num_v_heads * g.head_v_dim),
    }


def measure(batch: int, params: dict) -> dict:
    g = GEOMETRY
    state = mx.random.normal((batch, g.num_v_heads, g.head_v_dim, g.head_k_dim)) * 0.1
    inputs = scan_inputs(batch)
    count = mx.arange(batch) % WIDTH + 1
    x = mx.random.normal((batch, WIDTH, HIDDEN))
    entry = delta_state(g, batch, mx.float32)
    mx.eval(state, inputs, count, x, entry)
    designs = {name: mx.compile(fn) for name, fn in
               (("history", with_history), ("re-advance", re_advanced), ("no rollback", no_rollback))}
    layer = mx.compile(lambda x, entry: gated_delta_net(g, params, x, entry, 1e-6, None)[0])
    runs = {name: (lambda fn=fn: fn(state, inputs, count)) for name, fn in designs.items()}
    runs["layer forward"] = lambda: layer(x, entry)
    seconds = fastest_seconds(runs, passes=9)
    state_bytes = state.nbytes
    held = {"history": (WIDTH + 1) * state_bytes, "re-advance": sum(a.nbytes for a in inputs),
            "no rollback": 0, "layer forward": 0}
    return {name: (seconds[name], held[name]) for name in runs}


def main():
    params = layer_params()
    mx.eval(params)
    print(f"one delta-net layer, W={WIDTH}; per verify x{LAYERS} layers in brackets\n")
    print("| batch | design | ms / layer | ms / verify | held between verify and rollback |")
    print("|---|---|---|---|---|")
    for batch in BATCHES:
        for name, (seconds, held) in measure(batch, params).items():
            memory = f"{held / MIB:.1f} MiB / layer ({held * LAYERS / MIB:.0f} MiB)" if held else "-"
            print(f"| {batch} | {name} | {seconds * 1e3:.2f} | {seconds * 1e3 * LAYERS:.1f} | {memory} |")


if __name__ == "__main__":
    main()
