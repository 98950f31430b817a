"""The RPC layer: role servers' bootstrap and interceptors, clients' channels and call wrapper, and
security (tokens, TLS) for both ends. Clients (`roles.py`, each role's `client.py`) import no server
module (`server.py`, `guard.py`, `streams.py`); nothing here imports a role's core or the trainer."""
