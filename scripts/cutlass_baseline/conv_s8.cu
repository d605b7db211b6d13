// CUTLASS sm_90 int8 implicit-GEMM conv2d fprop baseline (issue #34).
//
// For each conv shape of a JSON file (see shapes_r50.json) this program:
//   1. builds the problem for every compiled tile configuration
//      (CUTLASS 3.x: conv CollectiveBuilder<Sm90, OpClassTensorOp, kFprop>,
//      s8 x s8 -> s32 accumulate, NHWC activations, KRSC filters, TMA
//      warp-specialized epilogue writing int8 = sat(rn(alpha * acc)));
//   2. reports can_implement / initialize failures per configuration;
//   3. runs each valid configuration on two random data sets (full-range
//      int8 with a power-of-two alpha; values in {-1, 0, 1} with alpha = 1,
//      where the int8 output is the int32 accumulator itself), each time on a
//      poisoned output, and compares every element with a naive direct-conv
//      CUDA kernel;
//   4. times each valid configuration with CUDA events (warm-up, then the
//      median over `reps` samples of `iters` back-to-back launches, replayed
//      from a CUDA graph so host launch overhead does not count);
//   5. prints one JSON document on stdout: per shape every configuration's
//      status, time and exactness, and the fastest exact configuration.
//
// Usage: conv_s8 SHAPES.json [--reps 7] [--iters 20] [--warmup 5] [--only NAME] [--list]
// --list prints the parsed shapes and the compiled configurations and exits
// without touching the GPU. Progress goes to stderr. Exit status: 0 all exact,
// 3 some configuration mismatched the reference, 1 bad input, 2 CUDA error.

#include <cuda_runtime.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/numeric_types.h"
#include "cutlass/version.h"
#include "cutlass/kernel_hardware_info.hpp"
#include "cutlass/conv/collective/collective_builder.hpp"
#include "cutlass/conv/convnd_problem_shape.hpp"
#include "cutlass/conv/device/conv_universal_adapter.hpp"
#include "cutlass/conv/kernel/conv_universal.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"

using namespace cute;

// The JSON document built so far (complete shapes only) and the shape being
// run: a CUDA error still prints a valid document, ending in "fatal_error".
static std::ostringstream* g_doc = nullptr;
static std::string g_current_shape;  // "shape [config]"

[[noreturn]] static void cuda_fatal(const char* expr, const char* file, int line,
                                    cudaError_t err) {
  std::string msg = std::string("CUDA error ") + expr + " at " + file + ":" +
                    std::to_string(line) + ": " + cudaGetErrorString(err);
  std::fprintf(stderr, "%s\n", msg.c_str());
  if (g_doc) {
    std::string clean;
    for (char c : msg) clean += (c == '"' || c == '\\') ? '\'' : c;
    std::fputs(g_doc->str().c_str(), stdout);
    std::printf("\n ],\n \"fatal_error\": \"%s\",\n \"fatal_at\": \"%s\"\n}\n",
                clean.c_str(), g_current_shape.c_str());
    std::fflush(stdout);
  }
  std::exit(2);
}

