"""What each test costs the machine, not only its wall time: a pytest plugin, and the
per-file table of what it wrote.

    PYTHONPATH=benchmarks python -m pytest -p suite_cpu tests/cluster ...
    python benchmarks/suite_cpu.py [FILE]

For every test it appends a JSON line to $SUITE_CPU_OUT (default
benchmarks/results/suite_cpu.jsonl): its wall seconds (setup, call and teardown) and
the CPU seconds the whole machine was busy meanwhile (/proc/stat: user, nice, system,
irq, softirq, steal), which counts what `pytest --durations` cannot: the Ray processes,
servers and workers a test starts. Run alone (no xdist), busy/wall says how many cores
a test keeps busy: below 1, it mostly waits (timeouts, a restart's backoff), and beside
it the other xdist worker's tests have a core; near 2, it contends with them. Run the
suite's files so to see where its CPU goes before trimming them.
"""
from __future__ import annotations

import collections
import json
import os
import sys
import time
from pathlib import Path

import pytest

OUT = Path(os.environ.get("SUITE_CPU_OUT",
                          Path(__file__).with_name("results") / "suite_cpu.jsonl"))
_HZ = os.sysconf("SC_CLK_TCK")


def busy_seconds() -> float:
    """CPU seconds the machine has been busy since boot (every core, /proc/stat)."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / _HZ  # less idle and iowait


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    b, t = busy_seconds(), time.monotonic()
    yield
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with open(OUT, "a") as f:
        f.write(json.dumps({"id": item.nodeid, "wall": round(time.monotonic() - t, 2),
                            "cpu": round(busy_seconds() - b, 2)}) + "\n")


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else OUT
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for row in map(json.loads, path.read_text().splitlines()):
        f = files[row["id"].split("::")[0]]
        f[0] += row["wall"]
        f[1] += row["cpu"]
    print("| file | wall s | busy CPU s | cores |\n|---|---|---|---|")
    for name, (wall, cpu) in sorted(files.items(), key=lambda kv: -kv[1][0]):
        print(f"| {name} | {wall:.1f} | {cpu:.1f} | {cpu / max(wall, 0.01):.2f} |")
    wall, cpu = (sum(v[i] for v in files.values()) for i in (0, 1))
    print(f"| all | {wall:.1f} | {cpu:.1f} | {cpu / max(wall, 0.01):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
