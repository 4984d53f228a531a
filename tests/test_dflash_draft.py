"""DSpark drafts in the ``dflash_config`` layout against mlx-vlm's own DSpark drafter.

A tiny qwen3 target and random draft weights saved with the config mlx-vlm
reads; both drafters get the same target features and context, and their
block hidden states, base and Markov-corrected logits, confidences and
drafted tokens must agree (fp32 bound), for each option of the layout.
mlx-vlm always runs on a fresh context cache holding the whole committed
context: its sliding layers then show exactly the ``window - 1`` context rows
the window holds. (Its ring-buffer cache, grown round by round, shows
``window - 2 + n`` rows after an ``n``-row extension, and in causal layers
masks ring slots rather than positions once the ring has wrapped; our context
grown round by round is checked against the fresh computation instead, in
``test_incremental_context``.)

On tiny hybrid targets (``hybrids.HYBRID_SHAPES``), ``generate`` at fixed
width, mlx-vlm's own DSpark loop (``generate_step`` with the draft loaded by
``load_drafter``) and mlx-lm greedy must write the same tokens, and every
full-width round must draft and accept what mlx-vlm's does
(``test_hybrid_generate_equals_mlx_vlm_loop``). lfm2_moe is left out: mlx-vlm
0.7.10 routes its experts with lfm2's softmax router (expert bias added to the
probabilities, no routed scaling), not the sigmoid routing of mlx-lm and the
checkpoint, so its target alone already writes other tokens.

Breaks tried, each restored (the test that caught it):
- sink logit left out of the softmax: ``sinks`` and ``everything`` cases of
  ``test_block_matches_mlx_vlm`` and ``test_incremental_context``;
- bidirectional mask kept for causal layers: ``causal``, ``causal-sliding``, ``everything``;
- sliding context window one row too wide (``window`` instead of ``window - 1``): ``sliding``;
- causal sliding window one position wider: ``causal-sliding``, ``everything``;
- windows given to the wrong layers (layer order reversed): ``sliding``, ``everything``;
- the anchor's own output kept without ``sample_from_anchor``: ``mask-slots``, ``everything``;
- half-split RoPE for ``rope_is_neox_style: false``: ``interleaved-rope``, ``everything``;
- ``runtime_block_size`` ignored: ``runtime-width`` (block width mismatch);
- ``dspark_bonus_anchor`` ignored: ``test_bonus_anchor_counts_the_anchor``;
- ``model.`` prefix not stripped: ``test_model_prefixed_checkpoint_loads``;
- no rollback (``cache.settle_entry`` keeping the state after all the round's
  tokens), or its convolution window read one token late: every family of
  ``test_hybrid_generate_equals_mlx_vlm_loop`` (our tokens);
- the delta-net / SSM state read one token late in ``settle_entry``: its
  nemotron_h, qwen3_5 and qwen3_5_moe cases (lfm2 has no such state);
- the later tap one target layer early (``target_layer_ids``): every family of
  ``test_hybrid_generate_equals_mlx_vlm_loop`` (round 0's drafted tokens).
"""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import dspark_fn
from dspark_fn.checkpoints import save_draft
from dspark_fn.drafts import dflash, resolve_arch
from dspark_fn.drafts.fresh import random_draft_weights
from helpers import build_target, damp_attention, mlx_lm_greedy, random_prompt, target_config
from hybrids import HYBRID_SHAPES
from numerics import assert_fp32_close

pytestmark = pytest.mark.numerics  # rerun on the bundled BLAS by .ci/run

TARGET = target_config("qwen3", vocab=256, hidden=64, layers=6, heads=4, kv_heads=2, head_dim=16)
PROMPT_LENGTH = 21  # longer than the windows below, so they cut the context
CAPACITY = 128

