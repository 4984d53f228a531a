"""Parity with the DeepSpec reference traces in ../shared/parity/qwen3_tiny."""

import json

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file

import dspark_fn

TOL = 1e-3


@pytest.fixture(scope="module")
def case(parity_dir):
    root = parity_dir / "qwen3_tiny"
    params = dspark_fn.load(root / "target", root / "draft")
    traces = {
        mode: (load_file(str(root / f"{name}.safetensors")), json.loads((root / f"{name}.json").read_text()))
        for mode, name in (("natural", "trace"), ("forced", "trace_forced"))
    }
    return params, traces


def close(actual, expected, what):
    actual = np.asarray(actual)
    assert actual.shape == expected.shape, what
    err = np.abs(actual - expected).max()
    assert err <= TOL, f"{what}: max |diff| {err:.2e} > {TOL}"


def test_prefill_matches_reference(case):
    params, traces = case
    tensors, meta = traces["natural"]
    spec = params.spec
    kv = spec.target_adapter.init_kv(spec.target, 1, 64)
    prompt = mx.array([meta["prompt_ids"]])
    hidden, features, _ = spec.target_adapter.forward(
        spec.target, params.target, kv, prompt, mx.array([0]), spec.taps
    )
    close(spec.target_adapter.logits(spec.target, params.target, hidden)[0], tensors["prefill_logits"], "prefill logits")
    close(features[0], tensors["prefill_features"], "prefill features")
    cache, first = dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, 128), meta["prompt_ids"])
    assert first.tolist() == [meta["first_token"]]
    assert cache.length.tolist() == [meta["prompt_len"]]


@pytest.mark.parametrize("mode", ["natural", "forced"])
def test_rounds_match_reference(case, mode):
    """Replay the recorded verify inputs; every round's draft outputs and
    verify decisions must equal the reference."""
    params, traces = case
    tensors, meta = traces[mode]
    cache, tokens = dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, 128), meta["prompt_ids"])
    emitted = list(tokens.tolist())
    for r, recorded in enumerate(meta["rounds"]):
        assert tokens.tolist() == [recorded["anchor_token"]], f"round {r} anchor"
        assert cache.length.tolist() == [recorded["anchor_pos"]], f"round {r} position"
        proposal = dspark_fn.draft_block(params, cache, tokens)
        close(proposal.hidden[0], tensors["block_hidden"][r], f"round {r} block hidden")
        close(proposal.base_logits[0], tensors["base_logits"][r], f"round {r} base logits")
        close(proposal.logits[0], tensors["corrected_logits"][r], f"round {r} corrected logits")
        close(proposal.confidence_logits[0], tensors["confidence_logits"][r], f"round {r} confidence logits")
        close(mx.sigmoid(proposal.confidence_logits[0]), tensors["confidences"][r], f"round {r} confidences")
        assert proposal.tokens[0].tolist() == recorded["draft_tokens"], f"round {r} drafted tokens"

        block = mx.array([recorded["verify_input_ids"]], mx.int32)
        cache, result = dspark_fn.verify_block(params, cache, block)
        assert result.accepted.tolist() == [recorded["accepted"]], f"round {r} accepted"
        count = result.count.item()
        assert result.emitted[0, :count].tolist() == recorded["emitted"], f"round {r} emitted"
        tokens = result.next_tokens
        emitted += recorded["emitted"]
    assert emitted == meta["output_tokens"]
    if mode == "forced":
        # the forced schedule exercises every acceptance length 0..block_size
        assert {r["accepted"] for r in meta["rounds"]} == set(range(meta["block_size"] + 1))


def test_natural_generation_matches_reference(case):
    params, traces = case
    _, meta = traces["natural"]
    events = list(dspark_fn.generate(params, meta["prompt_ids"], len(meta["output_tokens"])))
    assert [t for e in events for t in e.emitted] == meta["output_tokens"]
    rounds = [e for e in events if e.kind == "round"]
    assert [e.drafted for e in rounds] == [r["draft_tokens"] for r in meta["rounds"]]
    assert [e.accepted for e in rounds] == [r["accepted"] for r in meta["rounds"]]


def test_draft_context_cache_matches_reference(case):
    """Draft context K/V after rounds 0 and 1 equal the reference cache (context rows only)."""
    params, traces = case
    tensors, meta = traces["forced"]
    cache, tokens = dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, 128), meta["prompt_ids"])
    for r in range(2):
        block = mx.array([meta["rounds"][r]["verify_input_ids"]], mx.int32)
        expected_k, expected_v = tensors[f"debug.r{r}.cache_k"], tensors[f"debug.r{r}.cache_v"]
        # The reference cache holds context up to this round's anchor position.
        length = expected_k.shape[2]
        assert cache.length.item() == length
        for layer, (keys, values) in enumerate(cache.draft):
            close(keys[0, :, :length], expected_k[layer], f"round {r} layer {layer} keys")
            close(values[0, :, :length], expected_v[layer], f"round {r} layer {layer} values")
        cache, result = dspark_fn.verify_block(params, cache, block)
