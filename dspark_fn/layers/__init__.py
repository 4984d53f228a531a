"""Layer math a family's target and its DSpark draft share (one module per family)."""
