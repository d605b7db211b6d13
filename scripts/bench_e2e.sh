#!/usr/bin/env bash
# The end-to-end benchmark on a GPU host that has no TVM: the runtime-only TVM from the bundle that
# scripts/make_runtime_bundle.sh packs ($QC_RUNTIME_BUNDLE, default build/runtime_bundle), qcompile's runtime module
# from this checkout, then `bench_e2e.py run`. Needs python3 with numpy and torch (+ torchvision) on the GPU host.
#   build host:  python scripts/build_e2e.py ...   and   scripts/make_runtime_bundle.sh
#   GPU host:    bash scripts/bench_e2e.sh [DIR] [NET_BITS ...] [--out OUT]     (DIR default: build/gpu/e2e)
set -uo pipefail
BUNDLE="${QC_RUNTIME_BUNDLE:-build/runtime_bundle}"
DIR=build/gpu/e2e
OUTDIR=
args=("$@")
for i in "${!args[@]}"; do
  [ "${args[$i]}" = "--out" ] && OUTDIR="${args[$((i + 1))]}"
done
[ $# -gt 0 ] && [ "${1#-}" = "$1" ] && DIR="$1"
OUTDIR="${OUTDIR:-$DIR}"
mkdir -p "$OUTDIR"
RT=/tmp/tvmrt
mkdir -p "$RT/py"
tar xJf "$BUNDLE/tvm_runtime.tar.xz" -C "$RT"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$RT" "$BUNDLE"/apache_tvm_ffi-*-"$(python3 -c 'import sys; print("cp%d%d" % sys.version_info[:2])')"-*.whl 2>&1 | tail -2
ln -sfn "$PWD/compiler" "$RT/py/qcompile"   # the qcompile package (runtime part) without installing it
export PYTHONPATH="$RT:$RT/py" TVM_USE_RUNTIME_LIB=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
python3 scripts/bench_e2e.py run "$@" 2>&1 | tee "$OUTDIR/bench_e2e_log.txt"
