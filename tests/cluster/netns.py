"""Network namespaces as "hosts" for the cluster test (root only, this machine only).

:class:`Network` makes one Linux bridge in the root namespace and ``hosts`` namespaces, each joined to
the bridge by a veth pair, with ``lo`` up and one address on a private /24 (``10.77.N.1`` ..
``10.77.N.<hosts>``; the bridge itself is ``10.77.N.254``, so the test process in the root namespace
reaches every host directly). Names carry the owning pid (``ascl<pid>h1``, bridge ``ascb<pid>``, host
side of a veth ``ascv<pid>h1``), so a concurrent run never clashes, and a run killed before its teardown
is recognised by its dead pid and removed by the next run (:func:`remove_leftovers`: the processes still
inside those namespaces are SIGKILLed by pid, from ``ip netns pids``, then the namespaces and links go).
The subnet is the first ``10.77.N.0/24`` with no route on this machine yet.

A partition is ``ip link set eth0 down`` inside the host's namespace (its veth loses carrier on both
sides: no packet in or out), healed with ``up``.
"""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import subprocess
from dataclasses import dataclass, field

from control.ops.supervisor_processes import pid_alive as _pid_alive

PREFIX = "ascl"  # namespaces: ascl<pid>h<i>
BRIDGE_PREFIX = "ascb"
VETH_PREFIX = "ascv"
HOST_IF = "eth0"  # the veth end inside each namespace
_NS_RE = re.compile(rf"^{PREFIX}(\d+)h\w+$")
_LINK_RE = re.compile(rf"^(?:{BRIDGE_PREFIX}|{VETH_PREFIX})(\d+)")


def sh(*argv: str, check: bool = True, timeout: float = 10.0) -> subprocess.CompletedProcess:
    """Run ``argv`` (no shell), capture output; CalledProcessError (with stderr) when it fails and ``check``."""
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise subprocess.CalledProcessError(r.returncode, argv, r.stdout, r.stderr)
    return r


def netns_list() -> list[str]:
    """Names of every network namespace (``ip netns list``)."""
    out = sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def ns_pids(ns: str) -> list[int]:
    """Pids of the processes inside namespace ``ns``."""
    out = sh("ip", "netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split() if p.isdigit()]


def _links() -> list[str]:
    out = sh("ip", "-o", "link", "show", check=False).stdout
    names = []
    for line in out.splitlines():
        parts = line.split(": ", 2)
        if len(parts) >= 2:
            names.append(parts[1].split("@")[0])
    return names


def delete_ns(ns: str) -> None:
    """SIGKILL every process left inside ``ns`` (by pid), then delete the namespace."""
    for pid in ns_pids(ns):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    sh("ip", "netns", "del", ns, check=False)


def remove_leftovers() -> list[str]:
    """Remove namespaces and links of earlier runs whose owning pid is dead; returns what was removed."""
    removed = []
    for ns in netns_list():
        m = _NS_RE.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            delete_ns(ns)
            removed.append(ns)
    for link in _links():
        m = _LINK_RE.match(link)
        if m and not _pid_alive(int(m.group(1))):
            sh("ip", "link", "del", link, check=False)
            removed.append(link)
    return removed


def free_subnet(second: int = 77) -> ipaddress.IPv4Network:
    """The first ``10.<second>.N.0/24`` (N from 0) that no route of this machine covers or overlaps."""
    routes = []
    for line in sh("ip", "-4", "route", "show", "table", "all", check=False).stdout.splitlines():
        dst = line.split()[0] if line.split() else ""
        if dst and dst != "default" and dst[0].isdigit() and not dst.startswith("127."):
            try:
                routes.append(ipaddress.ip_network(dst, strict=False))
            except ValueError:
                continue
    for n in range(256):
        net = ipaddress.ip_network(f"10.{second}.{n}.0/24")
        if not any(net.overlaps(r) for r in routes):
            return net
    raise RuntimeError(f"no free 10.{second}.N.0/24 subnet for the cluster test")


@dataclass
class Network:
    """A bridge plus ``hosts`` namespaces (see the module docstring). ``up()`` builds it, ``down()``
    removes everything (idempotent; also kills what still runs inside the namespaces)."""

    hosts: tuple[str, ...] = ("h1", "h2", "h3", "load")
    owner: int = field(default_factory=os.getpid)
    subnet: ipaddress.IPv4Network | None = None
    built: list[str] = field(default_factory=list)

    def ns(self, host: str) -> str:
        """The namespace name of ``host``."""
        return f"{PREFIX}{self.owner}{host}"

    @property
    def bridge(self) -> str:
        """The bridge's name (root namespace)."""
        return f"{BRIDGE_PREFIX}{self.owner}"

    def veth(self, host: str) -> str:
        """The root-side end of ``host``'s veth pair."""
        return f"{VETH_PREFIX}{self.owner}{host}"[:15]

    def addr(self, host: str) -> str:
        """``host``'s IPv4 address (``10.77.N.<index + 1>``)."""
        assert self.subnet is not None, "network not up"
        return str(self.subnet.network_address + self.hosts.index(host) + 1)

    @property
    def bridge_addr(self) -> str:
        """The bridge's address in the root namespace (``10.77.N.254``)."""
        assert self.subnet is not None, "network not up"
        return str(self.subnet.network_address + 254)

    def up(self) -> "Network":
        """Create the bridge, the namespaces and their links; on failure remove what was made and raise."""
        remove_leftovers()
        self.subnet = self.subnet or free_subnet()
        plen = self.subnet.prefixlen
        try:
            sh("ip", "link", "add", self.bridge, "type", "bridge")
            self.built.append(self.bridge)
            sh("ip", "addr", "add", f"{self.bridge_addr}/{plen}", "dev", self.bridge)
            sh("ip", "link", "set", self.bridge, "up")
            for h in self.hosts:
                ns, veth = self.ns(h), self.veth(h)
                sh("ip", "netns", "add", ns)
                self.built.append(ns)
                sh("ip", "link", "add", veth, "type", "veth", "peer", "name", f"{veth[:13]}p")
                sh("ip", "link", "set", f"{veth[:13]}p", "netns", ns)
                sh("ip", "link", "set", veth, "master", self.bridge, "up")
                sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
                sh("ip", "netns", "exec", ns, "ip", "link", "set", f"{veth[:13]}p", "name", HOST_IF)
                sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.addr(h)}/{plen}", "dev", HOST_IF)
                sh("ip", "netns", "exec", ns, "ip", "link", "set", HOST_IF, "up")
        except BaseException:
            self.down()
            raise
        return self

    def exec_prefix(self, host: str) -> list[str]:
        """argv prefix running a command inside ``host``'s namespace (``ip netns exec`` execs in place:
        the spawned pid is the command's own)."""
        return ["ip", "netns", "exec", self.ns(host)]

    def partition(self, host: str) -> None:
        """Cut ``host`` off the network (its interface down: nothing in, nothing out)."""
        sh(*self.exec_prefix(host), "ip", "link", "set", HOST_IF, "down")

    def heal(self, host: str) -> None:
        """Undo :meth:`partition`."""
        sh(*self.exec_prefix(host), "ip", "link", "set", HOST_IF, "up")

    def down(self) -> None:
        """Kill what runs inside the namespaces, delete them and the bridge (and any veth left)."""
        for h in self.hosts:
            ns = self.ns(h)
            if ns in netns_list():
                delete_ns(ns)
            sh("ip", "link", "del", self.veth(h), check=False)
        sh("ip", "link", "del", self.bridge, check=False)
        self.built.clear()
