"""The reward role: built-in verifiable rewards, user reward functions run in worker processes,
and reward models, combined per sample as weighted sources (docs/rewards.md)."""
