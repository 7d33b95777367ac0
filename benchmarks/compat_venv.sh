#!/usr/bin/env bash
# A venv with the GPU machines' torch, Triton and transformers (torch 2.11.0, whose CUDA
# build brings Triton 3.6.0, and transformers 5.17.0: older than this repo's pins) and
# this venv's versions of everything else, to run the suite here as the GPU machine
# will before device time is spent on it (benchmarks/RESULTS.md, 2026-11-27 afternoon):
#   bash benchmarks/compat_venv.sh          (~5 GB: torch's CUDA build and its libraries)
#   PATH=$PWD/.venv-compat/bin:$PATH WORKERS=2 DEADLINE_S=1800 SUITE_S=1700 \
#       bash benchmarks/gpu_check.sh suite   (~10 min on 2 cores)
# (gpu_check.sh maps the repo onto the package without an install, as on the device.)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$PWD/.venv/bin/python}
VENV=${VENV:-.venv-compat}
TORCH=${TORCH:-2.11.0} TRANSFORMERS=${TRANSFORMERS:-5.17.0}
# this venv's versions of what the package and the tests import, but torch, triton and
# transformers (and lamina itself)
PINS=$("$PY" -m pip freeze --exclude-editable | grep -viE '^(torch|triton|transformers|lamina|nvidia-|cuda-)[=-]')
test -x "$VENV/bin/python" || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q "torch==$TORCH" "transformers==$TRANSFORMERS"
# what torch and transformers brought stays at their resolver's versions
HAVE=$("$VENV/bin/pip" freeze | sed 's/[=@ ].*//' | tr 'A-Z_' 'a-z-' | paste -sd'|')
echo "$PINS" | awk -F'==' -v have="^($HAVE)\$" '{n=tolower($1); gsub("_","-",n)} n !~ have' \
    > "$VENV/pins.txt"
"$VENV/bin/pip" install -q --no-deps -r "$VENV/pins.txt"
"$VENV/bin/python" -c "import torch, triton, transformers, numpy; print('torch', \
torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, \
'numpy', numpy.__version__)"
