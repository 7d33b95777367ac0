"""KV fragmentation report, token slabs vs 16-token pages:
`python benchmarks/bench_fragmentation.py` (same as `lamina bench fragmentation`)."""
import sys

from lamina.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "fragmentation", *sys.argv[1:]]))
