"""The peer engine: mlx-vlm's own DSpark speculative decoding, on our checkpoints.

mlx-vlm (0.7.x) runs DSpark through its DFlash round loop (``generate_step``
with ``draft_model=...``, ``draft_kind="dflash"``). Three gaps stand between
it and a DeepSpec draft + a dense qwen3/llama target, and each is bridged
here without touching mlx-vlm's algorithm:

1. Checkpoint layout. mlx-vlm recognises a DSpark drafter only by a
   ``dflash_config`` object (``projector_type: "dspark"``); DeepSpec keeps the
   same fields at the top level of a ``model_type: qwen3`` config. Its qwen3 and
   llama target configs also need ``rope_theta`` at the top level, where
   transformers 5 writes ``rope_parameters``. ``stage`` writes both configs in
   mlx-vlm's layout next to the original weights.
2. Draft head. mlx-vlm drafts through the target's output head, so a draft's
   own ``lm_head.weight`` is dropped; ``stage`` checks that it equals the
   target's head (DeepSpec copies it), so both engines use the same weights.
3. Target hooks. The loop asks the target for the outputs of the tapped layers
   (``capture_layer_ids``) and for ``rollback_speculative_cache``; mlx-vlm's
   dense qwen3/llama models implement neither (only its hybrid and MoE targets
   do). ``_expose_speculative_hooks`` records the tapped layers' outputs as the
   model runs unchanged, and rolls back by trimming the KV caches with
   mlx-vlm's own rollback helper.
"""

import json
import tempfile
from pathlib import Path
from typing import NamedTuple

import dspark_fn  # noqa: F401  before mlx: OpenBLAS then serves MLX's matmuls (dspark_fn/blas.py)
import mlx.core as mx

# DeepSpec top-level draft fields that mlx-vlm reads from ``dflash_config``.
DRAFT_FIELDS = (
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    "num_target_layers",
    "markov_rank",
    "markov_head_type",
    "enable_confidence_head",
    "confidence_head_with_markov",
)


def flat_rope(config: dict) -> dict:
    """``rope_parameters`` (transformers 5) as mlx-vlm's ``rope_theta`` + ``rope_scaling``."""
    config = dict(config)
    rope = dict(config.pop("rope_parameters", None) or {})
    if "rope_theta" in rope:
        config.setdefault("rope_theta", rope.pop("rope_theta"))
    if rope.get("rope_type", "default") != "default":
        config.setdefault("rope_scaling", rope)
    return config


def dflash_layout(draft_config: dict, block_policy: str) -> dict:
    """A DeepSpec draft config as mlx-vlm's DSpark config (same model, other field places).

    ``block_policy``: "fixed" drafts the checkpoint's full block every round
    (what DeepSpec and dspark_fn do); "adaptive" lets mlx-vlm shrink and grow
    the block from recent acceptance, its default for ``Qwen3DSparkModel``.
    """
    dflash = {key: draft_config[key] for key in DRAFT_FIELDS if key in draft_config}
    dflash.update(projector_type="dspark", block_size_policy=block_policy)
    rest = {key: value for key, value in draft_config.items() if key not in DRAFT_FIELDS}
    return {**rest, "dflash_config": dflash}


def target_head(target_dir: Path, config: dict) -> mx.array:
    weights = {}
    for path in sorted(target_dir.glob("*.safetensors")):
        weights.update(mx.load(str(path)))
    tied = config.get("tie_word_embeddings", True)
    return weights["model.embed_tokens.weight" if tied else "lm_head.weight"]


def stage(target_dir, draft_dir, workdir, block_policy: str = "fixed") -> tuple[Path, Path]:
    """Write mlx-vlm-layout copies of a target and a DeepSpec draft under ``workdir``."""
    target_dir, draft_dir, workdir = Path(target_dir), Path(draft_dir), Path(workdir)
    target_config = json.loads((target_dir / "config.json").read_text())
    draft_config = json.loads((draft_dir / "config.json").read_text())

    staged_target = workdir / "target"
    staged_target.mkdir(parents=True, exist_ok=True)
    (staged_target / "config.json").write_text(json.dumps(flat_rope(target_config)))
    for path in target_dir.glob("*.safetensors"):
        link = staged_target / path.name
        if not link.exists():
            link.symlink_to(path.resolve())

    draft_weights = mx.load(str(draft_dir / "model.safetensors"))
    own_head = draft_weights.pop("lm_head.weight", None)
    if own_head is not None and not mx.array_equal(own_head, target_head(target_dir, target_config)):
        raise ValueError("mlx-vlm drafts through the target's head, but this draft has a different lm_head")
    staged_draft = workdir / "draft"
    staged_draft.mkdir(parents=True, exist_ok=True)
    (staged_draft / "config.json").write_text(json.dumps(dflash_layout(draft_config, block_policy)))
    mx.save_safetensors(str(staged_draft / "model.safetensors"), draft_weights)
    return staged_target, staged_draft


