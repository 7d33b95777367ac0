"""Each test file's time in a run, for the order `make test` hands files to its workers.

`python -m tests.durations LOG` reads a `pytest --durations=0` log (setup, call and
teardown lines, `-n 2` or not) and writes `tests/durations.json`: per file, the sum of
its tests' seconds. `tests/conftest.py` hands the files out longest first, so the last
ones to start are short and both workers finish at about the same time (xdist's own
order, most tests first, left a three-test file of 150 s for last: one core idle for
two minutes). A file missing from the table (a new one) counts as `DEFAULT_S`.
"""
from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

TABLE = Path(__file__).with_name("durations.json")
DEFAULT_S = 10.0
_LINE = re.compile(r"([0-9.]+)s (?:setup|call|teardown)\s+(tests/\S+?\.py)::")


def per_file(log: str) -> dict[str, float]:
    """{test file: seconds} summed over the log's duration lines."""
    out: dict[str, float] = defaultdict(float)
    for m in _LINE.finditer(log):
        out[m.group(2)] += float(m.group(1))
    return {k: round(v, 1) for k, v in sorted(out.items())}


def load() -> dict[str, float]:
    return json.loads(TABLE.read_text()) if TABLE.exists() else {}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    table = per_file(Path(argv[0]).read_text())
    if not table:
        print(f"no duration lines in {argv[0]} (run pytest with --durations=0)",
              file=sys.stderr)
        return 1
    TABLE.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{TABLE}: {len(table)} files, {sum(table.values()):.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
