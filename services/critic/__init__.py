"""The critic role: a value model (backbone + scalar head) and its trainer. Optional (PPO only)."""
