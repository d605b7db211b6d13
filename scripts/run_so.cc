// Minimal C++ deployment of a qcompile .so with the TVM runtime alone (no compiler, no Python).
//
//   run_so MODEL.so INPUT.bin N C H W [cpu|cuda]
//
// INPUT.bin holds N*C*H*W float32 values (NCHW, native byte order, no header), e.g. written with
// x.astype('float32').tofile('x.bin'). Prints the logits' shape and the top-1 class of every image.
// Build command: see README.md ("Deploying without the compiler"). Modules built with --weights-beside need their
// weights passed as extra arguments to main; this example covers the default (weights inside the .so).
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

using tvm::ffi::Function;
using tvm::ffi::Module;
using tvm::ffi::Tensor;

// The runtime's own tensor functions, looked up by name (what Python's tvm.runtime.tensor uses).
static Function Global(const char* name) { return Function::GetGlobal(name).value(); }

int main(int argc, char** argv) {
  if (argc < 7) {
    std::fprintf(stderr, "usage: %s MODEL.so INPUT.bin N C H W [cpu|cuda]\n", argv[0]);
    return 2;
  }
  const std::string device = argc > 7 ? argv[7] : "cpu";
  const int64_t n = std::atoll(argv[3]), c = std::atoll(argv[4]), h = std::atoll(argv[5]), w = std::atoll(argv[6]);
  DLDevice dev{device == "cuda" ? kDLCUDA : kDLCPU, 0};

  // 1. load the library and create its Relax VM on the device (pooled allocator; the host CPU too)
  Module lib = Module::LoadFromFile(argv[1]);
  Module vm = lib->GetFunction("vm_load_executable").value()().cast<Module>();
  const int kPooled = 2;
  if (dev.device_type == kDLCPU) {
    vm->GetFunction("vm_initialization").value()(static_cast<int>(kDLCPU), 0, kPooled);
  } else {
    vm->GetFunction("vm_initialization").value()(static_cast<int>(dev.device_type), 0, kPooled,
                                                  static_cast<int>(kDLCPU), 0, kPooled);
  }

  // 2. read the input and copy it to the device
  std::vector<float> host(n * c * h * w);
  std::ifstream in(argv[2], std::ios::binary);
  if (!in.read(reinterpret_cast<char*>(host.data()), host.size() * sizeof(float))) {
    std::fprintf(stderr, "cannot read %zu floats from %s\n", host.size(), argv[2]);
    return 2;
  }
  Tensor x = Global("runtime.TVMTensorAllocWithScope")(tvm::ffi::Shape({n, c, h, w}), DLDataType{kDLFloat, 32, 1},
                                                       dev, tvm::ffi::Optional<tvm::ffi::String>()).cast<Tensor>();
  Global("runtime.TVMTensorCopyFromBytes")(x, static_cast<void*>(host.data()), host.size() * sizeof(float));

  // 3. run main and read the float logits back
  Tensor y = vm->GetFunction("main").value()(x).cast<Tensor>();
  int64_t rows = y.size(0), cols = y.size(1);
  std::vector<float> out(rows * cols);
  Global("runtime.TVMTensorCopyToBytes")(y, static_cast<void*>(out.data()), out.size() * sizeof(float));
  std::printf("output %lld x %lld; top-1:", static_cast<long long>(rows), static_cast<long long>(cols));
  for (int64_t i = 0; i < rows; ++i) {
    int64_t best = 0;
    for (int64_t j = 1; j < cols; ++j)
      if (out[i * cols + j] > out[i * cols + best]) best = j;
    std::printf(" %lld", static_cast<long long>(best));
  }
  std::printf("\n");
  return 0;
}
