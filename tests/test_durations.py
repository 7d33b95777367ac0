"""The per-file time table that orders `make test`'s files (`tests/durations.py`)."""
from pathlib import Path

from tests.durations import TABLE, load, per_file

ROOT = Path(__file__).resolve().parents[1]

LOG = """\
============================= slowest durations ==============================
12:05:18 87.93s call     tests/lamina/test_real_clients.py::test_bench_serve_quick
81.59s call     tests/cluster/test_ray_ring.py::test_ring_of_three[4]
2.50s setup    tests/lamina/test_real_clients.py::test_lm_eval
0.01s teardown tests/lamina/test_real_clients.py::test_lm_eval
1.00s call     tests/test_layout.py::test_imports_point_one_way
(33 durations < 0.005s hidden.  Use -vv to show these durations.)
"""


def test_per_file_sums_setup_call_and_teardown():
    assert per_file(LOG) == {"tests/cluster/test_ray_ring.py": 81.6,
                             "tests/lamina/test_real_clients.py": 90.4,
                             "tests/test_layout.py": 1.0}


def test_the_table_names_only_test_files_that_exist():
    table = load()
    assert TABLE.exists() and table
    assert [f for f in table if not (ROOT / f).is_file()] == []
    assert all(s >= 0 for s in table.values())
