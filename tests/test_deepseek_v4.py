"""The deepseek_v4 target adapter and DSpark draft against mlx-vlm, at tiny random dims.

The draft checkpoint is written in the official ``mtp.{i}.*`` layout; mlx-vlm's
drafter reads it through its own ``sanitize`` and ``dspark_fn`` through
``load``, so the key map is checked along with the math. mlx-vlm keeps more
context rows than the window once the context outgrows it, so parity rounds
stay inside the window and the window rule itself is checked against
mlx-vlm's drafter fed exactly the last ``sliding_window`` rows.
"""

import json
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

import dspark_fn
from dspark_fn import ops
from dspark_fn.checkpoints import save_draft
from dspark_fn.drafts import deepseek_v4 as draft_v4
from dspark_fn.kernel import TRACE_COUNTS
from dspark_fn.targets import deepseek_v4 as target_v4
from numerics import assert_fp32_close

pytestmark = pytest.mark.numerics  # rerun on the bundled BLAS by .ci/run

WINDOW = 24
NOISE = 150
TEXT = dict(
    model_type="deepseek_v4",
    vocab_size=160,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=1,
    n_shared_experts=1,
    n_routed_experts=8,
    routed_scaling_factor=1.5,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    head_dim=32,
    scoring_func="sqrtsoftplus",
    compress_ratios=[0, 0, 0, 0],
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    num_hash_layers=1,
    swiglu_limit=10.0,
    sliding_window=WINDOW,
    o_groups=2,
    o_lora_rank=16,
    num_nextn_predict_layers=3,
    max_position_embeddings=4096,
)
DSPARK = dict(
    dspark_block_size=5,
    dspark_markov_rank=16,
    dspark_target_layer_ids=[1, 2, 3],
    dspark_noise_token_id=NOISE,
)
TAPS = DSPARK["dspark_target_layer_ids"]
# fp32 budget (tests/numerics.py): every target layer and draft stage on the
# path; the widest sum runs over the hyper-connection streams (hc_mult * d).
BUDGET = dict(
    layers=TEXT["num_hidden_layers"] + TEXT["num_nextn_predict_layers"],
    reduction=TEXT["hc_mult"] * TEXT["hidden_size"],
)


def random_tensor(name: str, shape, key) -> mx.array:
    """Weights with every kind of tensor away from its neutral value."""
    if name.endswith("tid2eid"):  # distinct experts per token
        order = mx.argsort(mx.random.uniform(shape=(shape[0], TEXT["n_routed_experts"]), key=key), axis=-1)
        return order[:, : shape[1]].astype(mx.int32)
    if name.endswith("norm.weight"):
        return 1 + 0.1 * mx.random.normal(shape, key=key)
    if name.endswith("scale"):  # hyper-connection scales
        return mx.random.uniform(0.5, 1.0, shape, key=key)
    return 0.2 * mx.random.normal(shape, key=key)


def randomised(shapes: dict, seed: int) -> dict:
    keys = mx.random.split(mx.random.key(seed), len(shapes))
    return {name: random_tensor(name, shape, k) for k, (name, shape) in zip(keys, sorted(shapes.items()))}


def vlm_taps(target, tokens: list) -> mx.array:
    """mlx-vlm's taps of every position, from one cached pass over ``tokens``."""
    out = target(mx.array([tokens]), cache=target.make_cache(), capture_layer_ids=TAPS)
    return mx.concatenate(out.hidden_states, axis=-1)


def vlm_greedy(target, prompt: list, count: int) -> list:
    """Greedy decoding of mlx-vlm's target through its own cache."""
    cache = target.make_cache()
    logits = target(mx.array([prompt]), cache=cache).logits
    tokens = []
    for _ in range(count):
        tokens.append(int(mx.argmax(logits[0, -1])))
        logits = target(mx.array([[tokens[-1]]]), cache=cache).logits
    return tokens