#define CUDA_CHECK(expr)                                        \
  do {                                                          \
    cudaError_t err_ = (expr);                                  \
    if (err_ != cudaSuccess) cuda_fatal(#expr, __FILE__, __LINE__, err_); \
  } while (0)

// ---------------------------------------------------------------------------
// Shapes
// ---------------------------------------------------------------------------

struct ConvShape {
  std::string name;
  std::string layers;  // raw JSON array of the layer names sharing the shape
  int N = 0, H = 0, W = 0, C = 0, K = 0, R = 0, S = 0;
  int stride = 1, pad = 0, dilation = 1;
  int P() const { return (H + 2 * pad - dilation * (R - 1) - 1) / stride + 1; }
  int Q() const { return (W + 2 * pad - dilation * (S - 1) - 1) / stride + 1; }
  double ops() const {
    return 2.0 * N * P() * Q() * double(K) * C * R * S;
  }
  size_t act_elems() const { return size_t(N) * H * W * C; }
  size_t flt_elems() const { return size_t(K) * R * S * C; }
  size_t out_elems() const { return size_t(N) * P() * Q() * K; }
};

// Minimal reader for the shapes file: a JSON document whose "shapes" array
// holds flat objects with integer fields (N H W C K R S stride pad dilation),
// a string "name" and an optional array "layers". Nested objects are not
// supported; anything unexpected is a fatal error naming the file.
class ShapeReader {
 public:
  ShapeReader(std::string path, std::string text)
      : path_(std::move(path)), s_(std::move(text)) {}

  std::vector<ConvShape> read() {
    size_t key = s_.find("\"shapes\"");
    if (key == std::string::npos) fail("no \"shapes\" array");
    i_ = s_.find('[', key);
    if (i_ == std::string::npos) fail("no '[' after \"shapes\"");
    ++i_;
    std::vector<ConvShape> out;
    while (true) {
      skip_ws();
      if (peek() == ']') break;
      if (peek() == ',') { ++i_; continue; }
      if (peek() != '{') fail("expected '{' in \"shapes\"");
      out.push_back(read_object());
    }
    if (out.empty()) fail("\"shapes\" is empty");
    return out;
  }

 private:
  [[noreturn]] void fail(const std::string& msg) const {
    std::fprintf(stderr, "error: %s: %s (at byte %zu)\n", path_.c_str(),
                 msg.c_str(), i_);
    std::exit(1);
  }
  char peek() {
    if (i_ >= s_.size()) fail("unexpected end of file");
    return s_[i_];
  }
  void skip_ws() {
    while (i_ < s_.size() && std::isspace(static_cast<unsigned char>(s_[i_]))) ++i_;
  }
  std::string read_string() {
    if (peek() != '"') fail("expected a string");
    size_t end = s_.find('"', i_ + 1);
    if (end == std::string::npos) fail("unterminated string");
    std::string v = s_.substr(i_ + 1, end - i_ - 1);
    i_ = end + 1;
    return v;
  }
  // An array of strings, kept as JSON text on one line (newlines and
  // indentation outside the strings dropped).
  std::string read_raw_array() {
    size_t end = s_.find(']', i_);
    if (end == std::string::npos) fail("unterminated array");
    std::string v;
    bool in_string = false;
    for (size_t j = i_; j <= end; ++j) {
      char c = s_[j];
      if (c == '"') in_string = !in_string;
      if (!in_string && std::isspace(static_cast<unsigned char>(c))) continue;
      v += c;
      if (!in_string && c == ',') v += ' ';
    }
    i_ = end + 1;
    return v;
  }
  long read_int() {
    char* endp = nullptr;
    long v = std::strtol(s_.c_str() + i_, &endp, 10);
    if (endp == s_.c_str() + i_) fail("expected an integer");
    i_ = size_t(endp - s_.c_str());
    return v;
  }
  ConvShape read_object() {
    ++i_;  // '{'
    std::map<std::string, long> ints;
    ConvShape sh;
    while (true) {
      skip_ws();
      if (peek() == '}') { ++i_; break; }
      if (peek() == ',') { ++i_; continue; }
      std::string key = read_string();
      skip_ws();
      if (peek() != ':') fail("expected ':' after \"" + key + "\"");
      ++i_;
      skip_ws();
      if (peek() == '"') {
        std::string v = read_string();
        if (key == "name") sh.name = v;
      } else if (peek() == '[') {
        std::string v = read_raw_array();
        if (key == "layers") sh.layers = v;
      } else if (peek() == '{') {
        fail("nested object under \"" + key + "\"");
      } else {
        ints[key] = read_int();
      }
    }
    auto need = [&](const char* k) -> int {
      auto it = ints.find(k);
      if (it == ints.end()) fail(std::string("shape '") + sh.name + "' lacks \"" + k + "\"");
      if (it->second <= 0 && std::strcmp(k, "pad") != 0)
        fail(std::string("shape '") + sh.name + "': \"" + k + "\" must be > 0");
      return int(it->second);
    };
    sh.N = need("N"); sh.H = need("H"); sh.W = need("W"); sh.C = need("C");
    sh.K = need("K"); sh.R = need("R"); sh.S = need("S");
    sh.stride = need("stride"); sh.pad = need("pad");
    sh.dilation = ints.count("dilation") ? int(ints["dilation"]) : 1;
    if (sh.pad < 0) fail("shape '" + sh.name + "': negative pad");
    if (sh.dilation != 1) fail("shape '" + sh.name + "': only dilation 1 is supported");
    if (sh.name.empty()) fail("a shape lacks \"name\"");
    if (sh.P() <= 0 || sh.Q() <= 0) fail("shape '" + sh.name + "': empty output");
    return sh;
  }

  std::string path_;
  std::string s_;
  size_t i_ = 0;
};

// ---------------------------------------------------------------------------
// Data, reference and comparison kernels
// ---------------------------------------------------------------------------

__host__ __device__ inline uint32_t hash_u32(uint64_t x) {
  x ^= x >> 33; x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return uint32_t(x);
}

// Uniform int8 over [lo, lo + span - 1] (span <= 256).
__global__ void fill_random_s8(int8_t* p, size_t n, uint64_t seed, int lo, int span) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    p[i] = int8_t(lo + int(hash_u32(i * 0x9E3779B97F4A7C15ULL + seed) % uint32_t(span)));
  }
}

