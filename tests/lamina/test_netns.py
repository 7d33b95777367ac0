"""Emulated hosts (`lamina.bench.netns`): a namespace behind a veth link shaped to 100
Mbit/s takes a TCP connection from this side at its own address, and 4 MB sent through
it take at least 80% of what the rate allows (the shaping is there; unshaped, the same
bytes take milliseconds); everything is gone after `remove`; what a dead process left
is removed when the next ones are made, and it no longer shadows their subnet."""
import socket
import subprocess
import threading
import time

import pytest

from lamina.bench.netns import delete_host, host_names, make_namespaces, sh, unavailable


def listed() -> tuple[str, str]:
    """This host's links and its namespaces, as `ip` lists them."""
    return tuple(subprocess.run(cmd, capture_output=True, text=True).stdout
                 for cmd in (["ip", "-o", "link"], ["ip", "netns", "list"]))


def test_a_shaped_link_carries_tcp_at_its_rate():
    nets, why = make_namespaces(1, subnet="10.215", rate_mbit=100)
    if nets is None:
        pytest.skip(why)
    try:
        srv = nets.listen(1)
        assert srv.getsockname()[0] == nets.ip(1)
        got = []

        def drain():
            conn, _ = srv.accept()
            with conn:
                while chunk := conn.recv(1 << 16):
                    got.append(len(chunk))

        t = threading.Thread(target=drain)
        t.start()
        payload = b"x" * (4 << 20)
        t0 = time.perf_counter()
        with socket.create_connection(srv.getsockname(), timeout=30) as c:
            c.sendall(payload)
        t.join(timeout=30)
        seconds = time.perf_counter() - t0
        srv.close()
        assert sum(got) == len(payload)
        assert seconds >= 0.8 * len(payload) * 8 / 100e6, seconds  # 100 Mbit/s: 0.34 s
    finally:
        nets.remove()
    links, spaces = listed()
    assert nets.links[0] not in links and nets.names[0] not in spaces


def test_what_a_dead_process_left_is_removed_before_new_ones_are_made():
    if why := unavailable():
        pytest.skip(why)
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid names the leftovers, as a killed run's would
    ns, link = host_names(dead.pid, 1)
    sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", link, "type", "veth", "peer", "name", link + "p")
    sh("ip", "addr", "add", "10.216.1.1/24", "dev", link)  # the subnet the new ones take
    sh("ip", "link", "set", link, "up")
    nets, why = make_namespaces(1, subnet="10.216")
    try:
        links, spaces = listed()
        assert link not in links and ns not in spaces
        srv = nets.listen(1)  # reachable at its address: no stale route in the way
        with socket.create_connection(srv.getsockname(), timeout=10):
            pass
        srv.close()
    finally:
        if nets is not None:
            nets.remove()
        delete_host(ns, link)
