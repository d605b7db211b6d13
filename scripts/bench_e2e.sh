#!/usr/bin/env bash
# One device call: runtime-only TVM from the bundle, qcompile's runtime module, then bench_e2e.py.
#   python scripts/build_e2e.py -o .e2e ... && scripts/make_runtime_bundle.sh 3.12
#   run(command="bash scripts/bench_e2e.sh .e2e [NET_BITS ...]", carry=[".e2e", ".bundle"])
set -uo pipefail
RT=/tmp/tvmrt
mkdir -p "$RT/py"
tar xJf .bundle/tvm_runtime.tar.xz -C "$RT"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$RT" .bundle/apache_tvm_ffi-*cp312*.whl 2>&1 | tail -2
ln -sfn "$PWD/compiler" "$RT/py/qcompile"   # the qcompile package (runtime part) without installing it
export PYTHONPATH="$RT:$RT/py" TVM_USE_RUNTIME_LIB=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
python3 scripts/bench_e2e.py "$@" 2>&1 | tee "${OUT:-/tmp}/bench_e2e_log.txt"
# The C++ deployment example on the GPU: scripts/run_so.cc against the runtime bundle (weights inside the .so).
if [ -f "$1/cpp_demo/tiny.so" ]; then
  g++ -std=c++17 -O2 scripts/run_so.cc -o /tmp/run_so -I"$RT/tvm_ffi/include" -L"$RT/tvm/lib" -L"$RT/tvm_ffi/lib" \
      -ltvm_runtime -Wl,--no-as-needed -ltvm_runtime_cuda -Wl,--as-needed -ltvm_ffi \
      -Wl,-rpath,"$RT/tvm/lib" -Wl,-rpath,"$RT/tvm_ffi/lib" \
    && /tmp/run_so "$1/cpp_demo/tiny.so" "$1/cpp_demo/x.bin" 1 3 32 32 cuda
  python3 -c "import numpy as np, sys; from qcompile.runtime import Module; m = Module(sys.argv[1]); print('python qrun top-1:', int(m(np.load(sys.argv[2])).argmax()))" "$1/cpp_demo/tiny.so" "$1/cpp_demo/x.npy"
fi
