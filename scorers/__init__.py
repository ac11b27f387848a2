"""Process-reward scorers (layer 3)."""
