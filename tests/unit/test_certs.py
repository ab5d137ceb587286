"""``actorserve certs`` (control/ops/certs.py), the TLS settings (bus/tls.py), the etcd RBAC table
(control/ops/etcd_auth.py) and the TLS pieces of the embedded servers' configuration. Under 2 s."""

from __future__ import annotations

import argparse
import os
import ssl
import stat

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from bus.tls import TlsFiles
from control.ops.certs import SERVER_CERTS, cert_hosts, client_roles, ensure_certs, etcd_user
from control.ops.certs_cli import main_certs
from control.ops.embedded import etcd_tls_flags
from control.ops.embedded_nats import nats_tls_block
from control.ops.etcd_auth import READ, READWRITE, _range_end, role_permissions
from control.ops.nats_roles import KIND_ROLES, ROLES
from bus.tls import apply_endpoints_tls, endpoints_tls
from control.ops.tls_stack import child_tls_env
from control.state import names


def _load(path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _cn(cert: x509.Certificate) -> str:
    return cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value


def _eku(cert: x509.Certificate) -> set:
    return set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def test_certs_make_a_ca_server_and_role_certificates(tmp_path):
    cs = ensure_certs(tmp_path / "tls", ["10.1.2.3", "etcd-0.etcd"], days=30)
    d = cs.directory
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    ca = _load(cs.ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for name, (server, client) in SERVER_CERTS.items():
        cert = _load(cs.cert(name))
        cert.verify_directly_issued_by(ca)
        assert cert_hosts(cs.cert(name)) == {"127.0.0.1", "::1", "localhost", "10.1.2.3", "etcd-0.etcd"}
        assert (ExtendedKeyUsageOID.SERVER_AUTH in _eku(cert)) == server
        assert (ExtendedKeyUsageOID.CLIENT_AUTH in _eku(cert)) == client
        assert 29 <= (cert.not_valid_after_utc - cert.not_valid_before_utc).days <= 31
    assert set(client_roles()) == {*ROLES, "root"}
    for role in client_roles():
        cert = _load(cs.cert(role))
        cert.verify_directly_issued_by(ca)
        assert _cn(cert) == etcd_user(role) and _eku(cert) == {ExtendedKeyUsageOID.CLIENT_AUTH}
    assert etcd_user("root") == "root" and etcd_user("worker") == "actorserve-worker"
    keys = sorted(d.glob("*-key.pem"))
    assert len(keys) == 1 + len(SERVER_CERTS) + len(client_roles())
    assert all(stat.S_IMODE(os.stat(k).st_mode) == 0o600 for k in keys)
    # the files load as TLS contexts: a server with client verification, a client presenting its role
    TlsFiles.in_dir(d, "nats-server").server_context(require_client_cert=True)
    assert TlsFiles.in_dir(d, "worker").client_context().verify_mode == ssl.CERT_REQUIRED


def test_certs_keep_what_is_there_and_add_hosts(tmp_path):
    d = tmp_path / "tls"
    first = ensure_certs(d)
    assert "ca.pem" in first.written
    ca_before = first.ca.read_bytes()
    worker_before = first.cert("worker").read_bytes()
    again = ensure_certs(d)
    assert again.written == ()
    more = ensure_certs(d, ["node-7"])
    assert "ca.pem" not in more.written and "nats-server.pem" in more.written and "worker.pem" not in more.written
    assert first.ca.read_bytes() == ca_before and first.cert("worker").read_bytes() == worker_before
    _load(first.cert("nats-server")).verify_directly_issued_by(_load(first.ca))
    assert "node-7" in cert_hosts(first.cert("nats-server"))
    forced = ensure_certs(d, force=True)
    assert "ca.pem" in forced.written and first.ca.read_bytes() != ca_before


@pytest.mark.parametrize("hosts, days, what", [(["bad host!"], 10, "--host"), ([], 0, "--days"),
                                               ([], True, "--days")])
def test_certs_refuse_bad_input(tmp_path, hosts, days, what):
    with pytest.raises(ValueError, match=what):
        ensure_certs(tmp_path / "tls", hosts, days=days)


def test_certs_cli(tmp_path, capsys):
    args = argparse.Namespace(out=str(tmp_path / "o"), host=["10.0.0.9"], days=5, force=False)
    assert main_certs(args) == 0 and "wrote" in capsys.readouterr().out
    assert main_certs(args) == 0 and "already there" in capsys.readouterr().out
    assert main_certs(argparse.Namespace(out=str(tmp_path / "p"), host=["x y"], days=5, force=False)) == 2


def test_tls_files_validation_and_env():
    assert TlsFiles.from_env({}) is None
    t = TlsFiles.from_env({"ACTORSERVE_TLS_CA": "/c", "ACTORSERVE_TLS_CERT": "/a", "ACTORSERVE_TLS_KEY": "/k"})
    assert t == TlsFiles("/c", "/a", "/k") and t.env()["ACTORSERVE_TLS_KEY"] == "/k"
    with pytest.raises(ValueError, match="cert and key"):
        TlsFiles.from_env({"ACTORSERVE_TLS_CERT": "/a"})
    with pytest.raises(ValueError, match="ca"):
        TlsFiles(ca="")
    with pytest.raises(ValueError, match="server needs a certificate"):
        TlsFiles(ca="/c").server_context()


def test_etcd_rbac_table_covers_every_role_with_prefixes_only():
    table = role_permissions()
    assert set(table) == set(ROLES)
    for role, perms in table.items():
        for kind, prefix in perms:
            assert kind in (READ, READWRITE)
            assert prefix.startswith(names.ROOT + "/") and prefix.endswith("/")
        metrics = {p for k, p in perms if p.startswith(names.all_metrics_prefix())}
        assert metrics == {f"{names.all_metrics_prefix()}{k}/" for k, r in KIND_ROLES.items() if r == role}
    writes = {role: {p for k, p in perms if k == READWRITE and "/metrics/" not in p} for role, perms in table.items()}
    assert writes["worker"] == {names.all_workers_prefix(), names.hosts_prefix()}  # hosts: multi-version hosts
    assert writes["scheduler"] == {names.schedulers_prefix(), names.sleep_prefix()}  # sleep: wakes a sleeper (0042)
    assert writes["gateway"] == writes["validator"] == writes["jobs"] == set()
    assert names.tenants_prefix() not in {p for _, p in table["worker"]}  # a worker never reads API key hashes
    assert _range_end(b"/actorserve/models/") == b"/actorserve/models0"


def test_server_tls_configuration(tmp_path):
    flags = etcd_tls_flags(tmp_path)
    assert "--client-cert-auth" in flags and "--peer-client-cert-auth" in flags
    assert flags[flags.index("--cert-file") + 1] == str(tmp_path / "etcd-server.pem")
    block = nats_tls_block(tmp_path)
    assert "nats-server-key.pem" in block and "verify: false" in block and nats_tls_block(None) == ""
    env = child_tls_env(tmp_path, "gateway")
    assert env["ACTORSERVE_TLS_CERT"] == str(tmp_path / "gateway.pem")
    assert env["ACTORSERVE_HTTPS_CERT"] == str(tmp_path / "gateway-server.pem")
    assert child_tls_env(tmp_path, "rollout")["ACTORSERVE_TLS_CERT"] == str(tmp_path / "control.pem")
    assert "ACTORSERVE_HTTPS_CERT" not in child_tls_env(tmp_path, "worker")
    target: dict[str, str] = {}
    assert apply_endpoints_tls(endpoints_tls(tmp_path), target)
    assert target["ACTORSERVE_TLS_CERT"].endswith("root.pem")
    assert not apply_endpoints_tls(endpoints_tls(tmp_path), {"ACTORSERVE_TLS_CERT": "/mine.pem"})


def test_cli_constants_match_and_parser_stays_light():
    import subprocess
    import sys

    import control.ops.certs as certs
    import control.ops.certs_cli as cli
    assert (cli.DEFAULT_DAYS, cli.CA_MIN_DAYS) == (certs.DEFAULT_DAYS, certs.CA_MIN_DAYS)
    code = ("import sys, control.ops.cli as c; c.build_parser(); "
            "print(any(m.startswith(('cryptography', 'grpc', 'aetcd')) for m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr  # `actorserve --help` loads neither


def test_a_tls_state_dir_is_not_started_without_tls(tmp_path):
    from control.ops.embedded import ETCD_AUTH_MARKER, EmbeddedStack

    (tmp_path / ETCD_AUTH_MARKER).write_text("on\n")
    with pytest.raises(RuntimeError, match="up --tls"):  # refused before any server starts
        EmbeddedStack(tmp_path).start()
    assert not (tmp_path / "etcd.pid").exists()


def test_gateway_https_context(tmp_path, monkeypatch):
    from gateway.actor import https_context

    d = ensure_certs(tmp_path / "tls").directory
    for var in ("ACTORSERVE_HTTPS_CERT", "ACTORSERVE_HTTPS_KEY"):
        monkeypatch.delenv(var, raising=False)
    assert https_context(argparse.Namespace(tls_cert=None, tls_key=None)) is None  # plain HTTP
    ctx = https_context(argparse.Namespace(tls_cert=str(d / "gateway-server.pem"), tls_key=str(d / "gateway-server-key.pem")))
    assert isinstance(ctx, ssl.SSLContext)
    monkeypatch.setenv("ACTORSERVE_HTTPS_CERT", str(d / "gateway-server.pem"))
    with pytest.raises(SystemExit, match="come together"):
        https_context(argparse.Namespace(tls_cert=None, tls_key=None))
    monkeypatch.setenv("ACTORSERVE_HTTPS_KEY", str(d / "worker-key.pem"))  # not this certificate's key
    with pytest.raises(SystemExit, match="cannot load"):
        https_context(argparse.Namespace(tls_cert=None, tls_key=None))
