"""Attention kernel benchmark: `python benchmarks/bench_attention.py [--repeat N]`
(same as `lamina bench attention`; `lamina --threads 2 bench attention` for 2 threads)."""
import sys

from lamina.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "attention", *sys.argv[1:]]))
