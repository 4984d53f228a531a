"""Checkpoints load as published: multimodal releases run on their text model,
and every alias resolves, offline from a hub cache, to tiny stand-ins written
in its release's exact file layout (``tests/published.py``); RadixArk's
Qwen3.8 draft (YaRN RoPE) drafts as mlx-vlm's DSpark drafter does; a machine
too small for a big pair is refused before anything is fetched.

Breaks tried, each restored (the test that caught it):
- YaRN's attention factor not folded into q_norm / k_norm:
  test_radixark_yarn_draft_proposes_as_mlx_vlm;
- YaRN's frequencies left uninterpolated (the rope read as ``default``): the same;
- the attention factor applied twice (q_norm and k_norm each scaled by its square): the same;
- ``lfm2.5-8b-a1b``'s memory figure below 16 GB, ``qwen3.8-27b``'s below 48 GB:
  test_a_big_hybrid_pair_is_refused_on_a_small_machine;
- the dflash reader ignoring the top-level DSpark fields (block_size,
  markov_rank: only ``dflash_config`` read): test_alias_runs_offline_from_its_published_layout
  for every LFM2.5 alias and qwen3.8-27b;
- LFM2's short-conv gates swapped (B for C): the same, the LFM2.5 aliases;
- Qwen3.5 attention rotating whole heads (partial_rotary_factor ignored): the same, qwen3.8-27b.
"""

import re

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import dspark_fn
from dspark_fn import catalog, checkpoints
from helpers import mlx_lm_greedy, random_prompt, speculative_tokens
from numerics import assert_fp32_close
from published import ALIAS_STANDINS, populate_hub_cache, write_multimodal_gemma4
from test_dflash_draft import CAPACITY, budget, mlx_vlm_block, mlx_vlm_drafter, target_features

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
    """``dspark_fn.catalog.load_named(alias)`` with only a hub cache holding
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
    monkeypatch.setattr(catalog, "machine_memory_gb", lambda: 1024.0)  # the stand-ins are tiny
    stored, _, _ = catalog.load_named(alias)
    assert {value.dtype for _, value in tree_flatten(stored.target)} == {mx.bfloat16}
    # Both sides compute in float32: bf16 rounding (its order differs between
    # any two kernels) would otherwise decide near-ties of a random model.
    params, tokenizer, _ = catalog.load_named(alias, dtype=mx.float32)
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": "hello world"}], add_generation_prompt=True))
    reference, _ = load_model(snapshots["target"])
    reference.set_dtype(mx.float32)
    assert speculative_tokens(params, prompt, 30) == mlx_lm_greedy(reference, prompt, 30)


def test_radixark_yarn_draft_proposes_as_mlx_vlm(tmp_path):
    """The Qwen3.8 stand-in's draft (YaRN: slow frequencies interpolated 32x,
    q and k scaled by 0.1 ln 32 + 1) drafts, after a 40-token prompt (the
    interpolated frequencies turn), the hidden states, logits and tokens
    mlx-vlm's DSpark drafter drafts from the same target features."""
    from mlx_lm.utils import load_model

    ALIAS_STANDINS["qwen3.8-27b"](tmp_path / "target", tmp_path / "draft")
    config, target_params, _ = catalog.load_target_named(str(tmp_path / "target"), dtype=mx.float32)
    params = checkpoints.pair_with_draft(config, target_params, tmp_path / "draft")
    reference, _ = load_model(tmp_path / "target")
    reference.set_dtype(mx.float32)
    drafter = mlx_vlm_drafter(tmp_path / "draft", reference)
    drafter.set_dtype(mx.float32)  # as ours: the bf16 release computed in float32
    prompt = random_prompt(np.random.default_rng(5), 40, config["vocab_size"])
    cache, first = dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, CAPACITY), prompt)
    proposal = dspark_fn.draft_block(params, cache, first)
    expected = mlx_vlm_block(drafter, target_features(params, prompt), first.item())
    bound = budget(params)
    assert_fp32_close(proposal.hidden[0], expected["hidden"][0], "block hidden", **bound)
    assert_fp32_close(proposal.base_logits[0], expected["base"][0], "base logits", **bound)
    assert_fp32_close(proposal.logits[0], expected["corrected"][0], "corrected logits", **bound)
    assert proposal.tokens[0].tolist() == expected["tokens"][0].tolist()


@pytest.mark.parametrize("alias, machine_gb", [("lfm2.5-8b-a1b", 16.0), ("qwen3.8-27b", 48.0)])
def test_a_big_hybrid_pair_is_refused_on_a_small_machine(alias, machine_gb, monkeypatch):
    import dspark_fn.hub

    monkeypatch.setattr(catalog, "machine_memory_gb", lambda: machine_gb)
    monkeypatch.setattr(dspark_fn.hub, "fetch", lambda *a, **k: pytest.fail("fetched before the memory check"))
    needs = f"{catalog.ALIASES[alias].memory_gb:.0f} GB"
    with pytest.raises(ValueError, match=rf"{re.escape(alias)} needs about {needs} of memory"):
        catalog.load_named(alias)
    monkeypatch.setattr(catalog, "machine_memory_gb", lambda: catalog.ALIASES[alias].memory_gb + 1)
    catalog.check_fits(alias)