CASES = {
    "bidirectional": {},
    "causal": {"causal": True},
    "sliding": {"layer_types": ["sliding_attention", "full_attention"], "swa_window_size": 6},
    "causal-sliding": {"causal": True, "layer_types": ["sliding_attention"] * 2, "swa_window_size": 5},
    "sinks": {"attention_sink_bias": True},
    "mask-slots": {"sample_from_anchor": False},
    "interleaved-rope": {"rope_is_neox_style": False},
    "runtime-width": {"runtime_block_size": 4},
    "everything": {
        "causal": True, "layer_types": ["full_attention", "sliding_attention"], "swa_window_size": 7,
        "attention_sink_bias": True, "sample_from_anchor": False, "rope_is_neox_style": False,
    },
}
TOP_LEVEL = ("layer_types", "rope_is_neox_style")


def draft_layout(block_size=5, markov_rank=8, **options) -> dict:
    """A ``dflash_config`` draft config for ``TARGET`` (two draft layers)."""
    config = {key: TARGET[key] for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
        "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
    )}
    config.update(model_type="qwen3", architectures=["DSparkDraftModel"], num_hidden_layers=2, hidden_act="silu")
    config["dflash_config"] = {
        "projector_type": "dspark", "block_size": block_size, "mask_token_id": TARGET["vocab_size"] - 1,
        "target_layer_ids": [1, 3], "num_target_layers": TARGET["num_hidden_layers"], "markov_rank": markov_rank,
        "enable_confidence_head": True, "confidence_head_with_markov": True, "block_size_policy": "fixed",
    }
    for key, value in options.items():
        (config if key in TOP_LEVEL else config["dflash_config"])[key] = value
    return config


def draft_weights(config: dict, seed: int, spread: float = 0.4) -> dict:
    """Random weights of the layout (no embedding or head: the target's serve);
    norm weights spread around 1 and random sink logits, so dropping either shows."""
    arch = resolve_arch(config)
    weights = random_draft_weights(arch, arch.spec_from_config(config), seed=seed, gain=2.0)
    rng = np.random.default_rng(seed)
    for key, value in weights.items():
        if key.endswith("attention_sink_bias"):
            weights[key] = mx.array(rng.normal(0.0, 2.0, value.shape).astype(np.float32))
        elif value.ndim == 1 and not key.endswith("bias"):
            weights[key] = value * mx.array(rng.uniform(1 - spread, 1 + spread, value.shape).astype(np.float32))
    return {key: value for key, value in weights.items() if key not in ("embed_tokens.weight", "lm_head.weight")}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash_target")
    return root, build_target(root, TARGET, seed=3, vector_spread=0.4)


def build_pair(root: Path, target, config: dict, seed: int = 1):
    target_dir, model = target
    save_draft(root, config, draft_weights(config, seed))
    return dspark_fn.load(target_dir, root), mlx_vlm_drafter(root, model)


def mlx_vlm_drafter(directory: Path, model):
    """mlx-vlm's DSpark drafter for the draft in ``directory``, given the mlx-lm
    target's embedding and head (``bind`` minus its check for a rollback-capable
    mlx-vlm target)."""
    from mlx_vlm.speculative.drafters.qwen3_dflash.dflash import DFlashDraftModel
    from mlx_vlm.utils import load_model

    drafter = load_model(Path(directory))
    DFlashDraftModel.bind(drafter, model)
    return drafter


def target_features(params, tokens: list) -> mx.array:
    """The tapped target features ``[1, L, F]`` of ``tokens`` from position 0."""
    spec = params.spec
    kv = spec.target_adapter.init_kv(spec.target, 1, CAPACITY)
    _, features, _ = spec.target_adapter.forward(
        spec.target, params.target, kv, mx.array([tokens]), mx.array([0]), spec.taps
    )
    return features


def argmax(logits):
    return mx.argmax(logits, axis=-1)


def mlx_vlm_block(drafter, features, anchor: int) -> dict:
    """mlx-vlm's proposal after ``anchor`` on a fresh context of ``features``,
    as wide as its loop drafts by default (``runtime_block_size`` - 1)."""
    from mlx_vlm.speculative.common import _dflash_block_total

    config = drafter.config
    drafts = _dflash_block_total(drafter, None) - 1
    tokens = drafter.draft_block(anchor, features, drafter.make_cache(), drafts + 1, argmax)
    anchor_ids = mx.array([anchor])
    masks = [config.mask_token_id] * (drafts - int(config.sample_from_anchor))
    hidden = drafter._hidden(mx.array([[anchor, *masks]]), features, drafter.make_cache())
    if not config.sample_from_anchor:
        hidden = hidden[:, 1:]
    base = drafter._logits(hidden)
    previous = mx.concatenate([anchor_ids[:, None], tokens[:, :-1]], axis=1)
    corrected = mx.stack(
        [drafter.markov_head.apply_step_logits(base[:, k], previous[:, k]) for k in range(drafts)], axis=1
    )
    return dict(
        tokens=tokens, hidden=hidden, base=base, corrected=corrected,
        confidences=drafter.confidence(hidden, anchor_ids, tokens),
    )


