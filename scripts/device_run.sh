#!/usr/bin/env bash
# On a GPU host with the TVM runtime, numpy and torch: check and time the kernels of a scripts/device_build.py build.
#   bash scripts/device_run.sh [DIR] [--out OUT_DIR] [--no-bench]     (DIR: build/gpu/checks; OUT_DIR: DIR)
# Where TVM does not import, the runtime bundle of scripts/make_runtime_bundle.sh (build/runtime_bundle;
# $QC_RUNTIME_BUNDLE overrides) is unpacked to /tmp/tvmrt with its tvm-ffi wheel for this host's Python.
# Prints the GPU's clocks, then device_run.py's log, also written to OUT_DIR/device_log.txt.
set -uo pipefail
DIR=build/gpu/checks
if [[ $# -gt 0 && $1 != -* ]]; then DIR=$1; shift; fi
RESULTS_DIR=$DIR
ARGS=("$@")
for ((i = 0; i < ${#ARGS[@]}; i++)); do
  case ${ARGS[i]} in
    --out) RESULTS_DIR=${ARGS[i + 1]:-$RESULTS_DIR} ;;
    --out=*) RESULTS_DIR=${ARGS[i]#--out=} ;;
  esac
done
mkdir -p "$RESULTS_DIR"
if ! python3 -c "import tvm" >/dev/null 2>&1; then
  BUNDLE=${QC_RUNTIME_BUNDLE:-build/runtime_bundle}
  RT=/tmp/tvmrt
  PYTAG=$(python3 -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  mkdir -p "$RT"
  tar xJf "$BUNDLE/tvm_runtime.tar.xz" -C "$RT"
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$RT" \
      "$BUNDLE"/apache_tvm_ffi-*-"$PYTAG"-*.whl 2>&1 | tail -2
  export PYTHONPATH="$RT${PYTHONPATH:+:$PYTHONPATH}"
fi
export TVM_USE_RUNTIME_LIB=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
python3 scripts/device_run.py "$DIR" "$@" 2>&1 | tee "$RESULTS_DIR/device_log.txt"
