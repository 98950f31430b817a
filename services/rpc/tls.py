"""TLS and mutual TLS of the role servers' gRPC channels (issue 14; docs/security.md).

Servers take their certificate through gRPC's dynamic credentials: gRPC asks for it at the start of
every handshake, which lets a server (a) pick up renewed certificate files without a restart and
(b) count handshakes. gRPC's TLS layer refuses a plaintext client, a client without a certificate
under mutual TLS, or one signed by another CA before any call exists, and tells the application
nothing; so a refused connection is counted as a handshake that no call follows within
`SETTLE_S` (a client connects because it has a call to make, and makes it at once).
"""

from __future__ import annotations

import collections
import datetime
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Optional

import grpc
from prometheus_client import Counter
from prometheus_client.core import REGISTRY, CounterMetricFamily

from rolefleet.common.config import TlsSection

log = logging.getLogger(__name__)

TLS_HANDSHAKES = Counter("rolefleet_tls_handshakes", "TLS handshakes begun at a role server", ["role"])
TLS_CONNECTIONS = Counter("rolefleet_tls_connections", "TLS connections that made a call", ["role"])
SETTLE_S = 5.0  # a handshake with no call from a new connection this long after it was refused
KNOWN_PEERS = 4096  # connections remembered per server (oldest forgotten first)


class TlsError(ValueError):
    """Certificate files that cannot be used; the message names the key and the file."""


@dataclass(frozen=True)
class TlsFiles:
    """One process's TLS material, read from the files `security.tls` names for its role."""

    cert: bytes
    key: bytes
    ca: Optional[bytes]
    mutual: bool
    server_name: Optional[str]
    source: tuple[TlsSection, str]  # the config and role they were read for, to read renewals

    @classmethod
    def load(cls, tls: TlsSection, role: str) -> Optional[TlsFiles]:
        """None when TLS is off."""
        if not tls.enabled:
            return None
        read = {key: _read(key, path) for key, path in tls.paths(role).items() if path}
        _check_pair(tls.paths(role), read["cert_file"], read["key_file"])
        return cls(read["cert_file"], read["key_file"], read.get("ca_file"), tls.mutual, tls.server_name, (tls, role))

    @property
    def paths(self) -> tuple[str, ...]:
        tls, role = self.source
        return tuple(p for p in tls.paths(role).values() if p)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """What a client presents: it verifies servers against the CA (the system's roots without
        one) and offers its own certificate, which a mutual-TLS server requires."""
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def _read(key: str, path: str) -> bytes:
    try:
        data = open(path, "rb").read()
    except OSError as exc:
        raise TlsError(f"security.tls.{key}: cannot read {path} ({exc.strerror or exc})") from None
    if b"-----BEGIN " not in data:
        raise TlsError(f"security.tls.{key}: {path} is not a PEM file")
    return data


def _check_pair(paths: dict[str, Optional[str]], cert_pem: bytes, key_pem: bytes) -> None:
    """Refuse at start what would only fail every handshake later: no certificate, a key of another
    certificate, a certificate out of its validity."""
    # Only for a server on TLS (every role server imports this module): cryptography's import is not for the rest.
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization  # as above

    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError:
        raise TlsError(f"security.tls.cert_file: {paths['cert_file']} holds no PEM certificate") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise TlsError(f"security.tls.key_file: {paths['key_file']} holds no unencrypted PEM private key "
                       f"({exc})") from None
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.DER, public) != \
            cert.public_key().public_bytes(serialization.Encoding.DER, public):
        raise TlsError(f"security.tls.key_file: {paths['key_file']} is not the key of {paths['cert_file']}")
    now = datetime.datetime.now(datetime.timezone.utc)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise TlsError(f"security.tls.cert_file: {paths['cert_file']} is valid from {cert.not_valid_before_utc} "
                       f"to {cert.not_valid_after_utc}, not now")


def _mtime(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:  # replaced right now (a renewal by rename): seen at the next handshake
        return 0


class ServerTls:
    """A role server's credentials and its handshake accounting."""

    def __init__(self, role: str, files: TlsFiles):
        self.role, self.files = role, files
        self._mtimes = self._stat()
        self._lock = threading.Lock()  # gRPC calls the fetcher on its own threads
        self._pending: collections.deque[float] = collections.deque()  # handshake start times
        self._peers: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.refused = 0
        _ACCOUNTS.append(self)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(self._configuration(self.files), self._fetch,
                                                   require_client_authentication=self.files.mutual)

    def _configuration(self, files: TlsFiles) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration([(files.key, files.cert)],
                                                         root_certificates=files.ca if files.mutual else None)

    def _stat(self) -> tuple[int, ...]:
        return tuple(_mtime(p) for p in self.files.paths)

    def _fetch(self) -> Optional[grpc.ServerCertificateConfiguration]:
        """Called by gRPC as each handshake begins: count it, and answer renewed files if any."""
        TLS_HANDSHAKES.labels(self.role).inc()
        with self._lock:
            self._pending.append(time.monotonic())
            self._settle()
        mtimes = self._stat()
        if mtimes == self._mtimes:
            return None
        self._mtimes = mtimes
        try:  # a renewal half written is retried at the next handshake (the mtimes move again)
            renewed = TlsFiles.load(*self.files.source)
            configuration = self._configuration(renewed)
        except (TlsError, ValueError) as exc:
            log.warning("%s: renewed certificate files not loaded (%s); keeping the current ones", self.role, exc)
            return None
        self.files = renewed
        log.info("%s: certificate files renewed; new connections get them", self.role)
        return configuration

    def connected(self, peer: str) -> None:
        """A call arrived from `peer` (a connection): its first call proves its handshake succeeded."""
        with self._lock:
            if peer in self._peers:
                self._peers.move_to_end(peer)
                return
            self._peers[peer] = None
            if len(self._peers) > KNOWN_PEERS:
                self._peers.popitem(last=False)
            TLS_CONNECTIONS.labels(self.role).inc()
            self._settle()
            if self._pending:
                self._pending.popleft()

    def settle(self) -> int:
        with self._lock:
            return self._settle()

    def _settle(self) -> int:
        horizon = time.monotonic() - SETTLE_S
        while self._pending and self._pending[0] < horizon:
            self._pending.popleft()
            self.refused += 1
        return self.refused

    def close(self) -> None:
        """The server stopped: its count stays in the metric, its bookkeeping goes."""
        if self in _ACCOUNTS:
            _ACCOUNTS.remove(self)
            _RETIRED[self.role] += self.settle()


_ACCOUNTS: list[ServerTls] = []
_RETIRED: collections.Counter[str] = collections.Counter()


class _RefusedCollector:
    """`rolefleet_tls_refused_total{role}`: handshakes no call followed (settled at each scrape)."""

    def collect(self):
        family = CounterMetricFamily("rolefleet_tls_refused", "TLS connections refused at a role server "
                                     "(plaintext, no client certificate, another CA's)", labels=["role"])
        totals = collections.Counter(_RETIRED)
        for account in list(_ACCOUNTS):
            totals[account.role] += account.settle()
        for role, total in totals.items():
            family.add_metric([role], total)
        yield family


REGISTRY.register(_RefusedCollector())
