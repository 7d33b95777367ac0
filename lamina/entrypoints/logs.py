"""Lamina's log lines on stderr, where no one else configured logging.

Data in: the environment: `LAMINA_LOG_LEVEL` (a `logging` level name, default INFO) and
`LAMINA_CONFIGURE_LOGGING` (0 leaves logging alone). Data out: the "lamina" logger (every
module's logger is below it) with one stderr handler, at that level.

Python shows nothing under WARNING until an application configures logging, so a
deployment's own account of itself (the dense backend chosen, the transports each worker
pair uses, a recovery) and the one-time steps of a first start (building the CPU kernel:
minutes on 2 cores; tracing the model: seconds) went unseen, and a first start looked
hung. Like vLLM's logger, `configure_logging` gives Lamina's messages a handler of their
own when a process starts Lamina (`lamina` CLI, `LLM`, each Ray worker: its stderr goes
to Ray's log of that worker). An application that configured logging itself (a handler
on the root logger: `logging.basicConfig`, pytest's capture) keeps its own setup: nothing
is added, and its handlers show Lamina's records as they show any other's.
"""
from __future__ import annotations

import logging
import os
import sys

FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"
DATEFMT = "%m-%d %H:%M:%S"
_MARK = "_lamina_handler"  # on the handler this module added (added once a process)


def configure_logging() -> logging.Handler | None:
    """Give the "lamina" logger a stderr handler at `LAMINA_LOG_LEVEL`; the handler, or
    None where logging is left as it is (turned off, the root logger already has
    handlers, or another call added it already)."""
    if os.environ.get("LAMINA_CONFIGURE_LOGGING", "1").strip().lower() in ("0", "false", "off"):
        return None
    name = os.environ.get("LAMINA_LOG_LEVEL", "INFO").strip().upper()
    level = logging.getLevelName(name)
    if not isinstance(level, int):
        raise ValueError(f"LAMINA_LOG_LEVEL must be a logging level name (DEBUG, INFO, "
                         f"WARNING, ERROR), got {name!r}")
    logger = logging.getLogger("lamina")
    if logging.getLogger().handlers or any(getattr(h, _MARK, False) for h in logger.handlers):
        return None
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT, DATEFMT))
    setattr(handler, _MARK, True)
    logger.addHandler(handler)
    logger.setLevel(level)
    # a root handler added later (the application's) would print each line a second time
    logger.propagate = False
    return handler
