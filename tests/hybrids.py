"""Tiny hybrid targets (recurrent layers beside attention), one mlx-lm config
per family, shared by the family tests and the hybrid round tests."""

HYBRID_SHAPES = {
    # one entry per family, added beside its adapter
}
