#!/usr/bin/env bash
# The GPU checks of issue 32 in one go, on a machine with a CUDA GPU, torch and triton
# (no install: the repo's folders are mapped to the `lamina` package through a shadow
# tree of links). Writes logs and results under ${OUT:-gpu_out}.
#   bash benchmarks/gpu_check.sh [tune|bench|tests ...]   (default: all three)
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
ROOT=$(pwd); PKG=$(mktemp -d)
mkdir -p "$PKG/lamina"
for f in "$ROOT"/lamina/*; do ln -s "$f" "$PKG/lamina/"; done
for d in kernels splitter cluster; do ln -s "$ROOT/$d" "$PKG/lamina/$d"; done
export PYTHONPATH="$PKG:$ROOT" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$OUT/gpu.txt"
steps=${*:-tune bench tests}
for s in $steps; do
  echo "== $s $(date +%T)"
  case $s in
    tune) timeout 200 python3 benchmarks/tune_triton.py --kernel heads --dtype bf16 \
            --out "$OUT/tune_heads_bf16.json" 2>&1 | tee "$OUT/tune.log" ;;
    bench) (cd "$PKG" && timeout 240 python3 -m lamina.entrypoints.cli bench attention \
             --device cuda --out "$(realpath "$ROOT/$OUT" 2>/dev/null || echo "$OUT")") \
             2>&1 | tee "$OUT/bench.log" ;;
    tests) (cd "$PKG" && timeout 150 python3 -m pytest -q -p no:cacheprovider \
             --import-mode=append --rootdir="$ROOT" "$ROOT/tests/kernels/test_triton_backend.py") \
             2>&1 | tee "$OUT/tests.log" ;;
  esac
done
