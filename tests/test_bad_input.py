"""Bad input fails loudly, naming the problem."""

import json
import shutil

import mlx.core as mx
import pytest

import dspark_fn
from dspark_fn.checkpoints import save_draft


@pytest.fixture()
def case(parity_dir, tmp_path):
    """A writable copy of the qwen3 fixture."""
    root = tmp_path / "case"
    shutil.copytree(parity_dir / "qwen3_tiny" / "target", root / "target")
    shutil.copytree(parity_dir / "qwen3_tiny" / "draft", root / "draft")
    return root


def edit_config(directory, **changes):
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def edit_weights(directory, edit):
    weights = dict(mx.load(str(directory / "model.safetensors")))
    edit(weights)
    save_draft(directory, json.loads((directory / "config.json").read_text()), weights)


def load(case):
    return dspark_fn.load(case / "target", case / "draft")


def test_vocabulary_mismatch(case):
    edit_config(case / "draft", vocab_size=1024)
    with pytest.raises(ValueError, match=r"vocab_size 1024 != target's 512"):
        load(case)


def test_hidden_size_mismatch(case):
    edit_config(case / "draft", hidden_size=96)
    with pytest.raises(ValueError, match=r"hidden_size 96 != target's 64"):
        load(case)


@pytest.mark.parametrize("taps", [[1, 3, 7], [1, -1, 5], [1, 3, 12]])
def test_target_layer_ids_out_of_range(case, taps):
    edit_config(case / "draft", target_layer_ids=taps)
    with pytest.raises(ValueError, match=r"target_layer_ids .* out of range"):
        load(case)


def test_missing_checkpoint_key(case):
    edit_weights(case / "draft", lambda w: w.pop("layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing \['layers.1.mlp.up_proj.weight'\]"):
        load(case)


def test_unexpected_checkpoint_key(case):
    edit_weights(case / "draft", lambda w: w.update({"layers.2.mlp.up_proj.weight": mx.zeros((2, 2))}))
    with pytest.raises(ValueError, match=r"unexpected \['layers.2.mlp.up_proj.weight'\]"):
        load(case)


def test_wrong_tensor_shape(case):
    edit_weights(case / "draft", lambda w: w.update({"fc.weight": mx.zeros((64, 128))}))
    with pytest.raises(ValueError, match=r"fc.weight \(64, 128\) \(expected \(64, 192\)\)"):
        load(case)


def test_unknown_draft_model_type(case):
    edit_config(case / "draft", model_type="mamba")
    with pytest.raises(ValueError, match=r"unknown draft model_type 'mamba'"):
        load(case)


def test_unknown_target_model_type(case):
    edit_config(case / "target", model_type="mamba")
    with pytest.raises(ValueError, match=r"unknown target model_type 'mamba'"):
        load(case)


def test_not_a_dspark_draft(case):
    config = json.loads((case / "draft" / "config.json").read_text())
    del config["block_size"]
    (case / "draft" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"lacks DSpark keys \['block_size'\]"):
        load(case)


def test_missing_directory(tmp_path, case):
    with pytest.raises(FileNotFoundError, match=r"draft directory .* has no config.json"):
        dspark_fn.load(case / "target", tmp_path / "nowhere")


def test_prompt_longer_than_capacity(case):
    params = load(case)
    with pytest.raises(ValueError, match=r"prompt of 300 tokens does not fit the cache capacity 256"):
        dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, 256), [1] * 300)
    with pytest.raises(ValueError, match=r"exceeds the cache capacity 256"):
        list(dspark_fn.generate(params, [1] * 200, 100, capacity=256))


def test_a_cache_without_room_is_refused_and_left_untouched(case):
    """Only row 1 lacks the room for a width-8 verify: the call raises, names
    that row, and the cache it was given still decodes as before; a width
    the policy chooses stays within the room, until a row has none."""
    params = load(case)
    cache, tokens = dspark_fn.prefill(params, dspark_fn.init_cache(params, 2, 64), [[1, 2, 3], [4] * 60])
    with pytest.raises(ValueError, match=r"cache row\(s\) \[1\] have \[4\] free slot\(s\) but a verify of width 8"):
        dspark_fn.speculate(params, cache, tokens, width=8)
    with pytest.raises(ValueError, match=r"grow the cache first"):
        dspark_fn.verify_block(params, cache, mx.array([[1] * 8, [2] * 8], mx.int32))
    cache, result = dspark_fn.speculate(params, cache, tokens, width=4)  # fits: 4 free slots
    assert cache.length.tolist()[1] == 60 + result.count.tolist()[1]
    chosen, tokens = cache, result.next_tokens
    while int(chosen.length[1]) < 64:
        free = 64 - int(chosen.length[1])
        chosen, step = dspark_fn.speculate(params, chosen, tokens)
        assert step.emitted.shape[1] <= free
        tokens = step.next_tokens
    with pytest.raises(ValueError, match=r"cache row\(s\) \[1\] have \[0\] free slot\(s\).*grow the cache first"):
        dspark_fn.speculate(params, chosen, tokens)
    grown = dspark_fn.grow_cache(params, cache, 128)
    assert grown.capacity == 128 and grown.length.tolist() == cache.length.tolist()
    dspark_fn.speculate(params, grown, result.next_tokens)


def test_bad_prompts(case):
    params = load(case)
    cache = dspark_fn.init_cache(params, 1, 256)
    with pytest.raises(ValueError, match="prompt is empty"):
        dspark_fn.prefill(params, cache, [])
    with pytest.raises(ValueError, match=r"token ids must be in 0..511"):
        dspark_fn.prefill(params, cache, [3, 512])
    with pytest.raises(ValueError, match=r"2 prompts for a cache of batch size 1"):
        dspark_fn.prefill(params, cache, [[1, 2], [3]])


def test_bad_verify_width(case):
    params = load(case)
    cache, tokens = dspark_fn.prefill(params, dspark_fn.init_cache(params, 1, 256), [1, 2, 3])
    with pytest.raises(ValueError, match=r"verify width 9 must be in 1..8"):
        dspark_fn.speculate(params, cache, tokens, width=9)


def test_draft_family_mismatch(case):
    edit_config(case / "draft", target_model_type="gemma4", target_text_model_type="gemma4_text")
    with pytest.raises(ValueError, match=r"draft was trained for a gemma4_text target, not 'qwen3'"):
        load(case)
