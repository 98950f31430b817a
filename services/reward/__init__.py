"""The reward role: rule-based verifiable rewards from a registry (reward models come later)."""
