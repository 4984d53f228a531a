"""The two interfaces a model family implements: ``TargetAdapter`` (how to run
a target) and ``DraftArch`` (how to build and run a draft backbone), with
what a target family declares about itself (``Layout``, ``Release``). The
round kernels and the loaders reach families only through them; the
families and their registries live in ``targets/`` and ``drafts/``, so
importing these loads none."""

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple


@dataclass(frozen=True)
class Layout:
    """Where a family's parameter tree keeps what code outside the family
    reads: the decoder (its ``layers`` list and its embedding) under
    ``root``, the output head at the top. A tree without ``head`` ties the
    output to the embedding (mlx-lm builds no head then)."""

    root: str = "model"
    embedding: str = "embed_tokens"
    head: str = "lm_head"

    def layers(self, tree: dict) -> list:
        return tree[self.root]["layers"]

    def with_layers(self, tree: dict, layers: list) -> dict:
        """``tree`` with its decoder layers replaced."""
        return dict(tree, **{self.root: dict(tree[self.root], layers=layers)})

    def embedding_module(self, tree: dict) -> dict:
        """The token embedding (``{"weight"}``, plus ``scales`` and ``biases`` when quantized)."""
        return tree[self.root][self.embedding]

    def head_module(self, tree: dict) -> dict:
        """The module the logits come from: the head, or the embedding when tied."""
        return tree[self.head] if self.head in tree else self.embedding_module(tree)

    def logits(self, spec, params: dict, hidden):
        """Output logits ``[..., V]`` of final-normed ``hidden``: a family's default ``logits``."""
        from . import ops  # here, so that importing the records loads no model math

        return ops.linear(self.head_module(params), hidden)


@dataclass(frozen=True, kw_only=True)
class ImageSide:
    """How a release's images reach its text model through mlx-vlm's own
    model (``mlx_vlm.models.<module>``: its processor, vision tower and
    projector, the model's attributes ``modules``); nothing of the vision
    side is written here.

    features(vlm_model, inputs) -> [N, d]   the projected features of the
        images in ``inputs`` (the processor's output for them), one row per
        image token, in the order the tokens come
    positions(vlm_config, ids, inputs) -> [3, L] or None
        multimodal RoPE positions (temporal, height, width) of the tokens
        ``ids`` of a whole prompt, for families whose image tokens sit at
        positions of their own (Qwen's); None: positions are the slots
    bidirectional(text_config) -> bool       whether an image's tokens attend
        to one another both ways during the prefill (Gemma's vision spans)
    """

    module: str
    modules: tuple  # the attributes of mlx-vlm's model that ``features`` reads (its towers)
    features: Callable
    positions: Callable | None = None
    bidirectional: Callable = lambda text_config: False


class ImageInputs(NamedTuple):
    """What a prefill chunk with images gives a family's forward, per row and
    chunk position (rows without images: mask all False, offsets 0, spans -1).

    features: [B, L, d] the image feature of each image position (any value elsewhere)
    mask:     [B, L] bool, the positions an image feature replaces the token embedding at
    offsets:  [B, 3, L] int32, multimodal RoPE positions minus the slot and the row's
              position shift (0 for text; families without multimodal RoPE ignore them)
    spans:    [B, L] int32, which image span a position belongs to (-1: text); a
              family with bidirectional image attention lets a span see itself whole
    shift:    [B] int32, the position shift the row's prompt leaves for what
              follows (added to the row's shift in the chunk holding its last token)
    """

    features: Any
    mask: Any
    offsets: Any
    spans: Any
    shift: Any