// Same conversion as CUTLASS's NumericConverter<int8_t, float, round_to_nearest>
// (cvt.rni.sat.s8.f32) applied to alpha * float(acc).
__device__ inline int8_t requant_s8(int32_t acc, float alpha) {
  float v = alpha * float(acc);
  int32_t r;
  asm("cvt.rni.sat.s8.f32 %0, %1;" : "=r"(r) : "f"(v));
  return int8_t(r);
}

// Direct convolution: one thread per output element, NHWC x KRSC -> NPQK.
__global__ void reference_conv(const int8_t* act, const int8_t* flt, int8_t* out,
                               int N, int H, int W, int C, int K, int R, int S,
                               int P, int Q, int stride, int pad, float alpha) {
  size_t total = size_t(N) * P * Q * K;
  for (size_t idx = blockIdx.x * size_t(blockDim.x) + threadIdx.x; idx < total;
       idx += size_t(gridDim.x) * blockDim.x) {
    int k = int(idx % K);
    size_t t = idx / K;
    int q = int(t % Q); t /= Q;
    int p = int(t % P);
    int n = int(t / P);
    int32_t acc = 0;
    for (int r = 0; r < R; ++r) {
      int h = p * stride - pad + r;
      if (h < 0 || h >= H) continue;
      for (int s = 0; s < S; ++s) {
        int w = q * stride - pad + s;
        if (w < 0 || w >= W) continue;
        const int8_t* a = act + ((size_t(n) * H + h) * W + w) * C;
        const int8_t* b = flt + ((size_t(k) * R + r) * S + s) * C;
        for (int c = 0; c < C; ++c) acc += int32_t(a[c]) * int32_t(b[c]);
      }
    }
    out[idx] = requant_s8(acc, alpha);
  }
}

struct CompareCounts {
  unsigned long long mismatches;
  unsigned long long unsaturated;  // reference values strictly inside (-128, 127)
  int max_abs_diff;
};

__global__ void compare_s8(const int8_t* got, const int8_t* ref, size_t n,
                           CompareCounts* counts) {
  unsigned long long bad = 0, inside = 0;
  int maxd = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    int d = abs(int(got[i]) - int(ref[i]));
    bad += d != 0;
    maxd = max(maxd, d);
    inside += (ref[i] > -128 && ref[i] < 127);
  }
  atomicAdd(&counts->mismatches, bad);
  atomicAdd(&counts->unsaturated, inside);
  atomicMax(&counts->max_abs_diff, maxd);
}

static int grid_for(size_t n) {
  size_t blocks = (n + 255) / 256;
  return int(std::min<size_t>(blocks, 65536));
}

// ---------------------------------------------------------------------------
// CUTLASS kernel configurations
// ---------------------------------------------------------------------------

// One compiled CUTLASS conv: tile TM x TN x TK (int8 elements), cluster CM x CN.
// The sm_90 conv kernel layer supports only the non-persistent
// KernelImplicitTmaWarpSpecializedSm90 schedule (one producer and one consumer
// warp group), which the builder's KernelScheduleAuto selects.
template <int TM, int TN, int TK, int CM, int CN>
struct CutlassConv {
  using ElementAct = int8_t;
  using ElementFlt = int8_t;
  using ElementOut = int8_t;
  using ElementAcc = int32_t;
  using ElementCompute = float;
  using TileShape = Shape<Int<TM>, Int<TN>, Shape<Int<TK>>>;
  using ClusterShape = Shape<Int<CM>, Int<CN>, _1>;

