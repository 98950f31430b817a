"""RoleFleet: RL post-training of language models on a cluster of role servers."""

__version__ = "0.1.0"
