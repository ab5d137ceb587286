"""``actorserve certs`` and ``actorserve etcd-auth`` (docs/security.md): the argument parsers; the work is
in control/ops/certs.py (certificates) and control/ops/etcd_auth.py (etcd users, roles, auth), imported only
when a verb runs so that building the CLI parser stays cheap."""

from __future__ import annotations

import argparse
import sys
from typing import Any

DEFAULT_DAYS = 825  # control.ops.certs.DEFAULT_DAYS (not imported: cryptography is loaded only to run)
CA_MIN_DAYS = 3650

__all__ = ["add_certs_command", "main_certs"]


def add_certs_command(sub: Any) -> None:
    """Register ``actorserve certs --out DIR [--host NAME_OR_IP ...] [--days N] [--force]``."""
    p = sub.add_parser(
        "certs", help="generate a CA and the TLS certificates of every server and role (docs/security.md)",
        description="Write a private CA (ca.pem, ca-key.pem), server certificates for nats-server, etcd "
        "(client and peer) and the gateway's HTTPS port, and one client certificate per internal role "
        "(CN = its etcd user) plus root. Files already there are kept (an existing CA is reused); "
        "keys are mode 0600.")
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write (created 0700)")
    p.add_argument("--host", action="append", default=[], metavar="NAME_OR_IP",
                   help="extra SAN of the server certificates (repeatable; 127.0.0.1, ::1 and localhost always)")
    p.add_argument("--days", type=int, default=DEFAULT_DAYS, metavar="N",
                   help=f"validity of the certificates in days (default: {DEFAULT_DAYS}; "
                        f"the CA: at least {CA_MIN_DAYS})")
    p.add_argument("--force", action="store_true", help="rewrite everything, a new CA included")
    p.set_defaults(func=main_certs)
    a = sub.add_parser(
        "etcd-auth", help="create the per-role etcd users and roles and enable etcd auth (docs/security.md)",
        description="Over mutual TLS with the root certificate of --tls-dir: create one etcd role per internal "
        "role, limited to its key prefixes, a certificate-only user of the same name (the CN of its client "
        "certificate) and root, then enable auth. Does nothing when auth is already on.")
    a.add_argument("--etcd", required=True, metavar="URLS",
                   help="https client URL(s) of the etcd cluster, comma-separated")
    a.add_argument("--tls-dir", required=True, metavar="DIR", help="directory written by `actorserve certs`")
    a.set_defaults(func=_main_etcd_auth)


def main_certs(args: argparse.Namespace) -> int:
    """Run ``actorserve certs``: print the files written (or that nothing was); 2 for bad input."""
    try:
        from control.ops.certs import ensure_certs

        cs = ensure_certs(args.out, args.host, days=args.days, force=args.force)
    except (ValueError, OSError) as e:
        print(f"actorserve certs: {e}", file=sys.stderr)
        return 2
    if cs.written:
        print(f"wrote {len(cs.written)} files into {cs.directory}: {' '.join(cs.written)}")
    else:
        print(f"{cs.directory}: every certificate is already there (--force to rewrite)")
    return 0


def _main_etcd_auth(args: argparse.Namespace) -> int:
    from control.ops.etcd_auth import main_etcd_auth

    return main_etcd_auth(args)
