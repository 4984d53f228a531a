"""Model families by ``model_type``: one small mechanism behind the target and draft registries."""


class Registry(dict):
    """``model_type`` -> entry, built from what each entry declares (its
    ``model_types``), with an error that lists what is known."""

    def __init__(self, what: str, entries=()):
        super().__init__()
        self.what = what
        for entry in entries:
            self.add(entry)

    def add(self, entry) -> None:
        """Register ``entry`` under every ``model_type`` it declares."""
        for model_type in entry.model_types:
            self.register(model_type, entry)

    def register(self, model_type: str, entry) -> None:
        self[model_type] = entry

    def resolve(self, config: dict):
        model_type = config.get("model_type")
        if model_type not in self:
            raise ValueError(f"unknown {self.what} model_type {model_type!r}; supported: {', '.join(sorted(self))}")
        return self[model_type]
