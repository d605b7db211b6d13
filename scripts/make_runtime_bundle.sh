#!/usr/bin/env bash
# Build a TVM *runtime-only* bundle for a GPU host that has no TVM (see shared/gpu-workflow.md):
#   .bundle/tvm_runtime.tar.xz  -- the installed tvm package minus libtvm_compiler.so, 3rdparty/, src/,
#                                  include/, web/ (~3 MB compressed)
#   .bundle/apache_tvm_ffi-<ver>-cp<py>-*.whl -- the pinned tvm-ffi wheel for the GPU host's Python
# Usage: scripts/make_runtime_bundle.sh [python_version=3.12] [out_dir=.bundle]
# On the GPU host:  tar xJf .bundle/tvm_runtime.tar.xz -C /tmp/rt && pip install --no-deps --target /tmp/rt .bundle/*.whl
#                   PYTHONPATH=/tmp/rt TVM_USE_RUNTIME_LIB=1 python3 ...
set -euo pipefail
PYVER="${1:-3.12}"
OUT="${2:-.bundle}"
FFI_VER="0.1.14.post0"
mkdir -p "$OUT"
TVM_DIR="$(python3 -c 'import os, importlib.util as u; print(os.path.dirname(u.find_spec("tvm").origin))')"
STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
cp -a "$TVM_DIR" "$STAGE/tvm"
rm -rf "$STAGE/tvm/lib/libtvm_compiler.so" "$STAGE/tvm/3rdparty" "$STAGE/tvm/src" "$STAGE/tvm/include" "$STAGE/tvm/web"
find "$STAGE/tvm" -name __pycache__ -prune -exec rm -rf {} +
tar -C "$STAGE" -cJf "$OUT/tvm_runtime.tar.xz" tvm
PYTAG="${PYVER/./}"
if ! ls "$OUT"/apache_tvm_ffi-"$FFI_VER"-cp"$PYTAG"-*.whl >/dev/null 2>&1; then
  python3 -m pip download --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$OUT" "apache-tvm-ffi==$FFI_VER"
fi
ls -la "$OUT"
