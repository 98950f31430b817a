"""One process's side of the run's security (docs/security.md): what its server demands of callers
and what its own calls present, both built from `security.*` once at start."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Optional

from rolefleet.common.config import SecuritySection
from rolefleet.rpc.auth import load_token
from rolefleet.rpc.tls import TlsFiles

MIB = 1024 * 1024
DEFAULT_MAX_MESSAGE_BYTES = 512 * MIB  # a step's batch of token tensors must fit in one message


@dataclass(frozen=True)
class Security:
    token: Optional[str] = None      # the run's shared token; None: no token authentication
    tls: Optional[TlsFiles] = None   # this process's certificate, key and CA; None: plaintext
    max_calls_per_client: int = 128
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    @classmethod
    def of(cls, section: SecuritySection, role: str) -> Security:
        """Raises TokenError or TlsError (both ValueError) naming the key and file at fault."""
        return cls(load_token(section.token_file, section.token_env), TlsFiles.load(section.tls, role),
                   section.max_calls_per_client, section.max_message_mb * MIB)


OPEN = Security()  # no token, plaintext: the default of tests and of a run that configures nothing


def is_loopback(host: str) -> bool:
    """Whether a server bound to `host` is reachable from this machine alone."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a wildcard ("", "0.0.0.0" is an address), or a name that may resolve anywhere
        return False


class Unauthenticated(ValueError):
    """A server that would listen beyond loopback with nothing to tell callers apart."""


def refuse_if_open(role: str, binds: dict[str, str], security: Security, section: SecuritySection) -> None:
    """A server bound beyond loopback needs a token or mutual TLS: without either, anyone who reaches
    the port may call Update and steer the model. `binds`: the config key of each bound host -> host."""
    exposed = {key: host for key, host in binds.items() if not is_loopback(host)}
    if not exposed or security.token or (security.tls is not None and section.tls.mutual):
        return
    if section.allow_unauthenticated:
        return
    where = ", ".join(f"{key}={host or '*'}" for key, host in exposed.items())
    raise Unauthenticated(
        f"{role}: {where} is reachable beyond this machine, and the run has no token and no mutual TLS, so "
        "any caller there could change the model. Give the run a token (security.token_file, or the "
        f"variable security.token_env names: ${section.token_env or 'ROLEFLEET_TOKEN'}), or mutual TLS "
        "(security.tls.*, mutual: true); or bind 127.0.0.1; or, on a network only trusted callers reach, "
        "set security.allow_unauthenticated=true (docs/security.md)")