  // D = saturate(round_to_nearest(alpha * acc)); no source tensor C.
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto,
      ElementAcc, ElementCompute,
      void, cutlass::layout::TensorNHWC, 16,
      ElementOut, cutlass::layout::TensorNHWC, 16,
      cutlass::epilogue::TmaWarpSpecialized>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::conv::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      cutlass::conv::Operator::kFprop,
      ElementAct, cutlass::layout::TensorNHWC, 16,
      ElementFlt, cutlass::layout::TensorNHWC, 16,
      ElementAcc,
      TileShape, ClusterShape,
      cutlass::conv::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      cutlass::conv::collective::KernelScheduleAuto>::CollectiveOp;

  using ProblemShape = cutlass::conv::ConvProblemShape<
      CollectiveMainloop::DispatchPolicy::ConvOp,
      CollectiveMainloop::DispatchPolicy::NumSpatialDimensions>;
  using Kernel = cutlass::conv::kernel::ConvUniversal<ProblemShape, CollectiveMainloop,
                                                      CollectiveEpilogue>;
  using Conv = cutlass::conv::device::ConvUniversalAdapter<Kernel>;
  static constexpr int kStages = CollectiveMainloop::DispatchPolicy::Stages;
};

// One correctness data set: inputs, the reference output and the scale.
struct CheckData {
  const char* name;
  int lo, span;  // input value range
  float alpha;
  int8_t* act = nullptr;
  int8_t* flt = nullptr;
  int8_t* ref = nullptr;
};

struct CheckResult {
  unsigned long long mismatches = 0;
  unsigned long long unsaturated = 0;
  int max_abs_diff = 0;
};