def budget(params) -> dict:
    """Target layers up to the taps, the draft's layers; sums as long as the
    tap projection, the MLP or the attended context."""
    draft = params.spec.draft
    widths = [draft.hidden_size * len(draft.target_layer_ids), draft.intermediate_size, CAPACITY]
    return dict(layers=params.spec.target.num_layers + draft.num_layers, reduction=max(widths))


def assert_same_proposal(params, proposal, reference: dict, what: str) -> None:
    bound = budget(params)
    assert_fp32_close(proposal.hidden[0], reference["hidden"][0], f"{what}: block hidden", **bound)
    assert_fp32_close(proposal.base_logits[0], reference["base"][0], f"{what}: base logits", **bound)
    assert_fp32_close(proposal.logits[0], reference["corrected"][0], f"{what}: corrected logits", **bound)
    assert_fp32_close(
        mx.sigmoid(proposal.confidence_logits[0]), reference["confidences"][0], f"{what}: confidences", **bound
    )
    assert proposal.tokens[0].tolist() == reference["tokens"][0].tolist(), f"{what}: drafted tokens"


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, target, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    return request.param, *build_pair(root, target, draft_layout(**CASES[request.param]))


def test_block_matches_mlx_vlm(case):
    """After a prompt: our prefill + draft block against mlx-vlm's drafter on the prompt's features."""
    name, params, drafter = case
    prompt = random_prompt(np.random.default_rng(7), PROMPT_LENGTH, TARGET["vocab_size"])
    cache, first = dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, CAPACITY), prompt)
    proposal = dspark_fn.draft_block(params, cache, first)
    reference = mlx_vlm_block(drafter, target_features(params, prompt), first.item())
    assert_same_proposal(params, proposal, reference, name)


def test_incremental_context(case):
    """Context grown round by round (rejected rows written, then overwritten)
    drafts what mlx-vlm drafts from the whole committed context at once."""
    name, params, drafter = case
    prompt = random_prompt(np.random.default_rng(8), PROMPT_LENGTH, TARGET["vocab_size"])
    cache, tokens = dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, CAPACITY), prompt)
    sequence = prompt + tokens.tolist()
    for _ in range(3):
        cache, result = dspark_fn.speculate(params, cache, tokens)
        sequence += result.emitted[0, : result.count.item()].tolist()
        tokens = result.next_tokens
    committed = sequence[:-1]
    assert cache.length.item() == len(committed)
    proposal = dspark_fn.draft_block(params, cache, tokens)
    reference = mlx_vlm_block(drafter, target_features(params, committed), tokens.item())
    assert_same_proposal(params, proposal, reference, f"{name} after 3 rounds")


def test_runtime_width_sets_the_block():
    assert resolve_arch(draft_layout()).spec_from_config(draft_layout()).block_size == 5
    config = draft_layout(runtime_block_size=4)
    assert resolve_arch(config).spec_from_config(config).block_size == 3


def test_bonus_anchor_counts_the_anchor():
    config = draft_layout(block_size=6)
    config["dspark_bonus_anchor"] = True
    assert resolve_arch(config).spec_from_config(config).block_size == 5


def test_model_prefixed_checkpoint_loads(target, tmp_path):
    target_dir, _ = target
    config = draft_layout(attention_sink_bias=True)
    weights = draft_weights(config, seed=2)
    save_draft(tmp_path / "plain", config, weights)
    save_draft(tmp_path / "prefixed", config, {f"model.{key}": value for key, value in weights.items()})
    plain = dspark_fn.load(target_dir, tmp_path / "plain")
    prefixed = dspark_fn.load(target_dir, tmp_path / "prefixed")
    sink = "attention_sink_bias"
    assert mx.array_equal(plain.draft["layers"][1]["self_attn"][sink], prefixed.draft["layers"][1]["self_attn"][sink])
    assert mx.array_equal(plain.draft["fc"]["weight"], prefixed.draft["fc"]["weight"])


