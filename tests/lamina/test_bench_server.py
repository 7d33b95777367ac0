"""The benchmarks' server process (`lamina.bench.load.Server`): it is up once /health
answers 200; `stop` ends it and removes its log; a server that exits before it is
healthy is an error naming its log (kept) with the log's tail in the message; one that
exits on its own during the run keeps its log, named when it is stopped."""
import re
import signal
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from lamina.bench.load import Server, _free_port

# a stand-in server: /health answers 200, anything else 404. It ignores SIGINT, as a
# server started from a background job of a non-interactive shell does.
HEALTH = """
import http.server, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path in ("/health", "/quit") else 404)
        self.end_headers()
        if self.path == "/quit":
            print("asked to quit", flush=True)
            import os
            os._exit(5)
    def log_message(self, *a):
        pass
print("stand-in up", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_healthy_server_is_stopped_and_its_log_removed():
    port = _free_port()
    s = Server(port, [], timeout_s=60, cmd=[sys.executable, "-c", HEALTH, str(port)])
    log = Path(s.log.name)
    assert log.exists() and log.name.startswith(f"lamina-serve-{port}-")
    s.stop()
    # ended by the stop's SIGTERM, not by the SIGKILL that follows a minute of waiting
    assert s.proc.returncode == -signal.SIGTERM and not log.exists()


def test_a_server_that_exits_is_an_error_naming_its_kept_log():
    cmd = [sys.executable, "-c", "print('no model here', flush=True); raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match="exited with 3") as e:
        Server(_free_port(), [], timeout_s=60, cmd=cmd)
    [name] = re.findall(r"see (\S+\.log)", str(e.value))
    assert "no model here" in str(e.value)
    assert "no model here" in Path(name).read_text()
    Path(name).unlink()


def test_a_server_that_died_during_the_run_keeps_its_log(capsys):
    port = _free_port()
    s = Server(port, [], timeout_s=60, cmd=[sys.executable, "-c", HEALTH, str(port)])
    try:
        urllib.request.urlopen(s.url + "/quit", timeout=10).close()
    except OSError:
        pass  # it may exit before the answer is read
    deadline = time.monotonic() + 30
    while s.proc.poll() is None:
        assert time.monotonic() < deadline, "the stand-in did not exit"
        time.sleep(0.05)
    s.stop()
    log = Path(s.log.name)
    assert f"exited with 5 before it was stopped; its log: {log}" in capsys.readouterr().err
    assert "asked to quit" in log.read_text()
    log.unlink()
