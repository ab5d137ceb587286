"""A private CA and every certificate a TLS stack needs (docs/security.md), made with
the ``cryptography`` library (``actorserve certs``, control/ops/certs_cli.py). ECDSA P-256 keys, SHA-256
signatures.

Files written into the output directory (keys mode 0600, certificates 0644; see :data:`SERVER_CERTS`,
:func:`client_roles`):

* ``ca.pem`` / ``ca-key.pem``: the CA (validity ``max(days, 3650)`` days). An existing CA is reused, so
  certificates added later (more ``--host`` names) still verify against the ``ca.pem`` already handed out;
* server certificates, SANs ``127.0.0.1``, ``::1``, ``localhost`` and every ``--host``:
  ``nats-server`` (NATS client port), ``etcd-server`` (etcd client port; also client auth: etcd's own
  gRPC gateway dials itself with it), ``etcd-peer`` (raft between members, server and client auth),
  ``gateway-server`` (the gateway's HTTPS port);
* one client certificate per internal role (control/ops/nats_roles.py ``ROLES``: gateway, validator,
  scheduler, worker, jobs, control) and ``root`` (supervisor and CLI): ``<role>.pem`` / ``<role>-key.pem``,
  CN = the role's etcd user name (:func:`etcd_user`; etcd with ``--client-cert-auth`` takes the user from
  the CN), client auth only.

:func:`ensure_certs` writes what is missing (and rewrites server certificates whose SANs lack a requested
host); ``force`` rewrites everything, CA included. Raises ValueError for a bad host or ``days``.
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from control.ops.etcd_auth import ROOT_ROLE, client_roles, etcd_user  # noqa: F401 (re-exported)

__all__ = ["CertSet", "ensure_certs", "etcd_user", "client_roles", "SERVER_CERTS", "ROOT_ROLE", "DEFAULT_DAYS",
           "CA_MIN_DAYS", "cert_hosts"]

DEFAULT_DAYS = 825
CA_MIN_DAYS = 3650
LOOPBACK_NAMES = ("127.0.0.1", "::1", "localhost")
# server certificate name -> (server auth, client auth)
SERVER_CERTS = {"nats-server": (True, False), "etcd-server": (True, True), "etcd-peer": (True, True),
                "gateway-server": (True, False)}
_DNS = re.compile(r"^(?=.{1,253}$)(\*\.)?([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")


@dataclass(frozen=True)
class CertSet:
    """The files of one certificate directory (``directory``): ``written`` lists the files this call
    created or rewrote (paths relative to ``directory``)."""

    directory: Path
    written: tuple[str, ...] = field(default=())

    @property
    def ca(self) -> Path:
        """``ca.pem``."""
        return self.directory / "ca.pem"

    def cert(self, name: str) -> Path:
        """``<name>.pem`` (a server certificate name or a role)."""
        return self.directory / f"{name}.pem"

    def key(self, name: str) -> Path:
        """``<name>-key.pem``."""
        return self.directory / f"{name}-key.pem"


def _check_host(host: str) -> str:
    h = host.strip()
    try:
        return str(ipaddress.ip_address(h))
    except ValueError:
        pass
    if not _DNS.match(h):
        raise ValueError(f"--host {host!r} is neither an IP address nor a DNS name")
    return h.lower()


def _san(hosts: Iterable[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def cert_hosts(path: str | os.PathLike[str]) -> set[str]:
    """The SAN entries (IP addresses and DNS names, as strings) of the PEM certificate at ``path``;
    empty when it has none. Raises OSError / ValueError for a missing or unreadable file."""
    cert = x509.load_pem_x509_certificate(Path(path).read_bytes())
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    return {str(v) for v in san.get_values_for_type(x509.IPAddress)} | set(san.get_values_for_type(x509.DNSName))


def _write(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _builder(subject: str, issuer: x509.Name | None, public_key: Any, days: int) -> x509.CertificateBuilder:
    now = _dt.datetime.now(_dt.timezone.utc)
    name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "actorserve"),
                      x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    return (x509.CertificateBuilder().subject_name(name).issuer_name(issuer or name).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _dt.timedelta(minutes=5)).not_valid_after(now + _dt.timedelta(days=days))
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False))


def _make_ca(cs: CertSet, days: int) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _new_key()
    cert = (_builder("actorserve CA", None, key.public_key(), max(days, CA_MIN_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    _write(cs.key("ca"), _key_pem(key), 0o600)
    _write(cs.ca, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return cert, key


def _make_leaf(cs: CertSet, name: str, cn: str, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey,
               days: int, *, server: bool, client: bool, hosts: Iterable[str] = ()) -> None:
    key = _new_key()
    usages = [oid for oid, on in ((ExtendedKeyUsageOID.SERVER_AUTH, server), (ExtendedKeyUsageOID.CLIENT_AUTH, client))
              if on]
    b = (_builder(cn, ca.subject, key.public_key(), days)
         .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
         .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                      data_encipherment=False, key_agreement=True, key_cert_sign=False,
                                      crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
         .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
         .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False))
    hosts = list(hosts)
    if hosts:
        b = b.add_extension(_san(hosts), critical=False)
    cert = b.sign(ca_key, hashes.SHA256())
    _write(cs.key(name), _key_pem(key), 0o600)
    _write(cs.cert(name), cert.public_bytes(serialization.Encoding.PEM), 0o644)


def ensure_certs(directory: str | os.PathLike[str], hosts: Iterable[str] = (), *, days: int = DEFAULT_DAYS,
                 force: bool = False) -> CertSet:
    """Make sure ``directory`` (created 0700 if missing) holds the CA and every certificate (module
    docstring) for ``hosts`` (IP addresses or DNS names, beside the loopback names) valid ``days`` days;
    returns the :class:`CertSet` with the files written. ``force``: new CA and new certificates.
    Raises ValueError for a bad host or ``days`` < 1, OSError when the directory is not writable."""
    if isinstance(days, bool) or not isinstance(days, int) or days < 1:
        raise ValueError(f"--days must be a positive integer, got {days!r}")
    wanted = list(dict.fromkeys([*LOOPBACK_NAMES, *(_check_host(h) for h in hosts)]))
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    cs = CertSet(d)
    written: list[str] = []
    if force or not (cs.ca.is_file() and cs.key("ca").is_file()):
        ca, ca_key = _make_ca(cs, days)
        written += ["ca.pem", "ca-key.pem"]
        force = True  # every certificate must chain to the new CA
    else:
        ca = x509.load_pem_x509_certificate(cs.ca.read_bytes())
        ca_key = serialization.load_pem_private_key(cs.key("ca").read_bytes(), password=None)
    for name, (server, client) in SERVER_CERTS.items():
        path = cs.cert(name)
        if force or not (path.is_file() and cs.key(name).is_file()) or not set(wanted) <= cert_hosts(path):
            _make_leaf(cs, name, name, ca, ca_key, days, server=server, client=client, hosts=wanted)
            written += [path.name, cs.key(name).name]
    for role in client_roles():
        if force or not (cs.cert(role).is_file() and cs.key(role).is_file()):
            _make_leaf(cs, role, etcd_user(role), ca, ca_key, days, server=False, client=True)
            written += [cs.cert(role).name, cs.key(role).name]
    return CertSet(d, tuple(written))
