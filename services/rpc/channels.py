"""The gRPC channel options both ends of every call agree on: message sizes, and the clients' retry
and load-balancing policy. Neither a client nor a server module: both import it."""

from __future__ import annotations

import json
from typing import Any

from rolefleet.rpc.security import Security

# Calls answered UNAVAILABLE (a server restarting, a connection reset) are retried by gRPC itself,
# with backoff, before the caller sees the error: every RPC of the project is safe to repeat
# (generation is seeded, scoring pure, updates and checkpoints idempotent per step). Each call's
# deadline bounds its retries too.
RETRY_SERVICE_CONFIG = json.dumps({"methodConfig": [{
    "name": [{}],  # every method of every service
    "retryPolicy": {"maxAttempts": 4, "initialBackoff": "0.2s", "maxBackoff": "2s", "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"]},
}]})


def message_options(max_bytes: int) -> list[tuple[str, int]]:
    # Batches of token tensors easily pass gRPC's 4 MiB default; one step's batch must fit in a message.
    return [("grpc.max_send_message_length", max_bytes), ("grpc.max_receive_message_length", max_bytes)]


def client_options(security: Security) -> list[tuple[str, Any]]:
    """Clients spread their calls over every address a name resolves to (a headless Kubernetes
    Service of reward replicas; one address behaves as before) and retry UNAVAILABLE."""
    tls = security.tls.channel_options() if security.tls else []
    return [*message_options(security.max_message_bytes), ("grpc.lb_policy_name", "round_robin"),
            ("grpc.enable_retries", 1), ("grpc.service_config", RETRY_SERVICE_CONFIG), *tls]
