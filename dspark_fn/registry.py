"""Model families by ``model_type``: one small mechanism behind the target and draft registries.

A multimodal release (and the text config inside it) resolves to the family
of the text model it runs, so a ``gemma4_unified`` checkpoint is a
``gemma4_text`` target and its DeepSpec draft a ``gemma4_text`` draft.
"""

TEXT_FAMILY = {"gemma4": "gemma4_text", "gemma4_unified": "gemma4_text", "gemma4_unified_text": "gemma4_text",
               "lfm2-vl": "lfm2",
               "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def family_of(model_type: str | None) -> str | None:
    return TEXT_FAMILY.get(model_type, model_type)


def mlx_lm_model_type(model_type: str) -> str:
    """The mlx-lm module that builds ``model_type``: its own, or for a text
    family mlx-lm has no module for (``qwen3_5_text``) the release wrapping it."""
    from importlib.util import find_spec

    if find_spec(f"mlx_lm.models.{model_type}") is not None:
        return model_type
    return next((release for release, text in TEXT_FAMILY.items() if text == model_type), model_type)


class Registry(dict):
    """``model_type`` -> entry, with an error that lists what is known."""

    def __init__(self, what: str, entries: dict):
        super().__init__(entries)
        self.what = what

    def register(self, model_type: str, entry) -> None:
        self[model_type] = entry

    def resolve(self, config: dict):
        model_type = config.get("model_type")
        family = family_of(model_type)
        if family not in self:
            raise ValueError(
                f"unknown {self.what} model_type {model_type!r}; supported: {', '.join(sorted(self))} "
                f"(and the multimodal releases {', '.join(sorted(TEXT_FAMILY))})"
            )
        return self[family]
