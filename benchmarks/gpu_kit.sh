#!/usr/bin/env bash
# What the GPU machine lacks for the model-level checks of issue 32, packed here into
# .gpukit/ (git-ignored) so the device tool's `carry` can take it: the wheels of the
# packages its image does not hold (msgspec for the step messages, llguidance for
# structured output, gguf for the model file, fastapi, uvicorn, openai and jsonschema
# for the server and cost-report tests),
# and the default model's GGUF (98 MB) cut into two halves, because one call carries at
# most 64 MiB. benchmarks/gpu_check.sh puts the halves back together.
#   bash benchmarks/gpu_kit.sh        (here, with `make setup` done)
# Then, on one warm machine, three calls back to back in one batch of tool calls (a
# machine goes back 30 s after a call; what a call carried stays for the next). The
# 2026-12-04 session ran `crash`, then `suite` beside `ray` this way in 629 s of its
# 900 s of device time, start included. What is left for issue 32, in that budget:
#   1. run(carry=[".gpukit/a"], command="ls .gpukit/a")   (the model's first half)
#   2. run(carry=[".gpukit/b", ".gpukit/whl"], command="E2E_ARGS='--setups host-kv-1
#      host-kv-2' DEADLINE_S=330 bash benchmarks/gpu_check.sh e2e")   (acceptance 2's
#      host-KV rows, alone on the machine: the memory workers' threads are timed)
#   3. run(carry=[".gpukit/ray"], command=<the two below side by side, OUT=/tmp/... each,
#      then one tar of them into $OUT: at most 8 files come back>)
#      - WORKERS=8 SUITE_S=400 DEADLINE_S=425 bash benchmarks/gpu_check.sh suite
#        (acceptance 4; its first files hold acceptance 1; ~400 s on 2026-12-04, when the
#        four files of the kernel's refusal tests died of SIGSEGV, fixed since)
#      - DEADLINE_S=250 bash benchmarks/gpu_check.sh ray, then
#        LAMINA_WEIGHTS_ONLY=0 DEADLINE_S=170 bash benchmarks/gpu_check.sh ray
#        (the Ray executor with the compute worker on the GPU, from the weights alone, the
#        default, and loaded the full way: 101 s and 118 s beside the suite)
#   Should the kernel's refusal tests still crash there: `DEADLINE_S=190 bash
#   benchmarks/gpu_check.sh crash` (the probe under cuda-gdb, ~3 min with its rebuilds).
# Ray is not in the image: .gpukit/ray holds it trimmed (its wheel less the Java jars,
# the libraries Lamina does not use and the dashboard's web client), xz-packed, 27 MB.
# The image's torch (2.11) and transformers (5.17) are older than this repo's pins; the
# suite was run here against those two (benchmarks/RESULTS.md, 2026-11-27 afternoon).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$PWD/.venv/bin/python}
KIT=.gpukit
rm -rf "$KIT" && mkdir -p "$KIT/whl" "$KIT/a" "$KIT/b" "$KIT/ray"
# The wheels: what the package, the model file and the tests import beyond the image's
# own packages, with everything they need (from this venv's metadata, at this venv's
# versions), except the large packages the image holds (KINDS.md). They go first on the
# path there, so a carried one shadows the image's. The device's python is 3.12
# (KINDS.md; KIT_PY overrides it, to try the kit here); pure-python or manylinux only, up to
# the image's glibc 2.39 (pip matches each manylinux_2_N tag exactly: llguidance's is 2_31).
WHEELS=$("$PY" - <<'PYEOF'
import importlib.metadata as md
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as cn
ROOTS = ["msgspec", "gguf", "fastapi", "uvicorn", "openai", "jsonschema", "httpx", "anyio",
         "llguidance",
         "typing-extensions"]
IMAGE = {cn(n) for n in """torch numpy triton transformers tokenizers huggingface-hub
    safetensors pyyaml requests tqdm click idna certifi urllib3 charset-normalizer attrs h11
    packaging filelock fsspec sympy mpmath networkx jinja2 markupsafe setuptools regex pillow
    hf-xet zipp""".split()}
seen = {}
def walk(name):
    if cn(name) in seen or cn(name) in IMAGE:
        return
    dist = md.distribution(name)
    seen[cn(name)] = dist.version
    for r in map(Requirement, dist.requires or []):
        if not r.marker or r.marker.evaluate({"extra": "", "python_version": "3.12"}):
            walk(r.name)
for r in ROOTS:
    walk(r)
print(" ".join(f"{n}=={v}" for n, v in sorted(seen.items())))
PYEOF
)
# shellcheck disable=SC2086  # one word a wheel
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "${KIT_PY:-3.12}" \
    --implementation cp $(for n in 39 35 34 31 28 27 24 17; do echo --platform manylinux_2_${n}_x86_64; done) \
    --platform manylinux2014_x86_64 -d "$KIT/whl" $WHEELS
GGUF=$("$PY" -c 'from lamina.model.loader import default_model_path; print(default_model_path())')
size=$(stat -c %s "$GGUF")
half=$(( (size + 1) / 2 ))
head -c "$half" "$GGUF" > "$KIT/a/model.part"
tail -c +"$(( half + 1 ))" "$GGUF" > "$KIT/b/model.part"
# the whole file's name and checksum, checked after the halves are joined
echo "$(sha256sum "$GGUF" | cut -d' ' -f1) $(basename "$GGUF")" > "$KIT/b/model.sha256"
# Ray, at this venv's version, trimmed; its own requirements (click, filelock, msgpack,
# packaging, protobuf, pyyaml, requests) are in the image, jsonschema in whl/.
RAY=$("$PY" -c 'import ray; print(ray.__version__)')
TMP=$(mktemp -d)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "${KIT_PY:-3.12}" \
    --implementation cp --platform manylinux2014_x86_64 -d "$TMP" "ray==$RAY"
"$PY" - "$TMP" <<'PYEOF'
import glob, os, sys, zipfile
# unzipped with each file's mode (zipfile's own extraction drops the executable bits
# of gcs_server and raylet)
with zipfile.ZipFile(glob.glob(f"{sys.argv[1]}/ray-*.whl")[0]) as z:
    for info in z.infolist():
        path = z.extract(info, f"{sys.argv[1]}/x")
        if info.external_attr >> 16:
            os.chmod(path, (info.external_attr >> 16) & 0o777)
PYEOF
(cd "$TMP/x/ray" && rm -rf jars rllib data serve train tune llm dashboard/client/build air/examples)
tar -C "$TMP/x" -cJf "$KIT/ray/ray.tar.xz" ray "ray-$RAY.dist-info"
rm -rf "$TMP"
du -sh "$KIT"/*