def write_pair(root, text: dict, seed: int):
    """A random mlx-vlm target of config ``text`` and a random DSpark draft for
    it, saved under ``root``: ``(target, draft checkpoint, params)``."""
    from mlx_vlm.models.deepseek_v4 import Model, ModelConfig

    target = Model(ModelConfig.from_dict(text))
    shapes = {name: value.shape for name, value in tree_flatten(target.parameters())}
    target.update(tree_unflatten(list(randomised(shapes, seed=seed).items())))
    target.eval()
    (root / "target").mkdir()
    (root / "target" / "config.json").write_text(json.dumps(text))
    mx.save_safetensors(str(root / "target" / "model.safetensors"), dict(tree_flatten(target.parameters())))
    config = {**text, **DSPARK}
    spec = draft_v4.spec_from_config(config)
    shared = ("embed_tokens.weight", "lm_head.weight")
    checkpoint = randomised({k: v for k, v in draft_v4.checkpoint_shapes(spec).items() if k not in shared}, seed=2)
    save_draft(root / "draft", config, checkpoint)
    return target, checkpoint, dspark_fn.load(root / "target", root / "draft")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from mlx_vlm.speculative.drafters.deepseek_v4_dspark import Model as VlmDraft
    from mlx_vlm.speculative.drafters.deepseek_v4_dspark import ModelConfig as VlmDraftConfig

    root = tmp_path_factory.mktemp("deepseek_v4")
    target, checkpoint, params = write_pair(root, TEXT, seed=1)
    # mlx-vlm drops the dspark_* keys from text_config: they go top-level, block_size counting the anchor
    vlm_config = dict(
        model_type="deepseek_v4_dspark",
        text_config=TEXT,
        n_mtp_layers=TEXT["num_nextn_predict_layers"],
        target_layer_ids=TAPS,
        mask_token_id=NOISE,
        markov_rank=DSPARK["dspark_markov_rank"],
        block_size=DSPARK["dspark_block_size"] + 1,
    )
    vlm_draft = VlmDraft(VlmDraftConfig.from_dict(vlm_config))
    vlm_draft.load_weights(list(vlm_draft.sanitize(checkpoint).items()), strict=True)
    vlm_draft.eval()
    vlm_draft.bind(target)
    return SimpleNamespace(root=root, target=target, vlm_draft=vlm_draft, checkpoint=checkpoint, params=params)


def close(actual, expected, what):
    assert_fp32_close(actual, expected, what, **BUDGET)


def vlm_block(pair, anchor: int, taps: mx.array, cache):
    """mlx-vlm's drafter on one round: pre-norm hc_head output, logits, greedy Markov drafts."""
    draft = pair.vlm_draft
    inputs = mx.array([[anchor] + [NOISE] * (DSPARK["dspark_block_size"] - 1)])
    first, last = draft.stages[0], draft.stages[-1]
    context = first.main_norm(first.main_proj(taps))
    embedded = draft._input_embed(inputs)[:, :, None, :]
    streams = mx.broadcast_to(embedded, (1, inputs.shape[1], TEXT["hc_mult"], TEXT["hidden_size"]))
    for stage, stage_cache in zip(draft.stages, cache):
        streams = stage(streams, context, stage_cache)
    pre_norm = last.hc_head(streams)
    logits = draft._logits(last.norm(pre_norm))
    greedy = lambda x: mx.argmax(x, axis=-1)  # noqa: E731
    drafted = draft.markov_head.sample_block(logits, first_prev_tokens=mx.array([anchor]), sampler=greedy)
    return pre_norm, logits, drafted


def check_round(pair, proposal, expected):
    pre_norm, logits, drafted = expected
    norm = pair.params.draft["stages"][-1]["norm"]["weight"]
    close(proposal.hidden, pre_norm, "pre-norm hc_head output")
    hidden = ops.rms_norm(proposal.hidden, norm, TEXT["rms_norm_eps"])
    close(hidden, pair.vlm_draft.stages[-1].norm(pre_norm), "block hidden")
    close(proposal.base_logits, logits, "base logits")
    assert proposal.tokens.tolist() == drafted.tolist()


