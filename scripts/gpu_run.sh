#!/usr/bin/env bash
# One call on a GPU machine without network: install the carried wheels, run
# the GPU tests and the benchmark, keep everything under $OUT.
#
#   scripts/gpu_run.sh [PHASE ...]      phases: tests bench triton slow (default: all four)
#
# Carried (ignored by git, named in the device call's `carry`):
#   .gpu-bundle/ or .bundle/ the offline bundle (scripts/build_gpu_bundle.py): wheels/ and the Triton
#                            tarball; .gpu-bundle is the same without this project's wheel (the
#                            checkout is used instead), which keeps the call under 64 MiB
#                            (BUNDLE=dir picks another, e.g. one without the HTTP client wheels)
#   .whl/*.whl               or just the wheels a phase needs (flashinfer-python, apache-tvm-ffi, ...)
#   .flashinfer/aot.tgz      FlashInfer modules compiled by an earlier call (skips the JIT)
#
# Writes to $OUT (at most 8 files come back): log, gpu.json, gpu.md, gpu.png,
# profile.txt, triton-serve-tiny.log, flashinfer-aot.tgz. Every phase has a
# share of DEADLINE_S so the call ends inside the device's 600 s limit.
set -uo pipefail

OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log") 2>&1
START=$(date +%s)
DEADLINE_S=${DEADLINE_S:-575}
PHASES=${*:-tests bench triton slow}
PY=python3
export PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=$PWD/.flashinfer/workspace
export PYTHONPATH=$PWD  # this checkout, also in the Triton stub, over any installed copy
BUNDLE=${BUNDLE:-$(ls -d .gpu-bundle .bundle 2>/dev/null | head -1)}
left() { echo $((DEADLINE_S - ($(date +%s) - START))); }
say() { echo "[gpu_run $(($(date +%s) - START)) s] $*"; }
has() { [[ " $PHASES " == *" $1 "* ]]; }

say "phases: $PHASES; $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)"
$PY -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'

# 1. Wheels, numpy 1.26 excepted: the tests and the offline benchmark use the
#    image's numpy; the Triton stub needs 1.26, installed before the `triton` phase.
WHEELS=$(ls ${BUNDLE:+$BUNDLE/wheels/*.whl} .whl/*.whl 2>/dev/null | grep -v -e '/numpy-' -e '/whisper_triton-' || true)
if [[ -n $WHEELS ]]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check $WHEELS || exit 1
fi
SITE=$($PY -c 'import flashinfer, os; print(os.path.dirname(flashinfer.__file__))') || exit 1
if [[ -f .flashinfer/aot.tgz ]]; then  # prebuilt modules: FlashInfer loads data/aot/<name>/<name>.so as is
    mkdir -p "$SITE/data/aot" && tar -xzf .flashinfer/aot.tgz -C "$SITE/data/aot" && say "prebuilt: $(ls "$SITE/data/aot" | tr '\n' ' ')"
fi

save_jit() {  # the modules compiled so far, for the next call to carry
    local ops
    ops=$(ls -d "$FLASHINFER_WORKSPACE_BASE"/.cache/flashinfer/*/*/cached_ops 2>/dev/null | head -1)
    [[ -n $ops ]] || return 0
    (cd "$ops" && tar -czf "$OUT/flashinfer-aot.tgz" */*.so 2>/dev/null)
    local size=$(stat -c %s "$OUT/flashinfer-aot.tgz" 2>/dev/null || echo 0)
    say "compiled modules: $(ls "$ops" | tr '\n' ' ') -> flashinfer-aot.tgz $((size / 1048576)) MiB"
    if ((size > 16 * 1048576)); then rm -f "$OUT/flashinfer-aot.tgz"; say "too large to bring back"; fi
}

# 2. Correctness.
if has tests; then
    say "tests (budget $(($(left) - 330)) s)"
    timeout $(($(left) - 330)) $PY -m pytest -q -s -p no:cacheprovider -m "gpu and not slow" tests/test_gpu.py
    say "tests exit $?"
    save_jit
fi

# 3. Offline benchmark: transformers against the engine, step times, memory.
if has bench; then
    reserve=10; has triton && reserve=150
    budget=$(($(left) - reserve))
    say "bench (budget $budget s)"
    timeout "$budget" $PY -m bench.gpu --models ${BENCH_MODELS:-tiny large-v3} --sections steps offline encoder \
        --out "$OUT" --profile-dir "$OUT"
    say "bench exit $?"
    save_jit
fi

# 4. Through Triton: needs the bundle's numpy 1.26 and server.
if has triton; then
    if [[ -n $BUNDLE ]]; then  # what install_gpu_bundle.sh does, for a bundle without its own wheel
        $PY -m pip install -q --no-index --no-deps --force-reinstall --disable-pip-version-check $BUNDLE/wheels/numpy-*.whl
        mkdir -p /opt/whisper-triton && tar -xJf $BUNDLE/tritonserver-*.tar.xz -C /opt/whisper-triton --strip-components=1
        export WHISPER_TRITON_HOME=/opt/whisper-triton PATH=/opt/whisper-triton/bin:$PATH
        PY_LIBDIR=$($PY -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR") or "")')
        export LD_LIBRARY_PATH=/opt/whisper-triton/lib:$PY_LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
        ldd /opt/whisper-triton/backends/python/triton_python_backend_stub | grep "not found"
        $PY -c 'import numpy; print("numpy", numpy.__version__)'
        say "triton (budget $(($(left) - 20)) s)"
        timeout $(($(left) - 20)) $PY -m bench.gpu --sections triton --append --out "$OUT" --profile-dir "$OUT" \
            --triton-startup-s 240 --triton-preprocessing-instances ${PREPROCESSING_INSTANCES:-8} ${TRITON_ARGS:-}
        say "triton exit $?"
    else
        say "no bundle: skipping triton"
    fi
fi

# 5. FlashInfer's fa3 prefill kernels (about 80 s of JIT): the prompt path
#    through them, and the encoder's attention through them against SDPA.
if has slow && (($(left) > 140)); then
    say "slow (budget $(($(left) - 10)) s)"
    timeout $(($(left) - 10)) bash -c "$PY -m pytest -q -s -p no:cacheprovider -m 'gpu and slow' tests/test_gpu.py && \
        $PY -m bench.gpu --models ${BENCH_MODELS:-tiny large-v3} --sections encoder --append --out $OUT"
    say "slow exit $?"
    save_jit
fi
say "done"
