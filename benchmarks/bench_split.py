"""Split-time benchmark: `python benchmarks/bench_split.py [--model PATH] [--repeat N]`
(same as `lamina bench split`)."""
import sys

from lamina.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "split", *sys.argv[1:]]))
