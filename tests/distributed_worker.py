"""One rank of the distributed checks, run by ``tests/test_distributed.py``:

    mlx.launch -n N --backend ring python distributed_worker.py OUT_DIR tensor|pipeline CASE_DIR...

Each ``CASE_DIR`` holds ``target/``, ``draft/`` and ``case.json`` (its
``name``, and ``drive``: whether mlx-lm reads the target, for the driven
rounds). Every rank loads each whole pair, keeps its share of the target
(tensor parallel, or pipeline) and runs the same checks on both, writing
what it saw to ``OUT_DIR/NAME-rank-R.json``: the largest
difference of logits and taps between the sharded and the whole target
after a prefill and decode rounds (and the fp32 bound it must stay within),
the tokens of greedy, sampled and batched generations of each (sampled
with the draft gate too, whose timings differ between the two), and the
rounds driven with proposals that keep every count from 0 to W - 1.
"""

import json
import sys
import traceback
from pathlib import Path

import dspark_fn  # before mlx: OpenBLAS then serves MLX's matmuls (dspark_fn/blas.py)
import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from dspark_fn.distributed import rank_report, shard_pair, world  # noqa: E402
from dspark_fn.sampling import Sampling  # noqa: E402
from dspark_fn.sharding import Ranks  # noqa: E402
from helpers import drive_proposals, speculative_tokens  # noqa: E402
from numerics import fp32_bound  # noqa: E402

PROMPTS = [[5, 17, 2, 99, 41, 8, 13], list(range(3, 40)), [7, 7, 7, 1]]  # ids below every case's vocabulary
NEW_TOKENS = 24


def forward_errors(whole, sharded, prompt) -> dict:
    """Logits and taps of both after a prefill of ``prompt`` and three one-token steps."""
    spec, adapter = whole.spec, whole.spec.target_adapter
    worst = {"logits": 0.0, "taps": 0.0, "logits_bound": 0.0, "taps_bound": 0.0}
    caches = [adapter.init_kv(p.spec.target, 1, 64) for p in (whole, sharded)]
    tokens, start = mx.array([prompt]), 0

    def forward(params, kv, tokens, start):  # recurrent states committed after the call, as a prefill leaves them
        begin = mx.array([start], mx.int32)
        if adapter.prompt_forward is None:
            return adapter.forward(params.spec.target, params.target, kv, tokens, begin, spec.taps)
        end = begin + tokens.shape[1]
        return adapter.prompt_forward(params.spec.target, params.target, kv, tokens, begin, spec.taps, begin * 0, end)

    for _ in range(4):
        outputs = []
        for index, params in enumerate((whole, sharded)):
            hidden, taps, caches[index] = forward(params, caches[index], tokens, start)
            outputs.append((adapter.logits(params.spec.target, params.target, hidden), taps))
        reduction = max(start + tokens.shape[1], 2 * spec.target.hidden_size, spec.target.vocab_size)
        for name, expected, actual in (("logits", outputs[0][0], outputs[1][0]), ("taps", outputs[0][1], outputs[1][1])):
            worst[name] = max(worst[name], float(mx.abs(actual - expected).max()))
            bound = fp32_bound(np.array(expected), layers=spec.target.num_layers, reduction=reduction)
            worst[f"{name}_bound"] = max(worst[f"{name}_bound"], bound)
        start += tokens.shape[1]
        tokens = mx.argmax(outputs[0][0][:, -1:], axis=-1).astype(mx.int32)
    return worst


def run(case: Path, pipeline: bool, drive: bool) -> dict:
    from mlx_lm.utils import load_model

    group = world()
    whole = dspark_fn.load(case / "target", case / "draft")
    sharded = shard_pair(whole, Ranks(group.rank(), group.size()), pipeline)
    report = {"rank": group.rank(), "size": group.size(), "ranks": rank_report(sharded, group)}
    report["forward"] = forward_errors(whole, sharded, PROMPTS[1])
    sampled = {"sampling": Sampling(0.8, top_p=0.9), "seed": 3}
    for name, options in (("greedy", {}), ("greedy_width_3", {"width": 3}), ("sampled_width_3", dict(sampled, width=3)),
                          ("sampled", sampled)):
        report[name] = speculative_tokens(sharded, PROMPTS[0], NEW_TOKENS, **options)
        report[f"{name}_whole"] = speculative_tokens(whole, PROMPTS[0], NEW_TOKENS, **options)
    batch = [[t for e in dspark_fn.generate(params, PROMPTS, NEW_TOKENS) if e.tag == row for t in e.emitted]
             for params in (sharded, whole) for row in range(len(PROMPTS))]
    report["batched"], report["batched_whole"] = batch[: len(PROMPTS)], batch[len(PROMPTS) :]
    if drive:  # checks every round keeps exactly the right prefix of mlx-lm's greedy stream
        model, _ = load_model(case / "target")
        model.set_dtype(mx.float32)
        vocab = whole.spec.target.vocab_size
        report["partly_right_rounds"] = drive_proposals(model, sharded, vocab, PROMPTS, "partly-right", NEW_TOKENS)[1]
    return report


def main() -> None:
    out, mode, cases = Path(sys.argv[1]), sys.argv[2], [Path(c) for c in sys.argv[3:]]
    rank = world().rank()
    for case in cases:
        about = json.loads((case / "case.json").read_text())
        try:
            report = run(case, mode == "pipeline", about["drive"])
        except Exception:  # the test reads the failure from the file
            report = {"rank": rank, "error": traceback.format_exc()}
        (out / f"{about['name']}-rank-{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
