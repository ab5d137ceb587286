"""Loopback port helpers for the embedded infrastructure and tests.

Everything here binds 127.0.0.1 only.
"""

from __future__ import annotations

import socket
import time

LOOPBACK = "127.0.0.1"


def free_port(host: str = LOOPBACK) -> int:
    """Return a TCP port that is currently free on ``host`` (default 127.0.0.1).

    The port is found by binding port 0 and reading back what the kernel chose; the socket is
    closed before returning, so there is a small race window before the caller binds it.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """Return ``count`` distinct free TCP ports on ``host``.

    All sockets are held open until every port has been chosen, so the ports are distinct.
    Raises ValueError if ``count`` is negative.
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((host, 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def port_open(port: int, host: str = LOOPBACK, timeout: float = 0.2) -> bool:
    """Return True if a TCP connect to ``host:port`` succeeds within ``timeout`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_port(port: int, host: str = LOOPBACK, timeout: float = 10.0, interval: float = 0.05) -> bool:
    """Poll until ``host:port`` accepts TCP connections; return False after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_open(port, host):
            return True
        time.sleep(interval)
    return False


def is_loopback_host(host: str) -> bool:
    """Return True if ``host`` names the local loopback interface (127.0.0.0/8, ::1, localhost)."""
    h = host.strip("[]").lower()
    return h == "localhost" or h == "::1" or h.startswith("127.")