// checks[0]: full-range inputs, alpha = 2^-shift (products, signs, high bits;
// also the data the timing runs on). checks[1]: inputs in {-1, 0, 1} with
// alpha = 1, so every unsaturated output is the exact int32 accumulator.
struct Buffers {
  CheckData checks[2] = {{"full_range", -128, 256, 1.0f}, {"pm1_alpha1", -1, 3, 1.0f}};
  int8_t* out = nullptr;
  CompareCounts* counts = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

struct ConfigResult {
  std::string config;
  int stages = 0;
  std::string status;  // "ok", "can_implement_failed", "initialize_failed", "run_failed"
  double time_us = -1.0;
  std::vector<double> samples_us;
  std::string timing;  // "graph" (CUDA graph replay) or "stream" (host launches)
  bool exact = false;  // no mismatch in either check
  CheckResult checks[2];
};

struct RunOptions {
  int reps = 7;
  int iters = 20;
  int warmup = 5;
};

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static void ensure_workspace(Buffers& buf, size_t bytes) {
  if (bytes <= buf.workspace_bytes) return;
  if (buf.workspace) CUDA_CHECK(cudaFree(buf.workspace));
  CUDA_CHECK(cudaMalloc(&buf.workspace, bytes));
  buf.workspace_bytes = bytes;
}

// Steps: 1. problem + arguments; 2. can_implement; 3.-4. per check:
// initialize, poisoned run, compare with the reference (the full-range check
// last, so its arguments stay initialized); 5. warm-up and timing.
template <class Cfg>
ConfigResult run_config(const char* name, const ConvShape& sh, Buffers& buf,
                        const RunOptions& opt) {
  using Conv = typename Cfg::Conv;
  using ProblemShape = typename Cfg::ProblemShape;
  ConfigResult res;
  res.config = name;
  res.stages = Cfg::kStages;

  // 1. Problem and arguments (packed NHWC / KRSC / NPQK).
  ProblemShape problem(
      cutlass::conv::Mode::kCrossCorrelation,
      {sh.N, sh.H, sh.W, sh.C},
      {int64_t(sh.H) * sh.W * sh.C, int64_t(sh.W) * sh.C, int64_t(sh.C), 1},
      {sh.K, sh.R, sh.S, sh.C},
      {int64_t(sh.R) * sh.S * sh.C, int64_t(sh.S) * sh.C, int64_t(sh.C), 1},
      {sh.pad, sh.pad}, {sh.pad, sh.pad},
      {sh.stride, sh.stride}, {sh.dilation, sh.dilation}, 1);
  if (problem.shape_C[0] != sh.N || problem.shape_C[1] != sh.P() || problem.shape_C[2] != sh.Q() ||
      problem.shape_C[3] != sh.K) {
    std::fprintf(stderr, "error: %s: CUTLASS output shape %dx%dx%dx%d != NPQK %dx%dx%dx%d\n",
                 sh.name.c_str(), problem.shape_C[0], problem.shape_C[1],
                 problem.shape_C[2], problem.shape_C[3], sh.N, sh.P(), sh.Q(), sh.K);
    std::exit(1);
  }

  typename Conv::ConvKernel::StrideD stride_D{};
  cute::for_each(cute::make_seq<cute::rank<0>(decltype(stride_D){})>{}, [&](auto i) {
    cute::get<0, i>(stride_D) = problem.stride_C[ProblemShape::RankT - 2 - i];
  });
  typename Conv::ConvKernel::StrideC stride_C{};
  cute::for_each(cute::make_seq<cute::rank<0>(decltype(stride_C){})>{}, [&](auto i) {
    cute::get<0, i>(stride_C) = problem.stride_C[ProblemShape::RankT - 2 - i];
  });

  cutlass::KernelHardwareInfo hw_info;
  CUDA_CHECK(cudaGetDevice(&hw_info.device_id));
  hw_info.sm_count =
      cutlass::KernelHardwareInfo::query_device_multiprocessor_count(hw_info.device_id);

  auto make_args = [&](const CheckData& d) {
    typename Conv::Arguments args{
        problem,
        {d.act, d.flt},
        {{}, nullptr, stride_C, buf.out, stride_D},
        hw_info};
    args.epilogue.thread.alpha = d.alpha;
    args.epilogue.thread.beta = 0.0f;
    return args;
  };

  // 2. can_implement (shape-only; the same for both checks).
  Conv conv;
  if (conv.can_implement(make_args(buf.checks[0])) != cutlass::Status::kSuccess) {
    res.status = "can_implement_failed";
    return res;
  }
  for (int c : {1, 0}) {
    const CheckData& d = buf.checks[c];
    typename Conv::Arguments args = make_args(d);
    // 3. initialize (TMA descriptors, smem attribute).
    ensure_workspace(buf, Conv::get_workspace_size(args));
    if (conv.initialize(args, buf.workspace) != cutlass::Status::kSuccess) {
      (void)cudaGetLastError();
      res.status = "initialize_failed";
      return res;
    }
    // 4. Correctness: poison, run once, compare with the reference output.
    CUDA_CHECK(cudaMemset(buf.out, 0x55, sh.out_elems()));
    if (conv.run() != cutlass::Status::kSuccess) {
      (void)cudaGetLastError();
      res.status = "run_failed";
      return res;
    }
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemset(buf.counts, 0, sizeof(CompareCounts)));
    compare_s8<<<grid_for(sh.out_elems()), 256>>>(buf.out, d.ref, sh.out_elems(), buf.counts);
    CUDA_CHECK(cudaGetLastError());
    CompareCounts counts{};
    CUDA_CHECK(cudaMemcpy(&counts, buf.counts, sizeof(counts), cudaMemcpyDeviceToHost));
    res.checks[c].mismatches = counts.mismatches;
    res.checks[c].unsaturated = counts.unsaturated;
    res.checks[c].max_abs_diff = counts.max_abs_diff;
  }
  res.exact = res.checks[0].mismatches == 0 && res.checks[1].mismatches == 0;

  // 5. Timing on a private stream: warm-up, then `reps` samples of `iters`
  // back-to-back launches, replayed from a CUDA graph (no host launch gaps;
  // plain stream launches if capture fails), median of the per-launch times.
  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (int i = 0; i < opt.warmup; ++i) conv.run(stream);
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  bool use_graph = false;
  if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) == cudaSuccess) {
    bool launched = true;
    for (int i = 0; i < opt.iters; ++i) launched &= conv.run(stream) == cutlass::Status::kSuccess;
    bool captured = cudaStreamEndCapture(stream, &graph) == cudaSuccess;
    use_graph = launched && captured &&
                cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess;
  }
  (void)cudaGetLastError();
  res.timing = use_graph ? "graph" : "stream";
  if (use_graph) CUDA_CHECK(cudaGraphLaunch(exec, stream));  // graph warm-up
  CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaEvent_t t0, t1;
  CUDA_CHECK(cudaEventCreate(&t0));
  CUDA_CHECK(cudaEventCreate(&t1));
  for (int rep = 0; rep < opt.reps; ++rep) {
    CUDA_CHECK(cudaEventRecord(t0, stream));
    if (use_graph) {
      CUDA_CHECK(cudaGraphLaunch(exec, stream));
    } else {
      for (int i = 0; i < opt.iters; ++i) conv.run(stream);
    }
    CUDA_CHECK(cudaEventRecord(t1, stream));
    CUDA_CHECK(cudaEventSynchronize(t1));
    float ms = 0.f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, t0, t1));
    res.samples_us.push_back(1000.0 * ms / opt.iters);
  }
  CUDA_CHECK(cudaGetLastError());
  CUDA_CHECK(cudaEventDestroy(t0));
  CUDA_CHECK(cudaEventDestroy(t1));
  if (exec) CUDA_CHECK(cudaGraphExecDestroy(exec));
  if (graph) CUDA_CHECK(cudaGraphDestroy(graph));
  CUDA_CHECK(cudaStreamDestroy(stream));
  res.time_us = median(res.samples_us);
  res.status = "ok";
  return res;
}

