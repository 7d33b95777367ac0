"""Simulator scale, 1,000 requests on 64 + 256 devices: `python benchmarks/bench_sim_scale.py`
(same as `lamina bench sim-scale`)."""
import sys

from lamina.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "sim-scale", *sys.argv[1:]]))