def oracle_block(anchor: int, truth: list, keep: int) -> mx.array:
    """``[anchor, truth[:keep], wrong...]``: a verify that accepts exactly ``keep`` drafts."""
    wrong = [(t + 1) % NOISE for t in truth[keep : DSPARK["dspark_block_size"]]]
    return mx.array([[anchor] + truth[:keep] + wrong], mx.int32)


def run_rounds(pair, prompt, accepts, check):
    """Prefill, then per round draft, ``check(proposal, anchor, committed)`` and
    verify a block accepting ``accepts[r]`` drafts (None: the draft's own block)."""
    params = pair.params
    cache, tokens = dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, 128), prompt)
    committed = list(prompt)
    for keep in accepts:
        anchor = tokens.item()
        proposal = dspark_fn.draft_block(params, cache, tokens)
        check(proposal, anchor, committed)
        if keep is None:
            block = mx.concatenate([tokens[:, None], proposal.tokens], axis=1)
        else:
            truth = vlm_greedy(pair.target, committed + [anchor], DSPARK["dspark_block_size"])
            block = oracle_block(anchor, truth, keep)
        cache, result = dspark_fn.verify_block(params, cache, block)
        assert keep is None or result.accepted.item() == keep
        committed += block[0, : result.accepted.item() + 1].tolist()
        tokens = result.next_tokens
        assert cache.length.item() == len(committed)


def test_target_logits_and_taps_match_mlx_vlm(pair):
    params, tokens = pair.params, np.random.default_rng(0).integers(0, NOISE, 40).tolist()
    spec = params.spec
    expected = pair.target(mx.array([tokens]), cache=pair.target.make_cache(), capture_layer_ids=TAPS)
    kv = spec.target_adapter.init_kv(spec.target, 1, 64)
    hidden, features, _ = spec.target_adapter.forward(
        spec.target, params.target, kv, mx.array([tokens]), mx.array([0]), spec.taps
    )
    # 40 tokens > window 24: the window mask is exercised
    close(spec.target_adapter.logits(spec.target, params.target, hidden), expected.logits, "target logits")
    close(features, mx.concatenate(expected.hidden_states, axis=-1), "target taps")


def test_generate_equals_mlx_vlm_greedy(pair):
    prompt = np.random.default_rng(1).integers(0, NOISE, 11).tolist()
    tokens = [t for event in dspark_fn.generate(pair.params, prompt, 30) for t in event.emitted]
    assert tokens == vlm_greedy(pair.target, prompt, 30)


def test_draft_rounds_match_mlx_vlm_inside_the_window(pair):
    """Hidden states, logits and drafted tokens over rounds that commit 1 to 6
    rows, while the whole context fits the window (where both rules agree)."""
    vlm_cache, fed = pair.vlm_draft.make_cache(), [0]

    def check(proposal, anchor, committed):
        assert len(committed) <= WINDOW
        taps = vlm_taps(pair.target, committed)[:, fed[0] :]
        fed[0] = len(committed)
        check_round(pair, proposal, vlm_block(pair, anchor, taps, vlm_cache))

    run_rounds(pair, np.random.default_rng(2).integers(0, NOISE, 8).tolist(), [None, 5, 2, None, 0], check)


def test_draft_window_is_the_last_sliding_window_positions(pair):
    """Past the window, a block sees exactly the last ``sliding_window``
    committed rows: mlx-vlm's drafter fed only those rows (at their positions)
    agrees, and its own rule, which keeps the whole prompt, does not."""
    prompt = np.random.default_rng(3).integers(0, NOISE, 40).tolist()
    differences = []

    def check(proposal, anchor, committed):
        taps = vlm_taps(pair.target, committed)
        window_cache = pair.vlm_draft.make_cache()
        for stage_cache in window_cache:
            stage_cache.offset = len(committed) - WINDOW
        check_round(pair, proposal, vlm_block(pair, anchor, taps[:, -WINDOW:], window_cache))
        whole = vlm_block(pair, anchor, taps, pair.vlm_draft.make_cache())[1]
        differences.append(float(mx.abs(proposal.base_logits - whole).max()))

    run_rounds(pair, prompt, [3, None, 4], check)
    assert min(differences) > 0.1  # the context outgrows the window from the first round


