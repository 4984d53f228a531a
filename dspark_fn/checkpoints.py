"""Checkpoints on disk -> (spec, parameter pytree), with errors that say what is wrong."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from . import atomic, microscaling, ops
from .drafts import resolve_arch
from .drafts.heads import DRAFT_VOCAB_KEY
from .drafts.vocab import check_vocabulary, restrict_vocabulary
from .files import read_config, read_safetensors, write_safetensors
from .interfaces import Layout
from .targets import TARGET_REGISTRY, adapter_of, mlx_lm_wrapper, resolve_target, target_family, text_model_config
from .types import PairSpec, Params

# Draft tensors that DeepSpec copies from the target (taken from it when
# absent), and where the target's layout keeps each.
SHARED_WITH_TARGET = {"embed_tokens.weight": Layout.embedding_module, "lm_head.weight": Layout.head_module}


def shared_modules(layout: Layout, target_params: dict) -> dict:
    """The target's modules a draft shares, by the draft's key (``SHARED_WITH_TARGET``)."""
    return {key: module(layout, target_params) for key, module in SHARED_WITH_TARGET.items()}


def load_target(directory, lazy: bool = False) -> tuple:
    """``(adapter, spec, params, config)`` of an HF/mlx-lm target directory
    (``lazy``: each tensor is read when first evaluated)."""
    from mlx_lm.utils import load_model

    directory = Path(directory)
    config = read_config(directory, "target")
    mode = (config.get("quantization") or {}).get("mode", "affine")
    if mode not in ("affine", *ops.MICROSCALING.values()):
        raise ValueError(
            f"target {directory} is quantized with mode {mode!r}; the modes that run here are affine "
            f"(mlx_lm.convert -q) and {', '.join(ops.MICROSCALING.values())}, or give a float checkpoint "
            f"with --quant-target 4|8"
        )
    text = text_model_config(config)
    adapter = resolve_target(text)
    if adapter.load_params is not None:
        params = adapter.load_params(directory)
    elif text is not config:
        release = TARGET_REGISTRY.release(config["model_type"])
        params = release_text_model(directory, release, adapter.layout, text, lazy)
    else:
        model, text = load_model(directory, lazy=lazy)
        params = dict(tree_unflatten(tree_flatten(model.parameters())))
    return adapter, adapter.spec_from_config(text), params, text


def release_text_model(directory: Path, release, layout: Layout, text: dict, lazy: bool) -> dict:
    """The text model's tree of a multimodal release: mlx-lm builds the text
    model from ``text`` (its config) and loads the tensors the release
    declares its own (``Release.text_weights``, published or converted
    layout). mlx-lm reads lazily, so the towers' tensors are never evaluated."""
    from mlx_lm.utils import _get_classes, load_model

    model_class, args_class = _get_classes(text)

    class TextModel(model_class):
        def sanitize(self, weights: dict) -> dict:
            weights = release.text_weights(weights, layout.root)
            return super().sanitize(weights) if hasattr(model_class, "sanitize") else weights

    class TextArgs:
        @staticmethod
        def from_dict(_release_config: dict):
            return args_class.from_dict(text)

    model, _ = load_model(directory, lazy=lazy, get_model_classes=lambda config: (TextModel, TextArgs))
    return dict(tree_unflatten(tree_flatten(model.parameters())))


def check_draft_family(draft_config: dict, target_spec) -> None:
    """A draft that names its target family (DeepSpec writes ``target_model_type``
    / ``target_text_model_type``) must be paired with that family."""
    named = {target_family(draft_config.get(key)) for key in ("target_model_type", "target_text_model_type")} - {None}
    if named and target_family(target_spec.model_type) not in named:
        raise ValueError(
            f"draft was trained for a {' / '.join(sorted(named))} target, "
            f"not {target_spec.model_type!r}: pair it with its own target"
        )


