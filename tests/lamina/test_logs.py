"""Lamina's log lines reach stderr in a process that starts Lamina (CLI, `LLM`, the Ray
workers) where no one configured logging; an application's own logging setup is left as
it is; `LAMINA_LOG_LEVEL` and `LAMINA_CONFIGURE_LOGGING` steer it. Each case is a fresh
Python process (a handler added here would outlive the test)."""
import logging
import os
import re
import subprocess
import sys

from lamina.entrypoints import cli
from lamina.entrypoints.logs import configure_logging

CHILD = """
import logging, sys
{before}
from lamina.entrypoints.logs import configure_logging
first, second = configure_logging(), configure_logging()
logging.getLogger("lamina.kernels").info("an info line")
logging.getLogger("lamina.engine").debug("a debug line")
logging.getLogger("lamina.cluster.executor").warning("a warning line")
print(first is not None, second is None)
"""


def child(env: dict | None = None, before: str = "") -> tuple[str, list[str]]:
    """(stdout, stderr lines) of CHILD run with `env` added to this environment (without
    the LAMINA_ logging variables unless given)."""
    base = {k: v for k, v in os.environ.items()
            if k not in ("LAMINA_LOG_LEVEL", "LAMINA_CONFIGURE_LOGGING")}
    r = subprocess.run([sys.executable, "-c", CHILD.format(before=before)],
                       env={**base, **(env or {})}, capture_output=True, text=True,
                       timeout=120)
    return r.stdout.strip(), [x for x in r.stderr.splitlines() if x] + [f"rc={r.returncode}"]


def test_info_and_up_reach_stderr_once_with_level_time_and_logger():
    out, err = child()
    assert out == "True True"  # added once: a second call adds nothing
    assert len(err) == 3 and err[-1] == "rc=0", err
    stamp = r"\d\d-\d\d \d\d:\d\d:\d\d"
    assert re.fullmatch(rf"INFO {stamp} lamina\.kernels: an info line", err[0]), err
    assert re.fullmatch(rf"WARNING {stamp} lamina\.cluster\.executor: a warning line",
                        err[1]), err


def test_the_level_comes_from_lamina_log_level():
    out, err = child({"LAMINA_LOG_LEVEL": "debug"})
    assert [x.split(": ")[-1] for x in err] == [
        "an info line", "a debug line", "a warning line", "rc=0"]
    out, err = child({"LAMINA_LOG_LEVEL": "WARNING"})
    assert [x.split(": ")[-1] for x in err] == ["a warning line", "rc=0"]
    out, err = child({"LAMINA_LOG_LEVEL": "LOUD"})
    assert "LAMINA_LOG_LEVEL must be a logging level name" in err[-2] and err[-1] == "rc=1"


def test_an_applications_own_logging_setup_is_kept():
    # its root handler shows lamina's records once, in its own format
    out, err = child(before='logging.basicConfig(level=logging.INFO, format="app %(message)s")')
    assert out == "False True"
    assert err == ["app an info line", "app a warning line", "rc=0"]
    out, err = child({"LAMINA_CONFIGURE_LOGGING": "0"})
    assert out == "False True"
    assert err == ["a warning line", "rc=0"]  # Python's own last resort: WARNING and up


def test_under_pytest_the_root_handlers_are_kept():
    assert logging.getLogger().handlers  # pytest's capture
    assert configure_logging() is None


def test_the_cli_configures_logging(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(cli, "configure_logging", lambda: calls.append("configured"))
    assert cli.main(["doctor", "--json"]) == 0
    assert calls == ["configured"] and '"name": "cpu"' in capsys.readouterr().out
