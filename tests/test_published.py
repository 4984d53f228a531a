"""Checkpoints load as published: multimodal releases run on their text model,
and every alias resolves, offline from a hub cache, to tiny stand-ins written
in its release's exact file layout (``tests/published.py``)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import dspark_fn
from dspark_fn import models
from helpers import mlx_lm_greedy, random_prompt, speculative_tokens
from published import ALIAS_STANDINS, populate_hub_cache, write_multimodal_gemma4

pytestmark = pytest.mark.numerics


@pytest.mark.parametrize("model_type", ["gemma4", "gemma4_unified"])
def test_gemma4_multimodal_layout_runs_its_text_model(parity_dir, tmp_path, model_type):
    """The gemma4 parity target rewritten as a multimodal release (text model
    under ``text_config`` and ``model.language_model.*``, vision and audio
    towers beside it) decodes exactly as the text-only original and as
    mlx-lm's own loader of the same directory; the towers are not loaded."""
    from mlx_lm.utils import load_model

    case = parity_dir / "gemma4_tiny"
    wrapped = write_multimodal_gemma4(case / "target", tmp_path / "release", model_type)
    params = dspark_fn.load(wrapped, case / "draft")
    original = dspark_fn.load(case / "target", case / "draft")
    assert not any("vision" in key or "audio" in key for key, _ in tree_flatten(params.target))
    reference, _ = load_model(wrapped)
    prompt = random_prompt(np.random.default_rng(0), 9, params.spec.target.vocab_size)
    expected = mlx_lm_greedy(reference, prompt, 40)
    assert speculative_tokens(params, prompt, 40) == expected == speculative_tokens(original, prompt, 40)


@pytest.mark.parametrize("alias", sorted(ALIAS_STANDINS))
def test_alias_runs_offline_from_its_published_layout(alias, tmp_path, monkeypatch):
    """``dspark_fn.models.load_named(alias)`` with only a hub cache holding
    stand-ins of the alias's two repositories: greedy DSpark output of a
    chat prompt equals mlx-lm's greedy decoding of the stand-in target."""
    from mlx_lm.utils import load_model

    cache = tmp_path / "hub"
    snapshots = populate_hub_cache(cache, alias)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(models, "machine_memory_gb", lambda: 1024.0)  # the stand-ins are tiny
    stored, _, _ = models.load_named(alias)
    assert {value.dtype for _, value in tree_flatten(stored.target)} == {mx.bfloat16}
    # Both sides compute in float32: bf16 rounding (its order differs between
    # any two kernels) would otherwise decide near-ties of a random model.
    params, tokenizer, _ = models.load_named(alias, dtype=mx.float32)
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": "hello world"}], add_generation_prompt=True))
    reference, _ = load_model(snapshots["target"])
    reference.set_dtype(mx.float32)
    assert speculative_tokens(params, prompt, 30) == mlx_lm_greedy(reference, prompt, 30)
