"""The training engine: a role's worker processes and their ranks (`workers.py`, `ranks.py`), the
trainer every trainer role's worker builds on (`base.py`, `optim.py`, `sharding.py`), the
controller base of the actor and the critic (`role.py`), their step ledger (`steps.py`), checkpoints
and profiling. No RPC: the role servers wrap what is here."""