def check_draft_fits(draft_spec, target_spec) -> None:
    """The draft's vocabulary, width and taps must match the target it serves."""
    problems = []
    if draft_spec.vocab_size != target_spec.vocab_size:
        problems.append(f"vocab_size {draft_spec.vocab_size} != target's {target_spec.vocab_size}")
    if draft_spec.hidden_size != target_spec.hidden_size:
        problems.append(f"hidden_size {draft_spec.hidden_size} != target's {target_spec.hidden_size}")
    last_tappable = adapter_of(target_spec).last_layer_tappable
    tappable = target_spec.num_layers if last_tappable else target_spec.num_layers - 1
    bad = [i for i in draft_spec.target_layer_ids if not 0 <= i < tappable]
    if bad:
        problems.append(
            f"target_layer_ids {list(bad)} out of range: taps must be in 0..{tappable - 1} "
            f"(the target has {target_spec.num_layers} layers{'' if last_tappable else '; the last is never tapped'})"
        )
    if draft_spec.num_target_layers and draft_spec.num_target_layers != target_spec.num_layers:
        problems.append(
            f"num_target_layers {draft_spec.num_target_layers} != target's {target_spec.num_layers}"
        )
    if not 0 <= draft_spec.mask_token_id < target_spec.vocab_size:
        problems.append(f"mask_token_id {draft_spec.mask_token_id} outside the vocabulary")
    if problems:
        raise ValueError("draft does not fit the target: " + "; ".join(problems))


def stored_with_shape(weights: dict, key: str, shape: tuple) -> bool:
    """Whether ``weights[key]`` holds a ``shape`` tensor: as is, or MLX-quantized
    (packed words with ``scales`` companions) when it has them."""
    prefix = key[: -len("weight")]
    if not key.endswith(".weight") or prefix + "scales" not in weights:
        return tuple(weights[key].shape) == shape
    stored = {name: weights[prefix + name] for name in ("weight", "scales", "biases") if prefix + name in weights}
    try:
        ops.quantization(stored, shape[-1])
    except ValueError:
        return False
    return tuple(stored["weight"].shape[:-1]) == shape[:-1]


def draft_params_from_weights(arch, spec, weights: dict, target_params: dict, target_spec) -> dict:
    """Validate checkpoint keys and shapes, map to the tree, and share the
    target's embedding and head (in whatever form the target stores them:
    dense or quantized) where the checkpoint has no copy of its own."""
    expected = arch.checkpoint_shapes(spec)
    quantized = {key[: -len("scales")] for key in weights if key.endswith(".scales")}
    companions = {prefix + name for prefix in quantized for name in ("scales", "biases")}
    missing = sorted(set(expected) - set(weights) - set(SHARED_WITH_TARGET))
    unexpected = sorted(set(weights) - set(expected) - companions)
    if missing or unexpected:
        raise ValueError(
            f"draft checkpoint keys do not match a {spec.model_type} DSpark draft of this config: "
            f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
        )
    wrong = [
        f"{key} {tuple(weights[key].shape)} (expected {tuple(shape)})"
        for key, shape in expected.items()
        if key in weights and not stored_with_shape(weights, key, tuple(shape))
    ]
    if wrong:
        raise ValueError("draft checkpoint tensors have wrong shapes: " + "; ".join(wrong[:8]))
    params = tree_unflatten([(arch.key_map(key), value) for key, value in weights.items()])
    for key, module in SHARED_WITH_TARGET.items():
        if key in expected and key not in weights:
            params[arch.key_map(key).rsplit(".", 1)[0]] = module(adapter_of(target_spec).layout, target_params)
    if arch.prepare_params:
        params = arch.prepare_params(spec, params)
    if spec.draft_vocab_size:  # the checkpoint's Markov rows are already the subset's
        ids = params[DRAFT_VOCAB_KEY]
        check_vocabulary(np.array(ids), spec.vocab_size)
        params = restrict_vocabulary(params, ids.astype(mx.int32), markov_rows=False)
    return params


def renamed(weights: dict, rename) -> dict:
    """``weights`` under the keys ``rename(key)``; two keys that become one are refused."""
    result = {}
    for key, value in weights.items():
        name = rename(key)
        if name in result:
            raise ValueError(f"draft checkpoint holds {name!r} twice (also as {key!r})")
        result[name] = value
    return result


