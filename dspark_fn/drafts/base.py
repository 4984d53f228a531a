"""The config fields every DSpark draft shares, whatever its backbone."""

from dataclasses import dataclass


@dataclass(frozen=True)
class DSparkFields:
    """Config entries DeepSpec adds to every draft, whatever its backbone."""

    model_type: str
    vocab_size: int
    hidden_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple
    num_target_layers: int
    markov_rank: int
    confidence_head: bool
    confidence_with_markov: bool
    confidence_bias: bool
    draft_vocab_size: int  # 0: the draft proposes from the whole vocabulary


def dspark_fields(config: dict) -> dict:
    """The shared fields of a DeepSpec draft config, validated."""
    required = ("block_size", "mask_token_id", "target_layer_ids", "vocab_size", "hidden_size")
    missing = [key for key in required if key not in config]
    if missing:
        raise ValueError(f"draft config lacks DSpark keys {missing}: not a DSpark draft checkpoint")
    head_type = config.get("markov_head_type", "vanilla")
    if config.get("markov_rank", 0) and head_type != "vanilla":
        raise ValueError(f"markov_head_type {head_type!r} is not supported; use 'vanilla'")
    fields = {key: config[key] for key in ("model_type", *required)}
    fields["target_layer_ids"] = tuple(fields["target_layer_ids"])
    return fields | dict(
        num_target_layers=config.get("num_target_layers", 0),
        markov_rank=config.get("markov_rank", 0),
        confidence_head=config.get("enable_confidence_head", False),
        confidence_with_markov=config.get("confidence_head_with_markov", False),
        confidence_bias=True,
        draft_vocab_size=config.get("draft_vocab_size") or 0,
    )
