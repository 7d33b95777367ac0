#!/usr/bin/env bash
# What the GPU machine lacks for the model-level checks of issue 32, packed here into
# .gpukit/ (git-ignored) so the device tool's `carry` can take it: the wheels of the
# packages its image does not hold (msgspec for the step messages, gguf for the model
# file), and the default model's GGUF (98 MB) cut into two halves, because one call
# carries at most 64 MiB. benchmarks/gpu_check.sh puts the halves back together.
#   bash benchmarks/gpu_kit.sh        (here, with `make setup` done)
# Then two calls, back to back: a machine goes back 30 s after a call, and the first
# half must still be there for the second (put both calls in one batch of tool calls).
# The second call's steps take ~5 min on an H100; 15 min of device time is a session's
# all, so keep the first call short (the kernel tests, ~2-3 min):
#   run(carry=[".gpukit/whl", ".gpukit/a"], command="bash benchmarks/gpu_check.sh kernels")
#   run(carry=[".gpukit/whl", ".gpukit/b"], command="bash benchmarks/gpu_check.sh e2e exact")
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
KIT=.gpukit
rm -rf "$KIT" && mkdir -p "$KIT/whl" "$KIT/a" "$KIT/b"
# the device image's python is 3.12 (KINDS.md; KIT_PY overrides it, to try the kit here);
# pure-python or manylinux wheels only
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "${KIT_PY:-3.12}" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$KIT/whl" \
    "msgspec==$("$PY" -c 'import msgspec; print(msgspec.__version__)')" \
    "gguf==$("$PY" -c 'import importlib.metadata as m; print(m.version("gguf"))')"
GGUF=$("$PY" -c 'from lamina.model.loader import default_model_path; print(default_model_path())')
size=$(stat -c %s "$GGUF")
half=$(( (size + 1) / 2 ))
head -c "$half" "$GGUF" > "$KIT/a/model.part"
tail -c +"$(( half + 1 ))" "$GGUF" > "$KIT/b/model.part"
# the whole file's name and checksum, checked after the halves are joined
echo "$(sha256sum "$GGUF" | cut -d' ' -f1) $(basename "$GGUF")" | tee "$KIT/a/model.sha256" \
    > "$KIT/b/model.sha256"
du -sh "$KIT"/*
