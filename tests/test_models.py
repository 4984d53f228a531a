"""Loading by name (aliases, hub cache, local paths) and quantized drafts."""

import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import dspark_fn
from dspark_fn import catalog
from dspark_fn.hub import HubError, fetch
from dspark_fn.quantize import quantize_draft
from helpers import build_draft, build_target, draft_config, mlx_lm_greedy, random_prompt, speculative_tokens, target_config


def populate_hub_cache(cache: Path, repo_id: str, source: Path) -> None:
    """Lay out ``source`` as huggingface-hub's cache would after a download."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(source, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)


@pytest.fixture()
def offline_hub(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_hub_ids_load_from_a_prepopulated_cache_offline(offline_hub, parity_dir):
    populate_hub_cache(offline_hub, "acme/tiny-target", parity_dir / "qwen3_tiny" / "target")
    populate_hub_cache(offline_hub, "acme/tiny-draft", parity_dir / "qwen3_tiny" / "draft")
    params, tokenizer, config = catalog.load_named("acme/tiny-target", "acme/tiny-draft")
    assert config["model_type"] == "qwen3"
    reference = dspark_fn.load(parity_dir / "qwen3_tiny" / "target", parity_dir / "qwen3_tiny" / "draft")
    prompt = [5, 6, 7, 8]
    assert speculative_tokens(params, prompt, 20) == speculative_tokens(reference, prompt, 20)
    assert tokenizer is None


def test_offline_missing_repo_names_repo_token_and_local_paths(offline_hub):
    with pytest.raises(HubError) as error:
        fetch("deepseek-ai/dspark_qwen3_4b_block7", "draft")
    message = str(error.value)
    assert "deepseek-ai/dspark_qwen3_4b_block7" in message
    assert "HF_TOKEN" in message and "local directory" in message and "offline" in message


def test_alias_implies_its_draft():
    assert catalog.resolve("qwen3-4b", None) == ("Qwen/Qwen3-4B", "deepseek-ai/dspark_qwen3_4b_block7")
    assert catalog.resolve("qwen3-4b", "my/draft") == ("Qwen/Qwen3-4B", "my/draft")
    assert catalog.resolve(None, None)[0] == catalog.ALIASES[catalog.DEFAULT_ALIAS].target


def test_unknown_model_without_draft_is_a_clear_error():
    with pytest.raises(ValueError, match=r"no DSpark draft is known for 'org/some-model': pass --draft"):
        catalog.resolve("org/some-model", None)


def test_not_a_path_nor_a_repo():
    with pytest.raises(HubError, match="neither an existing local path nor a hub repository id"):
        fetch("./no/such/dir/here", "model")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    config = target_config("qwen3", vocab=256, hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16)
    model = build_target(root / "target", config, seed=3)
    build_draft(root / "draft", draft_config(config, taps=(0, 2), block_size=4), seed=3)
    return model, dspark_fn.load(root / "target", root / "draft")


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_draft_stays_lossless(pair, bits):
    model, params = pair
    quantized = params._replace(draft=quantize_draft(params.draft, bits))
    layer = quantized.draft["layers"][0]["mlp"]["up_proj"]
    assert layer["weight"].dtype == mx.uint32 and "scales" in layer
    assert "scales" not in quantized.draft["markov_head"]["markov_w2"]
    prompt = random_prompt(np.random.default_rng(bits), 12, 256)
    assert speculative_tokens(quantized, prompt, 100) == mlx_lm_greedy(model, prompt, 100)


def test_quantized_draft_changes_only_draft_numerics(pair):
    _, params = pair
    cache, tokens = dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, 256), [1, 2, 3, 4, 5])
    full = dspark_fn.draft_block(params, cache, tokens)
    quantized = dspark_fn.draft_block(params._replace(draft=quantize_draft(params.draft, 8)), cache, tokens)
    error = mx.abs(full.base_logits - quantized.base_logits).max().item()
    assert 0 < error < 0.1 * mx.abs(full.base_logits).max().item()


def test_bad_bit_width(pair):
    with pytest.raises(ValueError, match="4 or 8 bits"):
        quantize_draft(pair[1].draft, 3)


def test_a_pair_too_large_for_the_machine_is_refused_before_downloading(monkeypatch):
    import dspark_fn.hub

    monkeypatch.setattr(catalog, "machine_memory_gb", lambda: 16.0)
    monkeypatch.setattr(dspark_fn.hub, "fetch", lambda *a, **k: pytest.fail("fetched before the memory check"))
    with pytest.raises(ValueError, match=r"qwen3-8b needs about 21 GB of memory \(21 GB to download\); this machine has 16 GB"):
        catalog.load_named("qwen3-8b")


def test_models_lists_sizes_and_whether_each_pair_fits(capsys, monkeypatch):
    from dspark_fn.cli import main

    monkeypatch.setattr(catalog, "machine_memory_gb", lambda: 24.0)
    assert main(["models"]) == 0
    listing = capsys.readouterr().out
    assert "download 10.9 GB, memory about 11.5 GB: fits this machine" in listing
    assert "download 35.7 GB, memory about 36.5 GB: does NOT fit this machine (24 GB)" in listing
