"""`rolefleet certs`: the leaves chain to the CA as server and client certificates, keys stay private,
nothing is overwritten without --force, and gRPC mutual TLS on loopback works with the files (and
refuses a client of another CA)."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import os
import re
import stat

import grpc
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from cryptography.x509.verification import DNSName, IPAddress, PolicyBuilder, Store
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rolefleet import cli
from rolefleet.certs import NAMES, CertsError, make_certs

HOSTS = ("10.1.2.3", "*.rolefleet.svc.cluster.local", "actor.example")


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs") / "tls", hosts=HOSTS)[0].parent


def load(path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_every_leaf_chains_to_the_ca_as_server_and_client(certs):
    ca = load(certs / "ca.pem")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    policy = PolicyBuilder().store(Store([ca]))
    for name in NAMES:
        leaf = load(certs / f"{name}.pem")
        assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= set(eku)
        sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert {name, "localhost", "*.rolefleet.svc.cluster.local", "actor.example"} <= set(
            sans.get_values_for_type(x509.DNSName))
        assert {ipaddress.ip_address(a) for a in ("127.0.0.1", "::1", "10.1.2.3")} <= set(
            sans.get_values_for_type(x509.IPAddress))
        # The verifier checks the signature, validity, key usages and the name, as a TLS peer would.
        for server_name in (DNSName(name), DNSName("localhost"), DNSName("actor-0.rolefleet.svc.cluster.local"),
                            IPAddress(ipaddress.ip_address("127.0.0.1")), IPAddress(ipaddress.ip_address("10.1.2.3"))):
            assert policy.build_server_verifier(server_name).verify(leaf, [])[-1] == ca
        assert policy.build_client_verifier().verify(leaf, []).chain[-1] == ca


def test_keys_are_private_whatever_the_umask(tmp_path):
    old = os.umask(0)  # a key must be 0600 by its own mode, not by luck of the caller's umask
    try:
        written = make_certs(tmp_path / "tls")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "tls").stat().st_mode) == 0o700
    keys = [p for p in written if p.name.endswith("-key.pem")]
    assert [p.name for p in keys] == ["ca-key.pem", *(f"{n}-key.pem" for n in NAMES)]
    for key in keys:
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
        assert b"BEGIN PRIVATE KEY" in key.read_bytes()  # PKCS8, unencrypted


def test_existing_files_are_refused_and_left_alone_unless_forced(tmp_path):
    out = tmp_path / "tls"
    written = make_certs(out)
    before = {p: p.read_bytes() for p in written}
    (out / "ca.pem").unlink()  # the first file that exists is named, whichever it is
    with pytest.raises(CertsError, match=r"ca-key\.pem already exists: pass --force .*another directory"):
        make_certs(out)
    assert sorted(os.listdir(out)) == sorted(p.name for p in written[1:])  # nothing new, nothing changed
    assert all(p.read_bytes() == before[p] for p in written[1:])

    assert make_certs(out, force=True) == written
    assert all(p.read_bytes() != before[p] for p in written)  # a new CA, so every leaf and key is new
    assert sorted(os.listdir(out)) == sorted(p.name for p in written)  # no temporary files left over


@pytest.mark.parametrize("host", ["", " ", "actor example", "bad_host", "a/b", "actor.example.\n", "foo.*.bar", ".x"])
def test_a_bad_host_is_refused_by_name_and_nothing_is_written(tmp_path, host):
    with pytest.raises(CertsError, match=re.escape(f"bad --host {host!r}")):
        make_certs(tmp_path / "tls", hosts=["ok.example", host])
    assert not (tmp_path / "tls").exists()


@pytest.mark.parametrize("days", [0, -1])
def test_days_below_one_are_refused(tmp_path, days):
    with pytest.raises(CertsError, match=rf"days must be between 1 and \d+, got {days}"):
        make_certs(tmp_path / "tls", days=days)
    assert not (tmp_path / "tls").exists()


async def health_status(port: int, ca_dir, client=None, host: str = "127.0.0.1", name: str | None = None):
    """Health.Check over TLS trusting `ca_dir`'s CA, presenting `client`: (directory, name) of a
    certificate, or None for none; `name` overrides the server name checked against the certificate."""
    key = cert = None
    if client:
        directory, who = client
        key, cert = (directory / f"{who}-key.pem").read_bytes(), (directory / f"{who}.pem").read_bytes()
    credentials = grpc.ssl_channel_credentials((ca_dir / "ca.pem").read_bytes(), key, cert)
    options = [("grpc.ssl_target_name_override", name)] if name else []
    async with grpc.aio.secure_channel(f"{host}:{port}", credentials, options=options) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return reply.status


def test_grpc_mutual_tls_on_loopback_accepts_the_runs_client_and_refuses_others(certs, tmp_path):
    other = make_certs(tmp_path / "other")[0].parent  # a second, unrelated CA

    async def scenario():
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        credentials = grpc.ssl_server_credentials(
            [((certs / "actor-key.pem").read_bytes(), (certs / "actor.pem").read_bytes())],
            root_certificates=(certs / "ca.pem").read_bytes(), require_client_auth=True)
        port = server.add_secure_port("127.0.0.1:0", credentials)
        await server.start()
        try:
            serving = health_pb2.HealthCheckResponse.SERVING
            ours = (certs, "client")
            assert await health_status(port, certs, ours) == serving  # the IP SAN
            assert await health_status(port, certs, ours, host="localhost") == serving
            assert await health_status(port, certs, ours, name="actor") == serving  # the role's own name
            for client, name in (((other, "client"), None), (None, None),
                                 (ours, "reward")):  # another CA's client, no client cert, the wrong server name
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await health_status(port, certs, client, name=name)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE, (client, name)
        finally:
            await server.stop(None)

    asyncio.run(scenario())


def test_the_cli_writes_the_files_then_refuses_to_overwrite_them(tmp_path, capsys):
    out = tmp_path / "tls"
    assert cli.main(["certs", str(out), "--host", "actor.example", "--days", "30"]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(out / f) for n in ("ca", *NAMES) for f in (f"{n}.pem", f"{n}-key.pem")]
    assert all((out / f).is_file() for f in printed)
    actor = load(out / "actor.pem")
    assert "actor.example" in actor.extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    lifetime = actor.not_valid_after_utc - actor.not_valid_before_utc
    assert datetime.timedelta(days=30) <= lifetime <= datetime.timedelta(days=30, minutes=6)

    assert cli.main(["certs", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rolefleet: ") and f"{out / 'ca.pem'} already exists" in err and "--force" in err
    assert cli.main(["certs", str(out), "--host", "bad host"]) == 2
    assert "rolefleet: bad --host 'bad host'" in capsys.readouterr().err
    assert cli.main(["certs", str(out), "--force"]) == 0