using ConfigFn = ConfigResult (*)(const char*, const ConvShape&, Buffers&,
                                  const RunOptions&);
struct ConfigEntry {
  const char* name;
  ConfigFn fn;
};

// Tiles: M = N*P*Q (output pixels), N = K (output channels), K = slice of
// C*R*S per mainloop step (TK = 64 keeps layers with C = 64 from loading a
// half-empty 128-wide slice). With one consumer warp group per CTA the int32
// accumulator tile is at most 128x128 or 64x256 (128 registers per thread).
static const ConfigEntry kConfigs[] = {
    {"128x128x128_c1x1", &run_config<CutlassConv<128, 128, 128, 1, 1>>},
    {"128x128x128_c2x1", &run_config<CutlassConv<128, 128, 128, 2, 1>>},
    {"128x128x128_c1x2", &run_config<CutlassConv<128, 128, 128, 1, 2>>},
    {"128x64x128_c1x1", &run_config<CutlassConv<128, 64, 128, 1, 1>>},
    {"64x256x128_c1x1", &run_config<CutlassConv<64, 256, 128, 1, 1>>},
    {"64x128x128_c1x1", &run_config<CutlassConv<64, 128, 128, 1, 1>>},
    {"128x128x64_c1x1", &run_config<CutlassConv<128, 128, 64, 1, 1>>},
    {"128x128x64_c2x1", &run_config<CutlassConv<128, 128, 64, 2, 1>>},
    {"128x64x64_c1x1", &run_config<CutlassConv<128, 64, 64, 1, 1>>},
    {"64x256x64_c1x1", &run_config<CutlassConv<64, 256, 64, 1, 1>>},
    {"64x128x64_c1x1", &run_config<CutlassConv<64, 128, 64, 1, 1>>},
};

// ---------------------------------------------------------------------------
// Driver
// ---------------------------------------------------------------------------

// alpha = 2^-shift (full-range check) puts the reference output's standard
// deviation near 32, so most outputs are not saturated and the comparison sees
// the accumulator's upper bits and signs; the {-1, 0, 1} check with alpha = 1
// sees its low bits. Both sides compute alpha * float(acc) the same way.
static float pick_alpha(const ConvShape& sh) {
  double var_s8 = (256.0 * 256.0 - 1.0) / 12.0;  // uniform over 256 values
  double sd = std::sqrt(double(sh.C) * sh.R * sh.S) * var_s8;
  int shift = std::max(0, int(std::lround(std::log2(sd / 32.0))));
  return std::ldexp(1.0f, -shift);
}

static std::string json_escape(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    o += c;
  }
  return o;
}

static void print_config_json(std::ostringstream& js, const ConfigResult& r) {
  js << "{\"config\": \"" << r.config << "\", \"stages\": " << r.stages
     << ", \"status\": \"" << r.status << "\"";
  if (r.status == "ok") {
    js << ", \"time_us\": " << r.time_us << ", \"timing\": \"" << r.timing
       << "\", \"samples_us\": [";
    for (size_t i = 0; i < r.samples_us.size(); ++i)
      js << (i ? ", " : "") << r.samples_us[i];
    js << "], \"exact\": " << (r.exact ? "true" : "false") << ", \"checks\": {";
    for (int c = 0; c < 2; ++c)
      js << (c ? ", " : "") << "\"" << Buffers{}.checks[c].name
         << "\": {\"mismatches\": " << r.checks[c].mismatches
         << ", \"max_abs_diff\": " << r.checks[c].max_abs_diff
         << ", \"unsaturated\": " << r.checks[c].unsaturated << "}";
    js << "}";
  }
  js << "}";
}

