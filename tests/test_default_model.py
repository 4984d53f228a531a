"""The embedded default (SmolLM2-135M-Instruct GGUF + bundled draft) through the tools a person meets."""

import json
import subprocess
import sys


from dspark_fn.catalog import DEFAULT_DRAFT
from helpers import missing_prerequisite

try:
    from dspark_fn.gguf import find_smollm2_gguf

    find_smollm2_gguf()
except FileNotFoundError as missing:
    missing_prerequisite(str(missing), module_level=True)


def dspark(*args):
    result = subprocess.run([sys.executable, "-m", "dspark_fn.cli", *map(str, args)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    return result


def test_default_draft_ships_small():
    size = sum(f.stat().st_size for f in DEFAULT_DRAFT.iterdir())
    assert size <= 30 * 2**20
    assert {f.name for f in DEFAULT_DRAFT.iterdir()} >= {"config.json", "model.safetensors"}


def test_generate_with_no_flags_answers_offline():
    result = dspark("generate", "What is the capital of France?", "--max-tokens", 24)
    assert "Paris" in result.stdout
    assert "<|im_end|>" not in result.stdout
    assert "tau" in result.stderr


def test_bench_json_compares_side_by_side():
    out = json.loads(dspark("bench", "--dataset", "gsm8k", "--n", 1, "--max-tokens", 12,
                            "--repeats", 1, "--json").stdout)
    for key in ("baseline_tokens_per_s", "dspark_tokens_per_s", "speedup", "tau", "per_slot_acceptance",
                "draft_ms_per_round", "verify_ms_per_round"):
        assert key in out, key
    assert out["identical"] is True
    assert out["tau"] >= 1


def test_eval_json_reports_acceptance():
    """The reference protocol verifies the whole block every round."""
    out = json.loads(dspark("eval", "--dataset", "mt-bench", "--n", 2, "--max-tokens", 12, "--width", 6,
                            "--json").stdout)
    assert out["prompts"] == 2 and out["rounds"] > 0
    assert 1 <= out["tau"] <= 6 and 0 < out["verify_rate"] <= 1
    assert len(out["per_slot_acceptance"]) == 5


def test_models_lists_the_published_pairs():
    listing = dspark("models").stdout
    for alias in ("qwen3-4b", "qwen3-8b", "qwen3-14b", "gemma4-12b", "smollm2-135m"):
        assert alias in listing
    assert "deepseek-ai/dspark_qwen3_4b_block7" in listing
