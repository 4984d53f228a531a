"""gemma4 draft specifics beyond the shared parity tests (tests/test_parity.py)."""

import json

import pytest

from dspark_fn.drafts import resolve_arch
from helpers import load_parity_case


def test_draft_has_no_value_projection_when_k_eq_v(parity_dir):
    params, _ = load_parity_case(parity_dir / "gemma4_tiny")
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
