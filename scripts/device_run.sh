#!/usr/bin/env bash
# One device call: unpack the runtime bundle, install tvm-ffi, check + time everything.
# run(command="bash scripts/device_run.sh", carry=[".device", ".bundle"])
set -uo pipefail
RT=/tmp/tvmrt
mkdir -p "$RT"
tar xJf .bundle/tvm_runtime.tar.xz -C "$RT"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$RT" .bundle/apache_tvm_ffi-*cp312*.whl 2>&1 | tail -2
export PYTHONPATH="$RT" TVM_USE_RUNTIME_LIB=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
python3 scripts/device_run.py .device "$@" 2>&1 | tee "${OUT:-/tmp}/device_log.txt"