def test_missing_sink_weights_are_named(target, tmp_path):
    target_dir, _ = target
    weights = draft_weights(draft_layout(), seed=2)
    save_draft(tmp_path, draft_layout(attention_sink_bias=True), weights)
    with pytest.raises(ValueError, match="attention_sink_bias"):
        dspark_fn.load(target_dir, tmp_path)


def with_top(key, value):
    def change(config):
        config[key] = value
    return change


def with_dflash(key, value):
    def change(config):
        config["dflash_config"][key] = value
    return change


def without_dflash(key):
    def change(config):
        del config["dflash_config"][key]
    return change


BAD = {
    "projector": (with_dflash("projector_type", "mlp"), r"dflash_config\.projector_type 'mlp'"),
    "markov head": (with_dflash("markov_head_type", "gated"), r"dflash_config\.markov_head_type 'gated'"),
    "no markov": (with_dflash("markov_rank", 0), r"dflash_config\.markov_rank .* got 0"),
    "context window": (with_dflash("draft_window_size", 512), r"dflash_config\.draft_window_size 512"),
    "policy": (with_dflash("block_size_policy", "sometimes"), r"dflash_config\.block_size_policy 'sometimes'"),
    "runtime width": (with_dflash("runtime_block_size", 9), r"dflash_config\.runtime_block_size .* got 9"),
    "no block size": (without_dflash("block_size"), "needs block_size"),
    "causal flag": (with_dflash("causal", "yes"), r"dflash_config\.causal .* got 'yes'"),
    "layer type": (with_top("layer_types", ["full_attention", "chunked_attention"]), "chunked_attention"),
    "layer count": (with_top("layer_types", ["full_attention"]), r"layer_types \['full_attention'\]"),
    "no window": (with_top("layer_types", ["sliding_attention"] * 2), r"sliding_window .* got None"),
    "tiny window": (lambda config: (with_top("layer_types", ["sliding_attention"] * 2)(config),
                                    with_dflash("swa_window_size", 1)(config)),
                    r"dflash_config\.swa_window_size .* got 1"),
    "use_swa": (with_dflash("use_swa", True), r"dflash_config\.use_swa True"),
    "rope type": (with_top("rope_scaling", {"rope_type": "dynamic", "factor": 4.0}), "rope type 'dynamic'"),
    "yarn without its context": (with_top("rope_scaling", {"rope_type": "yarn", "factor": 4.0}),
                                 "rope type 'yarn' needs factor and original_max_position_embeddings"),
    "partial rope": (with_top("rope_parameters", {"rope_theta": 1e6, "partial_rotary_factor": 0.25}),
                     "partial_rotary_factor 0.25"),
    "activation": (with_top("hidden_act", "gelu"), "hidden_act 'gelu'"),
    "bias": (with_top("attention_bias", True), "attention_bias True"),
    "draft vocabulary": (with_top("draft_vocab_size", 64), "draft_vocab_size 64"),
    "taps": (with_dflash("target_layer_ids", [3, 1]), r"dflash_config\.target_layer_ids \[3, 1\]"),
    "geometry": (lambda config: config.pop("head_dim"), r"lacks \['head_dim'\]"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_settings_are_refused(name):
    change, message = BAD[name]
    config = json.loads(json.dumps(draft_layout()))
    change(config)
    with pytest.raises(ValueError, match=message):
        resolve_arch(config).spec_from_config(config)


def test_layout_is_chosen_by_dflash_config():
    config = draft_layout()
    config["model_type"] = "lfm2"
    assert resolve_arch(config) is dflash.ARCH


def bigram_draft(directory: Path, model, config: dict):
    """A draft whose Markov head holds the target's next-token logits after a
    fixed context and each token (so its drafts are often right) and whose
    backbone, kept small by its final norm, still moves every proposal."""
    vocab = TARGET["vocab_size"]
    context = [5, 17, 42]
    table = model(mx.array([context + [token] for token in range(vocab)]))[:, -1, :].astype(mx.float32)
    weights = draft_weights(config, seed=4)
    weights["markov_head.markov_w1.weight"] = mx.eye(vocab)
    weights["markov_head.markov_w2.weight"] = table.T
    weights["norm.weight"] = weights["norm.weight"] * 0.05
    return save_draft(directory, config, weights)


def test_generate_equals_target_greedy(tmp_path):
    """Every option at once, 100 tokens: ``generate`` equals mlx-lm greedy on the target."""
    model = build_target(tmp_path / "target", TARGET, seed=5, vector_spread=0.4)
    damp_attention(tmp_path / "target", model, 0.03)
    config = draft_layout(markov_rank=TARGET["vocab_size"], **CASES["everything"])
    bigram_draft(tmp_path / "draft", model, config)
    params = dspark_fn.load(tmp_path / "target", tmp_path / "draft")
    prompt = random_prompt(np.random.default_rng(9), 13, TARGET["vocab_size"])
    events = list(dspark_fn.generate(params, prompt, 100, width=None))
    assert [t for e in events for t in e.emitted] == mlx_lm_greedy(model, prompt, 100)
    rounds = [e for e in events if e.kind == "round"]
    assert sum(e.accepted for e in rounds) > 10  # drafts were accepted ...
    assert any(e.accepted < len(e.drafted) for e in rounds)  # ... and rejected


# ---- whole loops on hybrid targets against mlx-vlm's DSpark loop

HYBRID_DRAFTS = 4  # drafts per round; mlx-vlm verifies them with the anchor (width 5)
HYBRID_TOKENS = 48
# the hybrid families mlx-vlm loads as the same model mlx-lm builds (lfm2_moe: see the module docstring)
MLX_VLM_HYBRIDS = ("lfm2", "nemotron_h", "qwen3_5", "qwen3_5_moe")
MARKOV_CERTAINTY = 20.0  # a Markov logit far above the damped backbone's (under 1 on these targets)


def hybrid_layout(config: dict) -> dict:
    """A fixed-width ``dflash_config`` draft for the hybrid target ``config``
    (its vocabulary, width and depth; taps on its first and last-but-one layers)."""
    layers, vocab = config["num_hidden_layers"], config["vocab_size"]
    layout = draft_layout(
        block_size=HYBRID_DRAFTS, markov_rank=vocab, target_layer_ids=[0, layers - 2],
        num_target_layers=layers, mask_token_id=vocab - 1,
    )
    layout.update(vocab_size=vocab, hidden_size=config["hidden_size"])
    return layout


def successor_draft(directory: Path, config: dict, stream: list, seed: int):
    """A draft whose Markov head proposes, after a token, the token that first
    follows it in the target's greedy ``stream``, for three tokens in four
    (the others, and tokens followed differently later, are drafted wrong),
    and whose backbone, kept small by its final norm, decides every other
    proposal. A bigram table of the target, as above, is rarely right on a
    random hybrid target: its next token depends on its recurrent state."""
    vocab = config["vocab_size"]
    successors = {}
    for token, following in zip(stream, stream[1:]):
        successors.setdefault(token, following)
    rng = np.random.default_rng(seed)
    table = np.zeros((vocab, vocab), np.float32)
    for token, following in successors.items():
        if rng.random() < 0.75:
            table[token, following] = MARKOV_CERTAINTY
    layout = hybrid_layout(config)
    weights = draft_weights(layout, seed)
    weights["markov_head.markov_w1.weight"] = mx.eye(vocab)
    weights["markov_head.markov_w2.weight"] = mx.array(table.T)
    weights["norm.weight"] = weights["norm.weight"] * 0.05
    return save_draft(directory, layout, weights)


def mlx_vlm_target(directory: Path, config: dict):
    """mlx-vlm's model of the mlx-lm target saved in ``directory``. qwen3_5
    families load from their release layout: the mlx-lm config as
    ``text_config`` (the parameters are already ``language_model.``-prefixed),
    whose RoPE mlx-vlm reads as multimodal; a text position is the same on
    every axis, so every rotated pair on the first axis gives plain RoPE."""
    from mlx_vlm.utils import load_model

    if not config["model_type"].startswith("qwen3_5"):
        return load_model(directory)
    text = json.loads(json.dumps(config))
    rope = text["rope_parameters"]
    rotated_pairs = int(text["head_dim"] * rope["partial_rotary_factor"]) // 2
    rope.setdefault("mrope_section", [rotated_pairs, 0, 0])
    release = directory.parent / "release"
    release.mkdir()
    (release / "config.json").write_text(json.dumps(
        {"model_type": config["model_type"], "text_config": text, "tie_word_embeddings": config["tie_word_embeddings"]}
    ))
    (release / "model.safetensors").symlink_to(directory / "model.safetensors")
    return load_model(release)


def mlx_vlm_loop(target, draft_dir: Path, prompt: list, n: int):
    """mlx-vlm's greedy DSpark loop: its ``n`` tokens and, per round, the drafted tokens and how many were accepted."""
    from mlx_vlm.generate.ar import generate_step
    from mlx_vlm.speculative.drafters import load_drafter

    drafter, kind = load_drafter(str(draft_dir))
    assert kind == "dflash" and drafter.prefer_requested_block_size  # fixed width from block_size_policy
    drafted, draft_block = [], drafter.draft_block

    def recorded_draft_block(*args, **kwargs):
        tokens = draft_block(*args, **kwargs)
        drafted.append(tokens[0].tolist())
        return tokens

    drafter.draft_block = recorded_draft_block
    steps = generate_step(
        mx.array([prompt]), target, None, None, max_tokens=n, temperature=0.0,
        draft_model=drafter, draft_kind=kind, draft_block_size=HYBRID_DRAFTS + 1,
    )
    tokens = [int(token) for token, _ in steps]
    return tokens, list(zip(drafted, (int(a) for a in drafter.accept_lens)))


@pytest.mark.parametrize("family", MLX_VLM_HYBRIDS)
def test_hybrid_generate_equals_mlx_vlm_loop(family, tmp_path):
    """On a tiny hybrid target: ``generate`` at fixed width, mlx-vlm's DSpark
    loop and mlx-lm greedy write the same tokens, and every full-width round
    drafts and accepts what mlx-vlm's does (its last rounds narrow to the
    tokens left; ours keep the width and drop the surplus)."""
    config = HYBRID_SHAPES[family]
    model = build_target(tmp_path / "target", config, seed=3, vector_spread=0.4)
    prompt = random_prompt(np.random.default_rng(9), 13, config["vocab_size"])
    greedy = mlx_lm_greedy(model, prompt, HYBRID_TOKENS)
    successor_draft(tmp_path / "draft", config, greedy, seed=4)
    params = dspark_fn.load(tmp_path / "target", tmp_path / "draft")
    events = list(dspark_fn.generate(params, prompt, HYBRID_TOKENS, width=None))
    target = mlx_vlm_target(tmp_path / "target", config)
    tokens, theirs = mlx_vlm_loop(target, tmp_path / "draft", prompt, HYBRID_TOKENS)

    assert [t for e in events for t in e.emitted] == greedy, "ours against mlx-lm greedy"
    assert tokens == greedy, "mlx-vlm's loop against mlx-lm greedy"
    full = [r for r in theirs if len(r[0]) == HYBRID_DRAFTS]
    # a round narrows only when fewer than a full round's tokens are left, and each emits one or more
    assert theirs[: len(full)] == full and len(full) >= len(theirs) - (HYBRID_DRAFTS - 1)
    ours = [(e.drafted, e.accepted) for e in events if e.kind == "round"]
    assert len(ours) >= len(full)
    for r, (mine, reference) in enumerate(zip(ours, full)):
        assert mine == reference, f"round {r}: (drafted, accepted)"
    accepted = [a for _, a in full]
    assert sum(accepted) >= 10  # drafts were accepted ...
    assert any(0 < a < HYBRID_DRAFTS for a in accepted)  # ... and cut short, the state kept mid-round