@dataclass(frozen=True)
class Release:
    """A multimodal release of a family: its text model wrapped beside the
    towers that read other inputs (images, audio). A target runs the text
    model; the towers stay on disk.

    Names are the wrapper's as mlx-lm and mlx-vlm build it (the text model
    under ``text``, each tower under its own name); a published checkpoint
    nests them one level down, under ``nest`` (``model.language_model.*``,
    ``model.vision_tower.*``), the text model's head staying at the top.
    The towers are what a run on images or audio reads beside the text
    model; ``images`` says how (``ImageSide``), or None where mlx-vlm has
    no vision side for the release.
    """

    model_type: str  # the release's config model_type
    text_model_type: str  # the family's model_type for the text model its ``text_config`` describes
    text_config_type: str | None = None  # the text_config's own model_type, where the release spells it otherwise
    text: str = "language_model"
    towers: tuple = ("vision_tower", "multi_modal_projector")
    nest: str = "model"
    images: ImageSide | None = None

    @property
    def names(self) -> tuple:
        """The model_types that stand for this release's text model."""
        return (self.model_type,) + ((self.text_config_type,) if self.text_config_type else ())

    def tower_weights(self, weights: dict) -> dict:
        """The towers' tensors of a release checkpoint (either layout), under their stored names."""
        towers = tuple(f"{name}." for name in self.towers) + tuple(f"{self.nest}.{name}." for name in self.towers)
        return {key: value for key, value in weights.items() if key.startswith(towers)}

    def text_weights(self, weights: dict, root: str) -> dict:
        """The text model's tensors of a release checkpoint (either layout)
        under the names a checkpoint of the text model alone gives them (its
        decoder under ``root``, ``Layout.root``); the towers' tensors are left
        out. Tensors of neither stay as they are, for the loader to name."""
        text, nested = self.text + ".", f"{self.nest}.{self.text}."
        towers = self.tower_weights(weights)
        kept = {}
        for key, value in weights.items():
            if key in towers:
                continue
            if key.startswith(nested):
                key = f"{root}.{key.removeprefix(nested)}"
            kept[key.removeprefix(text)] = value
        return kept


def fresh_draft_geometry(config: dict) -> dict:
    """What a fresh draft copies of a target config (HF llama names, with
    their defaults): the width, depth and attention geometry
    (``TargetAdapter.draft_geometry``'s default)."""
    heads = config["num_attention_heads"]
    return dict(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads", heads),
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        intermediate_size=config["intermediate_size"],
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=config.get("rope_theta", 10000.0),
        rope_scaling=config.get("rope_scaling"),
        max_position_embeddings=config.get("max_position_embeddings", 4096),
    )


@dataclass(frozen=True, kw_only=True)
class TargetAdapter:
    """How to run one target family, and what it declares about itself.

    What it runs:
    model_types                        the config ``model_type``s of the text models it runs
    releases                           its multimodal releases (``Release``): a config of one
                                       runs the text model under its ``text_config``
    layout                             where its parameter tree keeps the decoder layers,
                                       embedding and head (``Layout``; default mlx-lm's
                                       ``model.layers`` / ``model.embed_tokens`` / ``lm_head``)

    How it runs:
    spec_from_config(config) -> spec   hashable static description with at least
                                       ``model_type``, ``vocab_size``, ``hidden_size``, ``num_layers``
    init_kv(spec, batch, capacity, dtype)  per-layer fixed-capacity KV buffers in the
                                       target's activation dtype
    forward(spec, params, kv, tokens, start, taps) -> (hidden, features, kv)
        runs ``tokens [B, L]`` at positions ``start[b] + i``; ``hidden`` is the
        final-normed output, ``features`` the concatenated raw outputs of the
        decoder layers listed in ``taps`` (``[B, L, len(taps) * d]``).
        A family whose releases take images (``Release.images``) also takes
        ``images`` (``ImageInputs``, prefill chunks only) in ``forward`` and
        ``prompt_forward``: image features in place of the token embeddings
        at image positions, and the positions and masks its images need.
    logits(spec, params, hidden) -> [..., V]
        default: the layout's head (or tied embedding) applied to ``hidden``
    load_params(directory) -> params   optional; without it the tree is mlx-lm's
    prompt_forward(spec, params, kv, tokens, start, taps, first, end)
        optional: ``forward`` for prefill chunks of prompts spanning positions
        ``first[b] .. end[b] - 1``, for families whose state depends on how
        the prompt was split into calls (DeepSeek-V4's pooled windows) or
        that must not advance over the chunk's padding (recurrent layers)

    Splitting over ranks (``distributed.py``):
    shard_tensor(spec, params, ranks) -> (spec, params)
        optional: this rank's share of a tensor-parallel target (``sharding.py``);
        the spec counts the rank's own heads
    tensor_splits(config) -> {what: count}
        with ``shard_tensor``: the counts it divides by the number of ranks,
        so a split that cannot work is refused before any weight is read
    pipeline_links(spec) -> ((layer, earlier layer), ...)
        layers that read another layer's cache, which a pipeline split must
        keep on that layer's rank (default: none)

    Drafts:
    last_layer_tappable                whether a draft may tap the last decoder layer
    draft_geometry(config) -> dict     what a fresh draft copies of a config
                                       (``fresh_draft_geometry``'s keys; default: HF llama names)

    A family with recurrent layers keeps their state in ``kv`` as a dict per
    layer (``cache.py``): ``forward`` leaves it pending (the round settles it
    on the accepted tokens), ``prompt_forward`` committed after ``end``.
    """

    model_types: tuple = ()
    releases: tuple = ()
    layout: Layout = Layout()
    spec_from_config: Callable
    init_kv: Callable
    forward: Callable
    logits: Callable | None = None
    load_params: Callable | None = None
    prompt_forward: Callable | None = None
    shard_tensor: Callable | None = None
    tensor_splits: Callable | None = None
    pipeline_links: Callable = lambda spec: ()
    last_layer_tappable: bool = False
    draft_geometry: Callable = fresh_draft_geometry

    def __post_init__(self):
        if self.logits is None:
            object.__setattr__(self, "logits", self.layout.logits)