static void run_shape(const ConvShape& sh, const RunOptions& opt, Buffers& buf,
                      std::ostringstream& js) {
  // Steps: 1. random inputs and 2. reference output per check;
  // 3. every configuration; 4. JSON.
  CUDA_CHECK(cudaMalloc(&buf.out, sh.out_elems()));
  uint64_t seed = hash_u32(std::hash<std::string>{}(sh.name));
  buf.checks[0].alpha = pick_alpha(sh);
  buf.checks[1].alpha = 1.0f;
  for (int c = 0; c < 2; ++c) {
    CheckData& d = buf.checks[c];
    CUDA_CHECK(cudaMalloc(&d.act, sh.act_elems()));
    CUDA_CHECK(cudaMalloc(&d.flt, sh.flt_elems()));
    CUDA_CHECK(cudaMalloc(&d.ref, sh.out_elems()));
    fill_random_s8<<<grid_for(sh.act_elems()), 256>>>(d.act, sh.act_elems(), seed + 11 * c,
                                                       d.lo, d.span);
    fill_random_s8<<<grid_for(sh.flt_elems()), 256>>>(d.flt, sh.flt_elems(), seed + 11 * c + 7,
                                                       d.lo, d.span);
    CUDA_CHECK(cudaMemset(d.ref, 0x55, sh.out_elems()));
    reference_conv<<<grid_for(sh.out_elems()), 256>>>(
        d.act, d.flt, d.ref, sh.N, sh.H, sh.W, sh.C, sh.K, sh.R, sh.S,
        sh.P(), sh.Q(), sh.stride, sh.pad, d.alpha);
    CUDA_CHECK(cudaGetLastError());
  }
  CUDA_CHECK(cudaDeviceSynchronize());

  std::vector<ConfigResult> results;
  for (const ConfigEntry& e : kConfigs) {
    g_current_shape = sh.name + " " + e.name;
    results.push_back(e.fn(e.name, sh, buf, opt));
    const ConfigResult& r = results.back();
    std::fprintf(stderr, "  %-18s %-22s", r.config.c_str(), r.status.c_str());
    if (r.status == "ok")
      std::fprintf(stderr, " %9.2f us  %s (mismatches %llu + %llu)", r.time_us,
                   r.exact ? "exact" : "MISMATCH", r.checks[0].mismatches,
                   r.checks[1].mismatches);
    std::fprintf(stderr, "\n");
  }

  const ConfigResult* best = nullptr;
  for (const ConfigResult& r : results)
    if (r.status == "ok" && r.exact && (!best || r.time_us < best->time_us)) best = &r;

  js << "  {\"name\": \"" << json_escape(sh.name) << "\", \"layers\": "
     << (sh.layers.empty() ? "[]" : sh.layers) << ", \"N\": " << sh.N
     << ", \"H\": " << sh.H << ", \"W\": " << sh.W << ", \"C\": " << sh.C
     << ", \"K\": " << sh.K << ", \"R\": " << sh.R << ", \"S\": " << sh.S
     << ", \"stride\": " << sh.stride << ", \"pad\": " << sh.pad
     << ", \"P\": " << sh.P() << ", \"Q\": " << sh.Q() << ", \"ops\": " << sh.ops()
     << ", \"alpha\": " << buf.checks[0].alpha << ",\n   \"configs\": [";
  for (size_t i = 0; i < results.size(); ++i) {
    js << (i ? ",\n     " : "\n     ");
    print_config_json(js, results[i]);
  }
  js << "],\n   \"best\": ";
  if (best) {
    js << "{\"config\": \"" << best->config << "\", \"time_us\": " << best->time_us
       << ", \"tops\": " << sh.ops() / (best->time_us * 1e-6) / 1e12
       << ", \"exact\": true}";
  } else {
    js << "null";
  }
  bool any_mismatch = false;
  for (const ConfigResult& r : results) any_mismatch |= (r.status == "ok" && !r.exact);
  js << ", \"any_mismatch\": " << (any_mismatch ? "true" : "false") << "}";

  for (CheckData& d : buf.checks) {
    CUDA_CHECK(cudaFree(d.act));
    CUDA_CHECK(cudaFree(d.flt));
    CUDA_CHECK(cudaFree(d.ref));
  }
  CUDA_CHECK(cudaFree(buf.out));
}