def test_confidence_head_is_its_definition(pair):
    """``c_k = proj([x_k ; markov_w1[x_{k-1}]])`` with no bias, ``x`` the
    pre-norm hc_head output of mlx-vlm's drafter and ``x_{-1}`` the anchor."""
    checkpoint = pair.checkpoint
    w1 = checkpoint["mtp.2.markov_head.markov_w1.weight"]
    proj = checkpoint["mtp.2.confidence_head.proj.weight"]
    vlm_cache = pair.vlm_draft.make_cache()

    def check(proposal, anchor, committed):
        pre_norm, _, drafted = vlm_block(pair, anchor, vlm_taps(pair.target, committed), vlm_cache)
        previous = mx.concatenate([mx.array([[anchor]]), drafted[:, :-1]], axis=1)
        expected = (mx.concatenate([pre_norm, w1[previous]], axis=-1) @ proj.T)[..., 0]
        close(proposal.confidence_logits, expected, "confidence logits")

    run_rounds(pair, np.random.default_rng(4).integers(0, NOISE, 9).tolist(), [None], check)


def test_checkpoint_keys_land_in_the_mlx_vlm_layout(pair):
    """Heads at top level, experts stacked, ``wo_a`` split into groups: the
    same tree mlx-vlm builds from the same checkpoint."""
    ours = dict(tree_flatten(pair.params.draft))
    theirs = dict(tree_flatten(pair.vlm_draft.parameters()))
    assert set(ours) - set(theirs) == {"embed_tokens.weight", "lm_head.weight", "confidence_head.proj.weight"}
    assert set(theirs) <= set(ours)
    for name, value in theirs.items():
        assert mx.array_equal(ours[name], value), name


def test_unsupported_configs_are_rejected():
    with pytest.raises(ValueError, match="vision layers"):
        target_v4.spec_from_config({**TEXT, "vision_n_layers": 1})
    with pytest.raises(ValueError, match="not a DSpark checkpoint"):
        draft_v4.spec_from_config(TEXT)


# ---- compressed attention: pooled windows (ratio 128), indexed overlapping pools (ratio 4)

COMPRESSED = {
    **TEXT,
    "compress_ratios": [0, 4, 128, 4],
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 3,  # fewer than the pooled rows: the indexer's choice matters
}


@pytest.fixture(scope="module")
def compressed(tmp_path_factory):
    target, _, params = write_pair(tmp_path_factory.mktemp("deepseek_v4_compressed"), COMPRESSED, seed=3)
    return SimpleNamespace(target=target, params=params)


def vlm_decode(target, prompt: list, continuation: list):
    """mlx-vlm's logits and taps of every position: the prompt in one call, then one token a call."""
    cache = target.make_cache()
    outputs = [target(mx.array([prompt]), cache=cache, capture_layer_ids=TAPS)]
    outputs += [target(mx.array([[t]]), cache=cache, capture_layer_ids=TAPS) for t in continuation]
    logits = mx.concatenate([out.logits for out in outputs], axis=1)
    return logits, mx.concatenate([mx.concatenate(out.hidden_states, axis=-1) for out in outputs], axis=1)


def chunked_prefill(params, prompt: list, chunk: int, capacity: int = 512):
    """Our target over ``prompt`` in calls of ``chunk`` tokens (the last one
    padded, as ``prefill`` does): ``(logits, taps, kv)`` of the prompt rows."""
    spec, adapter = params.spec, params.spec.target_adapter
    kv = adapter.init_kv(spec.target, 1, capacity)
    padded = prompt + [0] * (-len(prompt) % chunk)
    span = mx.array([0]), mx.array([len(prompt)])
    hidden, taps = [], []
    for begin in range(0, len(padded), chunk):
        h, f, kv = adapter.prompt_forward(
            spec.target, params.target, kv, mx.array([padded[begin : begin + chunk]]), mx.array([begin]), spec.taps,
            *span,
        )
        hidden.append(h)
        taps.append(f)
    logits = adapter.logits(spec.target, params.target, mx.concatenate(hidden, axis=1))
    return logits[:, : len(prompt)], mx.concatenate(taps, axis=1)[:, : len(prompt)], kv


