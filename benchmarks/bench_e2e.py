"""End-to-end decode benchmark: `python benchmarks/bench_e2e.py [--quick]`
(same as `lamina bench e2e`)."""
import sys

from lamina.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "e2e", *sys.argv[1:]]))