static void usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s SHAPES.json [--reps N] [--iters N] [--warmup N] [--only NAME] [--list]\n",
               argv0);
  std::exit(1);
}

int main(int argc, char** argv) {
  if (argc < 2) usage(argv[0]);
  std::string path = argv[1];
  RunOptions opt;
  std::string only;
  bool list_only = false;
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--list") { list_only = true; continue; }
    if (i + 1 >= argc) usage(argv[0]);
    if (a == "--reps") opt.reps = std::atoi(argv[++i]);
    else if (a == "--iters") opt.iters = std::atoi(argv[++i]);
    else if (a == "--warmup") opt.warmup = std::atoi(argv[++i]);
    else if (a == "--only") only = argv[++i];
    else usage(argv[0]);
  }
  if (opt.reps < 1 || opt.iters < 1 || opt.warmup < 0) usage(argv[0]);

  std::ifstream f(path);
  if (!f) {
    std::fprintf(stderr, "error: %s: cannot open\n", path.c_str());
    return 1;
  }
  std::stringstream ss;
  ss << f.rdbuf();
  std::vector<ConvShape> shapes = ShapeReader(path, ss.str()).read();
  if (list_only) {
    for (const ConvShape& sh : shapes)
      std::printf("%s N=%d H=%d W=%d C=%d K=%d R=%d S=%d stride=%d pad=%d P=%d Q=%d "
                  "GOPs=%.3f alpha=%g layers=%s\n",
                  sh.name.c_str(), sh.N, sh.H, sh.W, sh.C, sh.K, sh.R, sh.S, sh.stride,
                  sh.pad, sh.P(), sh.Q(), sh.ops() / 1e9, pick_alpha(sh),
                  sh.layers.empty() ? "[]" : sh.layers.c_str());
    std::printf("configs:");
    for (const ConfigEntry& e : kConfigs) std::printf(" %s", e.name);
    std::printf("\n");
    return 0;
  }

  cudaDeviceProp prop{};
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  if (prop.major != 9) {
    std::fprintf(stderr, "error: %s is sm_%d%d; this binary holds sm_90a kernels only\n",
                 prop.name, prop.major, prop.minor);
    return 1;
  }

  Buffers buf;
  CUDA_CHECK(cudaMalloc(&buf.counts, sizeof(CompareCounts)));
  std::ostringstream js;
  js.precision(6);
  js << "{\n \"format\": \"qcompile-cutlass-baseline/1\",\n \"device\": \""
     << json_escape(prop.name) << "\",\n \"cutlass\": \"" << CUTLASS_MAJOR << "."
     << CUTLASS_MINOR << "." << CUTLASS_PATCH << "\",\n \"shapes_file\": \""
     << json_escape(path) << "\",\n \"reps\": " << opt.reps << ", \"iters\": "
     << opt.iters << ", \"warmup\": " << opt.warmup
     << ",\n \"epilogue\": \"int8 = sat(rn(alpha * acc)), per-tensor alpha\",\n"
     << " \"configs\": [";
  for (size_t i = 0; i < sizeof(kConfigs) / sizeof(kConfigs[0]); ++i)
    js << (i ? ", " : "") << "\"" << kConfigs[i].name << "\"";
  js << "],\n \"results\": [\n";
  int done = 0, mismatched = 0;
  g_doc = &js;
  for (const ConvShape& sh : shapes) {
    if (!only.empty() && sh.name != only) continue;
    g_current_shape = sh.name;
    std::fprintf(stderr, "%s: N=%d H=%d W=%d C=%d K=%d R=%d S=%d stride=%d pad=%d\n",
                 sh.name.c_str(), sh.N, sh.H, sh.W, sh.C, sh.K, sh.R, sh.S, sh.stride,
                 sh.pad);
    std::ostringstream one;
    one.precision(6);
    run_shape(sh, opt, buf, one);
    mismatched += one.str().find("\"any_mismatch\": true") != std::string::npos;
    js << (done ? ",\n" : "") << one.str();
    ++done;
  }
  js << "\n ]\n}\n";
  if (done == 0) {
    std::fprintf(stderr, "error: %s: no shape named '%s'\n", path.c_str(), only.c_str());
    return 1;
  }
  std::fputs(js.str().c_str(), stdout);
  std::fprintf(stderr, "%d shapes, %d with a mismatching configuration\n", done, mismatched);
  return mismatched ? 3 : 0;
}