@pytest.mark.parametrize("length, chunk", [(8, 64), (60, 16), (300, 64), (300, 50)])
def test_compressed_target_matches_mlx_vlm_over_prefill_and_decode(compressed, length, chunk):
    """Logits and taps of every position equal mlx-vlm's: a prompt mlx-vlm runs
    token by token (two windows, pooled apart), one shorter than 128, and longer than 128 and than many windows, fed
    to us in chunks whose boundaries fall inside windows and to mlx-vlm in one
    call; then 40 decoded tokens that complete windows one token at a time."""
    params, rng = compressed.params, np.random.default_rng(length + chunk)
    prompt, continuation = rng.integers(0, NOISE, length).tolist(), rng.integers(0, NOISE, 40).tolist()
    expected_logits, expected_taps = vlm_decode(compressed.target, prompt, continuation)
    logits, taps, kv = chunked_prefill(params, prompt, chunk)
    spec, adapter = params.spec, params.spec.target_adapter
    for i, token in enumerate(continuation):
        h, f, kv = adapter.forward(spec.target, params.target, kv, mx.array([[token]]), mx.array([length + i]), spec.taps)
        logits = mx.concatenate([logits, adapter.logits(spec.target, params.target, h)], axis=1)
        taps = mx.concatenate([taps, f], axis=1)
    close(logits, expected_logits, "target logits")
    close(taps, expected_taps, "target taps")


def test_compressed_rollback_rounds_follow_mlx_vlm_greedy(compressed):
    """Verify blocks accepting 0..5 drafts, so rejected drafts complete windows
    (ratio 4 every few rounds, ratio 128 once, at position 256) that accepted
    tokens complete again later: every round accepts exactly the true prefix,
    and the logits after the last round equal mlx-vlm's decoding."""
    params = compressed.params
    prompt = np.random.default_rng(5).integers(0, NOISE, 200).tolist()
    truth = vlm_greedy(compressed.target, prompt, 110)
    cache, tokens = dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, 512), prompt)
    position, keeps = 0, [5, 0, 3, 1, 4, 2]  # truth[position] is the anchor
    for round_index in range(24):
        keep = keeps[round_index % len(keeps)]
        assert tokens.item() == truth[position]
        cache, result = dspark_fn.verify_block(params, cache, oracle_block(truth[position], truth[position + 1 :], keep))
        assert result.accepted.item() == keep
        position += keep + 1
        tokens = result.next_tokens
    assert cache.length.item() == len(prompt) + position > 256
    spec, adapter = params.spec, params.spec.target_adapter
    hidden, _, _ = adapter.forward(spec.target, params.target, cache.target, tokens[:, None], cache.length, spec.taps)
    expected, _ = vlm_decode(compressed.target, prompt, truth[: position + 1])
    close(adapter.logits(spec.target, params.target, hidden), expected[:, -1:], "logits after the rounds")


def test_compressed_generate_equals_mlx_vlm_greedy_for_300_tokens(compressed):
    """Two prompts of different lengths in one batch, full draft blocks every
    round (each rejected suffix rolled back), the cache growing past 256 slots."""
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, NOISE, 40).tolist(), rng.integers(0, NOISE, 57).tolist()]
    streams = [[], []]
    before = TRACE_COUNTS.copy()
    for event in dspark_fn.generate(compressed.params, prompts, 300, width=None):
        streams[event.tag] += event.emitted
    # at most one draft and one verify trace per capacity bucket (256, then 512) over ~150 rounds
    assert all(TRACE_COUNTS[kind] - before[kind] <= 2 for kind in ("draft", "verify"))
    for prompt, stream in zip(prompts, streams):
        assert stream == vlm_greedy(compressed.target, prompt, 300)
