// Runs bottleneck.cu's five kernels on the host (emu.h) for run.py --dry-run:
//   emu_main DIR N ZO1 ZO2 ZO3 ZO_OUT C1 R1 C2 R2 SR GRID_FUSED GRID_F7 GRID_K1 GRID_K2 GRID_K3
// reads DIR/{x,w1,w2,w3,params}.bin, writes DIR/{fused_out,fused_7x8_out,y1,y2,unfused_out}.bin (outputs poisoned
// 0x5A first, shared memory 0xCD before every CTA).
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#define FUSION_EMU
#include "../bottleneck.cu"

thread_local EmuDim threadIdx;
EmuDim blockIdx, gridDim;
EmuCta* emu_cta;

static std::vector<char> read_file(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) {
    std::perror(path.c_str());
    std::exit(2);
  }
  std::fseek(f, 0, SEEK_END);
  std::vector<char> v(std::ftell(f));
  std::fseek(f, 0, SEEK_SET);
  if (std::fread(v.data(), 1, v.size(), f) != v.size()) std::exit(2);
  std::fclose(f);
  return v;
}

static void write_file(const std::string& path, const std::vector<char>& v) {
  FILE* f = std::fopen(path.c_str(), "wb");
  std::fwrite(v.data(), 1, v.size(), f);
  std::fclose(f);
}

// every CTA of the grid in turn, NTHREADS host threads each
template <class F>
static void run_grid(int grid, int smem_bytes, F kernel) {
  std::vector<unsigned char> smem(smem_bytes);
  gridDim.x = grid;
  for (int b = 0; b < grid; ++b) {
    std::fill(smem.begin(), smem.end(), 0xCD);
    std::barrier<> cta_bar(NTHREADS);
    EmuCta cta;
    cta.smem = smem.data();
    cta.bar = &cta_bar;
    for (int w = 0; w < NTHREADS / 32; ++w) cta.warp[w].bar = new std::barrier<>(32);
    emu_cta = &cta;
    blockIdx.x = b;
    std::vector<std::thread> th;
    for (int t = 0; t < NTHREADS; ++t)
      th.emplace_back([t, &kernel] {
        threadIdx.x = t;
        kernel();
      });
    for (auto& t : th) t.join();
    for (int w = 0; w < NTHREADS / 32; ++w) delete cta.warp[w].bar;
  }
}

int main(int argc, char** argv) {
  if (argc != 17) {
    std::fprintf(stderr,
                 "usage: emu_main DIR N ZO1 ZO2 ZO3 ZO_OUT C1 R1 C2 R2 SR GRID_FUSED GRID_F7 GRID_K1 GRID_K2 GRID_K3\n");
    return 2;
  }
  const std::string dir = argv[1];
  const int n = std::atoi(argv[2]), zo1 = std::atoi(argv[3]), zo2 = std::atoi(argv[4]), zo3 = std::atoi(argv[5]),
            zo_out = std::atoi(argv[6]);
  const int c1 = std::atoi(argv[7]), r1 = std::atoi(argv[8]), c2 = std::atoi(argv[9]), r2 = std::atoi(argv[10]),
            sr = std::atoi(argv[11]);
  const int gf = std::atoi(argv[12]), g7 = std::atoi(argv[13]), g1 = std::atoi(argv[14]), g2 = std::atoi(argv[15]),
            g3 = std::atoi(argv[16]);
  auto x = read_file(dir + "/x.bin"), w1 = read_file(dir + "/w1.bin"), w2 = read_file(dir + "/w2.bin"),
       w3 = read_file(dir + "/w3.bin"), params = read_file(dir + "/params.bin");
  const size_t px = (size_t)n * IMG * IMG;
  std::vector<char> out_f(px * C_IN, 0x5A), out_f7(px * C_IN, 0x5A), out_u(px * C_IN, 0x5A), y1(px * C_MID, 0x5A),
      y2(px * C_MID, 0x5A);
  const i8 *X = (const i8*)x.data(), *W1 = (const i8*)w1.data(), *W2 = (const i8*)w2.data(),
           *W3 = (const i8*)w3.data();
  const int* P = (const int*)params.data();
  run_grid(gf, SMEM_FUSED, [&] {
    fused_bottleneck(X, W1, W2, W3, P, (i8*)out_f.data(), n, zo1, zo2, zo3, zo_out, c1, r1, c2, r2, sr);
  });
  run_grid(g7, SMEM_F7, [&] {
    fused_bottleneck_7x8(X, W1, W2, W3, P, (i8*)out_f7.data(), n, zo1, zo2, zo3, zo_out, c1, r1, c2, r2, sr);
  });
  run_grid(g1, SMEM_K1, [&] { k1_conv1x1(X, W1, P, (i8*)y1.data(), n, zo1); });
  run_grid(g2, SMEM_K2, [&] { k2_conv3x3((const i8*)y1.data(), W2, P, (i8*)y2.data(), n, zo1, zo2); });
  run_grid(g3, SMEM_K3, [&] {
    k3_conv1x1_res((const i8*)y2.data(), X, W3, P, (i8*)out_u.data(), n, zo3, zo_out, c1, r1, c2, r2, sr);
  });
  write_file(dir + "/fused_out.bin", out_f);
  write_file(dir + "/fused_7x8_out.bin", out_f7);
  write_file(dir + "/y1.bin", y1);
  write_file(dir + "/y2.bin", y2);
  write_file(dir + "/unfused_out.bin", out_u);
  return 0;
}
