"""Per-op calibration for the simulator: `python benchmarks/bench_ops.py [--quick]`
(same as `lamina bench ops`)."""
import sys

from lamina.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "ops", *sys.argv[1:]]))
