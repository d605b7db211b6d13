#!/usr/bin/env bash
# Pack the TVM *runtime* for a GPU host that has no TVM (the compiler stays on the build machine):
#   OUT_DIR/tvm_runtime.tar.xz  -- the installed tvm package minus libtvm_compiler.so, 3rdparty/, src/, include/,
#                                  web/ (~3 MB compressed)
#   OUT_DIR/apache_tvm_ffi-<ver>-cp<py>-*.whl -- the pinned tvm-ffi wheel for the GPU host's Python
# Usage: scripts/make_runtime_bundle.sh [OUT_DIR] [PYTHON_VERSION]
#   OUT_DIR defaults to build/runtime_bundle, PYTHON_VERSION (the GPU host's, e.g. 3.12) to 3.12; an argument of the
#   form N.N is taken as the Python version, so either may come first.
# On the GPU host (scripts/device_env.py does this for the GPU-host scripts where TVM does not import):
#   tar xJf OUT_DIR/tvm_runtime.tar.xz -C /tmp/rt && pip install --no-deps --target /tmp/rt OUT_DIR/*.whl
#   PYTHONPATH=/tmp/rt TVM_USE_RUNTIME_LIB=1 python3 ...
set -euo pipefail
PYVER="3.12"
DEST="build/runtime_bundle"
for arg in "$@"; do
  if [[ $arg =~ ^[0-9]+\.[0-9]+$ ]]; then PYVER=$arg; else DEST=$arg; fi
done
FFI_VER="0.1.14.post0"
mkdir -p "$DEST"
TVM_DIR="$(python3 -c 'import os, importlib.util as u; print(os.path.dirname(u.find_spec("tvm").origin))')"
STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
cp -a "$TVM_DIR" "$STAGE/tvm"
rm -rf "$STAGE/tvm/lib/libtvm_compiler.so" "$STAGE/tvm/3rdparty" "$STAGE/tvm/src" "$STAGE/tvm/include" "$STAGE/tvm/web"
find "$STAGE/tvm" -name __pycache__ -prune -exec rm -rf {} +
tar -C "$STAGE" -cJf "$DEST/tvm_runtime.tar.xz" tvm
PYTAG="${PYVER/./}"
if ! ls "$DEST"/apache_tvm_ffi-"$FFI_VER"-cp"$PYTAG"-*.whl >/dev/null 2>&1; then
  python3 -m pip download --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$DEST" "apache-tvm-ffi==$FFI_VER"
fi
ls -la "$DEST"