def load_draft(directory, target_spec, target_params: dict) -> tuple:
    """``(arch, spec, params)`` of a draft directory (DeepSpec format or a
    ``dflash_config`` layout) for this target."""
    directory = Path(directory)
    config = read_config(directory, "draft")
    arch = resolve_arch(config)
    weights = read_safetensors(directory, "draft")
    if arch.checkpoint_key is not None:
        weights = renamed(weights, arch.checkpoint_key)
    if arch.is_draft_key is not None:
        weights = {key: value for key, value in weights.items() if arch.is_draft_key(key)}
    if arch.complete_config is not None:
        config = arch.complete_config(config, weights.keys())
    spec = arch.spec_from_config(config)
    check_draft_family(config, target_spec)
    check_draft_fits(spec, target_spec)
    if microscaling.scaled_weights(weights):
        block = (config.get("quantization_config") or {}).get("weight_block_size", [128])[0]
        weights = microscaling.to_mlx(weights, block)
    # Half-precision checkpoints (bf16 releases, the fp16 default draft) run in
    # float32, like the targets: the fast dtype on CPU, one dtype per graph.
    weights = {key: value.astype(mx.float32) if value.dtype in (mx.float16, mx.bfloat16) else value
               for key, value in weights.items()}
    params = draft_params_from_weights(arch, spec, weights, target_params, target_spec)
    return arch, spec, params


def with_draft(adapter, target_spec, target_params: dict, draft_dir) -> Params:
    """Pair an already loaded target with the draft in ``draft_dir``."""
    arch, draft_spec, draft_params = load_draft(draft_dir, target_spec, target_params)
    return Params(PairSpec(adapter, target_spec, arch, draft_spec), target_params, draft_params)


def load(target_dir, draft_dir) -> Params:
    """Load a target and its DSpark draft from local directories (and a
    multimodal release's image side, read when the first image is)."""
    from .vision import load_vision

    adapter, target_spec, target_params, _ = load_target(target_dir)
    params = materialised(with_draft(adapter, target_spec, target_params, draft_dir))
    return params._replace(vision=load_vision(target_dir))


def materialised(params: Params) -> Params:
    """``params`` with the target's and the draft's weights evaluated here:
    MLX evaluates a pending array only on the thread that built it, so
    weights left pending by loading (casts, the draft's shared rows) could
    not decode on any other thread."""
    mx.eval(params.target, params.draft)
    return params


def save_draft(directory, config: dict, weights: dict) -> Path:
    """Write a draft in DeepSpec layout: ``config.json`` + ``model.safetensors``, each file whole or not at all."""
    directory = Path(directory)
    atomic.write_text(directory / "config.json", json.dumps(config, indent=2))
    write_safetensors(directory / "model.safetensors", weights)
    return directory


def mlx_lm_model(config: dict, target_params: dict):
    """mlx-lm's own model for ``config`` sharing our parameter arrays; every
    module stored quantized becomes mlx-lm's quantized module with the group
    size and bits its arrays say (mixed layouts included)."""
    from mlx_lm.utils import _get_classes

    wrapper = mlx_lm_wrapper(config["model_type"])
    if wrapper is not None:  # mlx-lm builds this text model inside its release
        config, target_params = dict(config, model_type=wrapper.model_type), {wrapper.text: target_params}
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    flat = dict(tree_flatten(target_params))
    ops.quantize_as_stored(model, flat)
    model.update(tree_unflatten(list(flat.items())))
    return model


def load_tokenizer(directory):
    """The target's mlx-lm tokenizer, or ``None`` when the directory has none."""
    directory = Path(directory)
    if not any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from mlx_lm.tokenizer_utils import load as load_mlx_tokenizer

    return load_mlx_tokenizer(directory)


def pair_with_draft(config: dict, target_params: dict, draft_dir) -> Params:
    """A loaded target tree (any family, dense or quantized) paired with the draft in ``draft_dir``."""
    adapter = resolve_target(config)
    return with_draft(adapter, adapter.spec_from_config(config), target_params, draft_dir)
