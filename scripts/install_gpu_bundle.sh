#!/usr/bin/env bash
# Install an offline bundle made by scripts/build_gpu_bundle.py on a GPU host
# that has no network.
#
#   install_gpu_bundle.sh BUNDLE_DIR [PREFIX]
#
# 1. checks the bundle against its SHA256SUMS;
# 2. installs its wheels into the Python that runs the Triton stub (the host's
#    own environment, so models see them): $PYTHON -m pip install --no-index
#    --no-deps; PYTHON defaults to python3 and must be the bundle's version;
# 3. unpacks Triton into PREFIX (default /opt/whisper-triton), the folder that
#    WHISPER_TRITON_HOME names: bin/tritonserver, backends/python/, caches/, lib/,
#    and copies the bundle's model_repository/ there;
# 4. writes PREFIX/env.sh and prints what to set: WHISPER_TRITON_HOME,
#    LD_LIBRARY_PATH, and PATH starting with the interpreter's bin/ (the stub
#    takes its Python environment from the python3 it finds first on PATH),
#    then PREFIX/bin (so that `whisper-triton serve` finds tritonserver).
#
# Environment: PYTHON (interpreter), SKIP_WHEELS=1 (unpack Triton only).
set -euo pipefail

die() { echo "error: $*" >&2; exit 1; }

[[ $# -ge 1 && $# -le 2 ]] || die "usage: $0 BUNDLE_DIR [PREFIX]"
BUNDLE=$(cd "$1" && pwd) || die "no bundle folder $1"
PREFIX=${2:-/opt/whisper-triton}
PYTHON=${PYTHON:-python3}
SKIP_WHEELS=${SKIP_WHEELS:-0}

[[ -f $BUNDLE/BUNDLE.json && -d $BUNDLE/model_repository ]] || die "$BUNDLE is not a complete bundle folder"
command -v "$PYTHON" >/dev/null || die "no Python interpreter '$PYTHON' (set PYTHON=/path/to/python3)"

# One small Python call reads the manifest, so no JSON tool is needed.
read_manifest() { "$PYTHON" -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$BUNDLE/BUNDLE.json" "$1"; }
WANT_PY=$(read_manifest python_version)
ARCHIVE=$BUNDLE/$(read_manifest triton_archive)
HAVE_PY=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
# The stub embeds Python and takes its environment (sys.prefix, site-packages)
# from the first python3 on PATH, so this interpreter's own bin/ goes first.
PY_BINDIR=$("$PYTHON" -c 'import os, sys; print(os.path.dirname(sys.executable))')

echo "[1/4] checking $BUNDLE against SHA256SUMS"
if command -v sha256sum >/dev/null; then
    (cd "$BUNDLE" && sha256sum --quiet -c SHA256SUMS) || die "the bundle is damaged or incomplete"
else
    echo "      sha256sum not found; skipping the check"
fi

if [[ $SKIP_WHEELS == 1 ]]; then
    echo "[2/4] SKIP_WHEELS=1: not installing wheels"
else
    [[ $HAVE_PY == "$WANT_PY" ]] || die "the bundle is for Python $WANT_PY but $PYTHON is $HAVE_PY (set PYTHON)"
    wheels=("$BUNDLE"/wheels/*.whl)
    echo "[2/4] installing ${#wheels[@]} wheels into $("$PYTHON" -c 'import sys; print(sys.prefix)')"
    "$PYTHON" -m pip install --no-index --no-deps --force-reinstall --disable-pip-version-check "${wheels[@]}"
fi

echo "[3/4] unpacking $(basename "$ARCHIVE") into $PREFIX"
mkdir -p "$PREFIX"
PREFIX=$(cd "$PREFIX" && pwd)
tar -xJf "$ARCHIVE" -C "$PREFIX" --strip-components=1
for needed in bin/tritonserver backends/python/libtriton_python.so backends/python/triton_python_backend_stub lib; do
    [[ -e $PREFIX/$needed ]] || die "$PREFIX/$needed is missing after unpacking"
done
# The model repository is not in the wheel; a fresh copy replaces any old one.
rm -rf "$PREFIX/model_repository"
cp -R "$BUNDLE/model_repository" "$PREFIX/model_repository"

# The stub links libpython$WANT_PY.so.1.0 of the host; put its folder on the
# library path too where the loader would not find it (interpreters outside /usr
# keep it in their own lib/). A folder the loader searches anyway stays off it: a
# system folder there (/usr/lib/x86_64-linux-gnu) comes before the libraries torch's
# wheels carry, so a system cuDNN of another version shadows torch's own, cuDNN
# fails its version check, and attention quietly leaves cuDNN's kernels.
PY_LIBDIR=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR") or "")')
LIBRARY_PATH=$PREFIX/lib
if [[ -n $PY_LIBDIR && -e $PY_LIBDIR/libpython$WANT_PY.so.1.0 ]] \
        && ! { ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null; } | grep -q "libpython$WANT_PY.so.1.0 ("; then
    LIBRARY_PATH=$LIBRARY_PATH:$PY_LIBDIR
fi

echo "[4/4] checking that the server and the stub find their libraries"
export LD_LIBRARY_PATH=$LIBRARY_PATH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# tritonserver --help prints its usage and exits 1, so look at what it printed.
usage=$("$PREFIX/bin/tritonserver" --help 2>&1 || true)
[[ $usage == *"Usage: tritonserver"* ]] || die "$PREFIX/bin/tritonserver does not start:"$'\n'"${usage:0:2000}"
if command -v ldd >/dev/null; then
    missing=$(ldd "$PREFIX/backends/python/triton_python_backend_stub" | grep 'not found' || true)
    [[ -z $missing ]] || echo "warning: the Python $WANT_PY stub lacks libraries (install libpython$WANT_PY):"$'\n'"$missing" >&2
fi
[[ -x $PY_BINDIR/python3 ]] || echo "warning: $PY_BINDIR has no python3; the stub will take another Python from PATH" >&2
# torch with this library path must still load its own cuDNN (see above).
cudnn=$("$PYTHON" -c 'import torch; print(torch.backends.cudnn.version() if torch.cuda.is_available() else "no GPU")' 2>&1 | tail -1)
[[ $cudnn == "no GPU" || $cudnn =~ ^[0-9]+$ ]] || echo "warning: with LD_LIBRARY_PATH=$LD_LIBRARY_PATH torch's cuDNN fails: $cudnn" >&2

cat >"$PREFIX/env.sh" <<EOF
# Source this file to run the server from this bundle.
export WHISPER_TRITON_HOME=$PREFIX
export LD_LIBRARY_PATH=$LIBRARY_PATH\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
export PATH=$PY_BINDIR:$PREFIX/bin:\$PATH
EOF

echo
echo "tritonserver:         $PREFIX/bin/tritonserver"
echo "WHISPER_TRITON_HOME:  $PREFIX"
echo "LD_LIBRARY_PATH:      $LIBRARY_PATH"
echo "PATH starts with:     $PY_BINDIR (the stub's Python), $PREFIX/bin"
echo "model repository:     $PREFIX/model_repository"
echo "to use it:            source $PREFIX/env.sh"
echo "                      whisper-triton serve --model-repository $PREFIX/model_repository"
