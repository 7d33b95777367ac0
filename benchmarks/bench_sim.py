"""Simulator vs engine decode throughput: `python benchmarks/bench_sim.py [--quick]`
(same as `lamina bench sim`)."""
import sys

from lamina.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "sim", *sys.argv[1:]]))