class _Taps:
    """Which layer outputs the current forward should keep, and those kept so far."""

    def __init__(self):
        self.layers, self.outputs = frozenset(), []


def _tapped(layer_class, taps: _Taps):
    class Tapped(layer_class):
        def __call__(self, *args, **kwargs):
            out = layer_class.__call__(self, *args, **kwargs)
            if self._tap_index in taps.layers:
                taps.outputs.append(out)
            return out

    return Tapped


def _expose_speculative_hooks(language_model):
    """Give an mlx-vlm dense language model the two hooks its DFlash/DSpark loop calls.

    ``capture_layer_ids`` adds the listed layers' raw outputs to the result's
    ``hidden_states`` (in layer order); ``rollback_speculative_cache`` keeps
    the anchor and the accepted drafts of a verified block in the KV caches,
    through mlx-vlm's own helper. The forward itself is the model's own: the
    classes are swapped for subclasses that only add these hooks.
    """
    from mlx_vlm.speculative.cache_state import rollback_speculative_cache

    taps = _Taps()
    base = type(language_model)

    class WithSpeculativeHooks(base):
        def __call__(self, *args, capture_layer_ids=None, speculative_verify=False, **kwargs):
            taps.layers, taps.outputs = frozenset(capture_layer_ids or ()), []
            output = base.__call__(self, *args, **kwargs)
            if capture_layer_ids is not None:
                output.hidden_states = taps.outputs
            taps.layers, taps.outputs = frozenset(), []
            return output

        def rollback_speculative_cache(self, caches, state, accepted, block_size):
            return rollback_speculative_cache(caches, state, accepted, block_size)

    language_model.__class__ = WithSpeculativeHooks
    tapped_classes = {}
    for index, layer in enumerate(language_model.model.layers):
        layer_class = type(layer)
        if layer_class not in tapped_classes:
            tapped_classes[layer_class] = _tapped(layer_class, taps)
        layer.__class__ = tapped_classes[layer_class]
        layer._tap_index = index
    return language_model


class Peer(NamedTuple):
    """mlx-vlm's target and drafter, and the proposals the drafter made in the last run."""

    target: object
    drafter: object
    proposals: list


def _recording_proposals(draft_fn, sink: list):
    def draft(*args, **kwargs):
        tokens = draft_fn(*args, **kwargs)
        sink.append(tokens)
        return tokens

    return draft


def load_peer(target_dir, draft_dir, workdir, block_policy: str = "fixed") -> Peer:
    """Load the pair the way mlx-vlm does (``load_model`` + ``load_drafter``)."""
    from mlx_vlm.speculative.drafters import load_drafter
    from mlx_vlm.utils import load_model

    staged_target, staged_draft = stage(target_dir, draft_dir, workdir, block_policy)
    target = load_model(staged_target)
    _expose_speculative_hooks(target.language_model)
    drafter, kind = load_drafter(str(staged_draft))
    if kind != "dflash":
        raise ValueError(f"mlx-vlm resolved the draft as {kind!r}, not a DSpark (dflash-loop) drafter")
    proposals = []
    # Greedy rounds draft through ``draft_block_greedy``; keeping each round's
    # (already evaluated) proposal costs a list append.
    drafter.draft_block_greedy = _recording_proposals(drafter.draft_block_greedy, proposals)
    return Peer(target, drafter, proposals)


def mlx_vlm_generate(peer: Peer, prompt_ids, max_new_tokens) -> tuple[list[int], dict]:
    """Greedy (temperature 0) DSpark decoding through mlx-vlm's ``generate_step``.

    Stats: ``accepted`` and ``drafted`` per verify round (the drafter's own
    records), ``proposals`` (the drafted tokens of each round) and ``tau`` =
    tokens emitted per verify round (accepted drafts + the target's token).
    """
    from mlx_vlm.generate import generate_step

    peer.proposals.clear()
    steps = generate_step(
        mx.array([prompt_ids]),
        peer.target,
        None,
        None,
        max_tokens=max_new_tokens,
        temperature=0.0,
        draft_model=peer.drafter,
        draft_kind="dflash",
    )
    tokens = [int(token) for token, _ in steps]
    accepted, drafted = list(peer.drafter.accept_lens), list(peer.drafter.draft_lens)
    rounds = len(accepted)
    stats = {
        "rounds": rounds,
        "accepted": accepted,
        "drafted": drafted,
        "proposals": [p.reshape(-1).tolist() for p in peer.proposals],
        "tau": (sum(accepted) + rounds) / rounds if rounds else float("nan"),
    }
    return tokens, stats


def mlx_vlm_dspark_tokens(target_dir, draft_dir, prompt_ids, max_new_tokens, block_policy="fixed"):
    """Load the pair with mlx-vlm and decode greedily: ``(tokens, stats)``."""
    with tempfile.TemporaryDirectory() as workdir:
        return mlx_vlm_generate(load_peer(target_dir, draft_dir, workdir, block_policy), prompt_ids, max_new_tokens)