@dataclass(frozen=True, kw_only=True)
class DraftArch:
    """How to build and run one draft backbone.

    model_types                              the config ``model_type``s it is registered under
    spec_from_config(config) -> spec        a hashable ``DSparkFields`` subclass
    checkpoint_shapes(spec) -> {key: shape} every tensor of a checkpoint, by its own key
    key_map(key) -> tree key                 dotted path in the parameter tree (default: the key)
                                             (heads always land at ``markov_head``,
                                             ``confidence_head``, ``embed_tokens``, ``lm_head``)
    init_context(spec, batch, capacity)      empty context state
    extend_context(spec, params, state, features, start) -> state
        projects target features ``[B, L, F]`` of positions ``start[b] + i`` and
        writes them as context keys/values
    block_forward(spec, params, state, length, block_ids) -> (base_logits, head_hidden)
        the block at positions ``length[b] + k`` attending to context slots
        ``< length[b]`` and to the whole block; ``head_hidden`` feeds the
        confidence head. With ``length [B, N]`` (training) each row holds N
        blocks side by side sharing its context (``cache.block_slots``,
        ``cache.block_positions``, ``cache.block_mask``)
    prepare_params(spec, tree) -> tree       optional last loading step for layouts a
                                             per-key map cannot reach (stacking experts)
    is_draft_key(key) -> bool                optional: which tensors of the directory are
                                             the draft's, for drafts that ship inside their
                                             target's checkpoint (default: all of them)
    complete_config(config, keys) -> config  optional: facts a release's config leaves to
                                             its checkpoint (V4-DSpark's stage count)
    checkpoint_key(key) -> key               optional: a checkpoint's own spelling of a key
                                             -> the spelling ``checkpoint_shapes`` uses
    fresh_config(geometry, layers) -> config optional: the config of a fresh draft of ``layers``
                                             layers for a target of this geometry
                                             (``TargetAdapter.draft_geometry``), DSpark keys aside
    """

    model_types: tuple = ()
    spec_from_config: Callable
    checkpoint_shapes: Callable
    init_context: Callable
    extend_context: Callable
    block_forward: Callable
    key_map: Callable = lambda key: key
    prepare_params: Callable | None = None
    is_draft_key: Callable | None = None
    complete_config: Callable | None = None
    checkpoint_key: Callable | None = None
    fresh_config: Callable | None = None
