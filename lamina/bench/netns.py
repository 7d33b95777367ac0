"""Emulated hosts on this machine, for benchmarks and tests that need a real network hop.

Data in: how many hosts, their subnet prefix and, optionally, a link rate. Data out:
network namespaces, host n joined to this one by a veth pair (`<subnet>.<n>.1` on this
side, `<subnet>.<n>.2` in the namespace, its default route through this side), both ends
shaped by `tc tbf` when a rate is given (`tc netem` is not available on these machines;
tbf is); `listen` makes a TCP server socket inside one. Needs root and iproute2; every
namespace and link goes with `remove`, and those of a process that died before it did
(a killed test run) go when the next ones are made: their routes would shadow the new
links of the same subnet.
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import socket
import subprocess
import threading

CLONE_NEWNET = 0x40000000


def sh(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if r.returncode:
        raise OSError(f"{' '.join(cmd)}: {r.stderr.strip()}")


def host_names(pid: int, n: int) -> tuple[str, str]:
    """Host n's namespace and this side's link end, for the process `pid` that made them
    (`remove_stale` reads the pid back)."""
    return f"lmt{pid}n{n}", f"lm{pid}v{n}"


def delete_host(ns: str, link: str) -> None:
    """Remove a namespace and this side's end of its link (the peer end goes with it);
    either may be gone already."""
    subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=30)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


class Namespaces:
    """Network namespaces n = 1, 2, ... each joined to this host by a veth pair."""

    def __init__(self, count: int, subnet: str = "10.213", rate_mbit: int | None = None):
        self.subnet = subnet
        names = [host_names(os.getpid(), n) for n in range(1, count + 1)]
        self.names = [ns for ns, _ in names]
        self.links = [link for _, link in names]  # this host's ends
        def shape(dev: str) -> list[tuple[str, ...]]:  # both ends of a link: tc tbf
            return [] if rate_mbit is None else [(
                "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit",
                "burst", "256kb", "latency", "100ms")]

        try:
            for n, (ns, link) in enumerate(zip(self.names, self.links), 1):
                sh("ip", "netns", "add", ns)
                sh("ip", "link", "add", link, "type", "veth", "peer", "name", link + "p")
                sh("ip", "link", "set", link + "p", "netns", ns)
                sh("ip", "addr", "add", f"{self.host_ip(n)}/24", "dev", link)
                sh("ip", "link", "set", link, "up")
                for cmd in shape(link):
                    sh(*cmd)
                for cmd in (("ip", "addr", "add", f"{self.ip(n)}/24", "dev", link + "p"),
                            ("ip", "link", "set", link + "p", "up"),
                            ("ip", "link", "set", "lo", "up"),
                            ("ip", "route", "add", "default", "via", self.host_ip(n)),
                            *shape(link + "p")):
                    sh("ip", "netns", "exec", ns, *cmd)
        except OSError:
            self.remove()
            raise

    def ip(self, n: int) -> str:
        """Host n's address (inside its namespace)."""
        return f"{self.subnet}.{n}.2"

    def host_ip(self, n: int) -> str:
        """This side's address on host n's link."""
        return f"{self.subnet}.{n}.1"

    def listen(self, n: int) -> socket.socket:
        """A listening TCP socket at host n's address, made inside its namespace (on a
        thread that joins it: a socket keeps the namespace it was made in)."""
        out: list = []

        def make():
            try:
                fd = os.open(f"/var/run/netns/{self.names[n - 1]}", os.O_RDONLY)
                try:
                    if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET):
                        raise OSError(ctypes.get_errno(), "setns")
                finally:
                    os.close(fd)
                out.append(socket.create_server((self.ip(n), 0)))
            except OSError as e:
                out.append(e)

        t = threading.Thread(target=make)
        t.start()
        t.join()
        if isinstance(out[0], OSError):
            raise out[0]
        return out[0]

    def remove(self) -> None:
        for ns, link in zip(self.names, self.links):
            delete_host(ns, link)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    return True


def remove_stale() -> list[str]:
    """Remove the namespaces (and this side's link ends) of processes no longer alive;
    -> their names."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                         timeout=30).stdout
    gone = []
    for name in (line.split()[0] for line in out.splitlines() if line.strip()):
        m = re.fullmatch(r"lmt(\d+)n(\d+)", name)
        if m and not _alive(int(m[1])):
            delete_host(*host_names(int(m[1]), int(m[2])))
            gone.append(name)
    return gone


def unavailable() -> str:
    """Why network namespaces cannot be made here; "" where they can be tried."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "network namespaces need root and iproute2's `ip`"
    return ""


def make_namespaces(count: int, **kw) -> tuple[Namespaces | None, str]:
    """-> (the namespaces, "") or (None, why they cannot be made here)."""
    if why := unavailable():
        return None, why
    try:
        remove_stale()
        return Namespaces(count, **kw), ""
    except OSError as e:
        return None, f"cannot make network namespaces here: {e}"
