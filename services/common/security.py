"""One process's side of the run's security (docs/security.md): what its server demands of callers
and what its own calls present, both built from `security.*` once at start."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rolefleet.common.auth import load_token
from rolefleet.common.config import SecuritySection
from rolefleet.common.tls import TlsFiles

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
