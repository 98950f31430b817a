"""`rolefleet certs`: a development certificate authority for the run's TLS and mutual TLS.

One self-signed CA signs one certificate per role, and `client` for operators' tools and
`rolefleet up`. Every leaf is both a server and a client certificate, because every role serves
gRPC and also calls the others. The CA key sits beside the certificates: this is for development
and private clusters, where a production deployment brings its own PKI (cert-manager, a company CA).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import secrets
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

NAMES = ("actor", "reward", "critic", "coordinator", "client")
CA_NAME = "RoleFleet development CA"
MAX_DAYS = 36500  # far beyond any sensible lifetime, and inside what X.509 dates can hold

# A '*' only as the whole first label: TLS libraries match nothing else (RFC 6125 6.4.3).
_DNS_NAME = re.compile(r"(\*\.)?([A-Za-z0-9-]+\.)*[A-Za-z0-9-]+")
_SKEW = datetime.timedelta(minutes=5)  # valid at once on hosts whose clocks run a little behind


class CertsError(ValueError):
    """Certificates that cannot be made as asked (a file in the way, a bad host, bad days); the message says which."""


def make_certs(out: Path | str, hosts: Sequence[str] = (), days: int = 365, force: bool = False) -> list[Path]:
    """Write a CA (`ca.pem`, `ca-key.pem`) and, signed by it, `N.pem` + `N-key.pem` for each N in NAMES
    into `out`, valid for `days`. Each leaf names N, localhost, 127.0.0.1, ::1 and every entry of
    `hosts` (IP addresses or DNS names, `*.` wildcards allowed). Existing files are refused unless
    `force`; then nothing is written. Returns the written paths."""
    if not 1 <= days <= MAX_DAYS:
        raise CertsError(f"days must be between 1 and {MAX_DAYS}, got {days}")
    extra = [_general_name(h) for h in hosts]
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise CertsError(f"{out} exists and is not a directory")
    files = [("ca", out / "ca.pem", out / "ca-key.pem")] + [(n, out / f"{n}.pem", out / f"{n}-key.pem") for n in NAMES]
    if not force:
        for path in (p for _, cert, key in files for p in (cert, key)):
            if os.path.lexists(path):  # a dangling link too: O_EXCL would trip on it later
                raise CertsError(f"{path} already exists: pass --force to replace it, or pick another directory")

    not_before = datetime.datetime.now(datetime.timezone.utc) - _SKEW
    not_after = not_before + _SKEW + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        _builder(_name(CA_NAME), _name(CA_NAME), ca_key.public_key(), not_before, not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(key_cert_sign=True, crl_sign=True), critical=True)
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    made = {"ca": (ca_cert, ca_key)}
    for name in NAMES:
        sans = [x509.DNSName(name), x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                x509.IPAddress(ipaddress.ip_address("::1")), *extra]
        made[name] = _leaf(name, list(dict.fromkeys(sans)), ca_cert, ca_key, ca_ski)

    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    written = []
    for name, cert_path, key_path in files:
        cert, key = made[name]
        _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644, force)
        _write(key_path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()), 0o600, force)
        written += [cert_path, key_path]
    return written


def _leaf(name: str, sans: list[x509.GeneralName], ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey,
          ca_ski: x509.SubjectKeyIdentifier) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(_name(name), ca_cert.subject, key.public_key(), ca_cert.not_valid_before_utc, ca_cert.not_valid_after_utc)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(digital_signature=True), critical=True)
        # Both: a role is a server to its callers and a client of the roles it calls (mutual TLS).
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def _general_name(host: str) -> x509.GeneralName:
    if isinstance(host, str):  # ip_address() would also take an int
        try:
            return x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            pass
        if _DNS_NAME.fullmatch(host):
            return x509.DNSName(host)
    raise CertsError(f"bad --host {host!r}: give an IP address or a DNS name of letters, digits, '-' and '.', "
                     "with an optional '*.' first label")


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name),
                      x509.NameAttribute(NameOID.ORGANIZATION_NAME, "RoleFleet")])


def _builder(subject: x509.Name, issuer: x509.Name, public_key, not_before, not_after) -> x509.CertificateBuilder:
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number()).not_valid_before(not_before).not_valid_after(not_after))


def _key_usage(**allowed: bool) -> x509.KeyUsage:
    usages = ("digital_signature", "content_commitment", "key_encipherment", "data_encipherment", "key_agreement",
              "key_cert_sign", "crl_sign", "encipher_only", "decipher_only")
    return x509.KeyUsage(**{u: allowed.get(u, False) for u in usages})


def _write(path: Path, data: bytes, mode: int, replace: bool) -> None:
    """Create `path` with `mode` from the first byte (O_EXCL, so a key is never readable by others,
    even for an instant, and no file that appeared meanwhile is followed or overwritten). Replacing
    writes a new file beside it and renames it over, so readers see the old file or the new, never half."""
    target = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp") if replace else path
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if replace:
            os.replace(target, path)
    except BaseException:
        target.unlink(missing_ok=True)
        raise
