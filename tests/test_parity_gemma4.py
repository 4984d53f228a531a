"""Parity with the DeepSpec reference traces in ../shared/parity/gemma4_tiny.

The fixture's target mixes sliding and full-attention layers with K=V full
layers, a softcap and non-unit ``layer_scalar``s; its draft uses the target's
full-attention geometry and carries the stray top-level rope keys that
transformers adds to a draft config.
"""

import json

import pytest

from dspark_fn.drafts import resolve_arch
from helpers import (
    check_draft_context_cache,
    check_natural_generation,
    check_prefill,
    check_rounds,
    load_parity_case,
)


@pytest.fixture(scope="module")
def case(parity_dir):
    return load_parity_case(parity_dir / "gemma4_tiny")


def test_prefill_matches_reference(case):
    params, traces = case
    check_prefill(params, *traces["natural"])


@pytest.mark.parametrize("mode", ["natural", "forced"])
def test_rounds_match_reference(case, mode):
    params, traces = case
    check_rounds(params, *traces[mode])


def test_natural_generation_matches_reference(case):
    params, traces = case
    check_natural_generation(params, traces["natural"][1])


def test_draft_context_cache_matches_reference(case):
    params, traces = case
    check_draft_context_cache(params, *traces["forced"])


def test_draft_has_no_value_projection_when_k_eq_v(case):
    params, _ = case
    assert params.spec.draft.attention.k_eq_v
    assert all("v_proj" not in layer["self_attn"] for layer in params.draft["layers"])


@pytest.mark.parametrize(
    "override, message",
    [
        ({"enable_moe_block": True}, "MoE"),
        ({"hidden_size_per_layer_input": 256}, "per-layer inputs"),
        ({"use_bidirectional_attention": "all"}, "bidirectional"),
    ],
)
def test_unsupported_draft_configs_are_rejected(parity_dir, override, message):
    config = json.loads((parity_dir / "gemma4_tiny" / "draft" / "config.json").read_text())
    config.update(override)
    with pytest.raises(ValueError, match=message):
        resolve_arch(config).spec_from_config(config)
