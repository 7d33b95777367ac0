"""Emulated hosts (`lamina.bench.netns`): a namespace behind a veth link shaped to 100
Mbit/s takes a TCP connection from this side at its own address, and 4 MB sent through
it take at least 80% of what the rate allows (the shaping is there; unshaped, the same
bytes take milliseconds); everything is gone after `remove`."""
import socket
import subprocess
import threading
import time

import pytest

from lamina.bench.netns import make_namespaces


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
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert nets.links[0] not in links and nets.names[0] not in spaces
