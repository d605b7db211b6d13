// One ResNet-50 layer1 bottleneck block (non-downsample), INT8 NHWC, on tensor cores (mma.sync.m16n8k32.s8):
//   x [N,56,56,256] -> 1x1 256->64 (+ReLU) -> 3x3 64->64 pad 1 (+ReLU) -> 1x1 64->256 + residual x (+ReLU) -> out.
// Two ways to run it, sharing the same warp-level GEMM and epilogue code:
//   fused_bottleneck                      one kernel: x read once (a halo tile), out written once;
//   k1_conv1x1 -> k2_conv3x3 -> k3_conv1x1_res   three kernels: the 64-channel intermediates go through global memory.
// Every kernel is persistent (a grid of at most #SM x blocks-per-SM CTAs of 256 threads, each looping over tiles),
// keeps its weights and requantize parameters in shared memory for all its tiles, and double-buffers its input tiles
// with cp.async (16-byte copies) so the next tile's load overlaps this tile's math. Outputs go back through shared
// memory and leave with 16-byte stores.
//
// Integer math (qcompile's, compiler/tune/measure.py: requant): t = acc + bias (int32, wrapping);
// v = (t * M + (1 << (S - 1))) >> S (int64); y = clip(v + zo, lo, 127). Residual stage: out = clip(((y + c1) * R1 +
// (r + c2) * R2 + (1 << (SR - 1))) >> SR) + zo_out, zo_out, 127) (int64).
//
// Parameters: one int32 array of P_WORDS words (offsets P_*), the weights w1 [64][256], w2 [64][3][3][64] (K, R, S,
// C), w3 [256][64] int8. Compiles with NVRTC (CuPy RawModule) and nvcc: no headers.

typedef signed char i8;
typedef unsigned int u32;

#define IMG 56            // H = W
#define C_IN 256          // block input / output channels
#define C_MID 64          // bottleneck channels
#define TH 14             // spatial tile: TH x TW output pixels of one image
#define TW 8
#define HALO_W (TW + 2)   // 10
#define HALO_PX ((TH + 2) * HALO_W)  // 160 = 10 m16 tiles
#define TILE_PX (TH * TW)            // 112 = 7 m16 tiles
#define TILES_PER_IMG ((IMG / TH) * (IMG / TW))  // 28
#define FLAT_PX 128       // rows of a 1x1 kernel's (unfused) pixel tile
#define LDX 272           // shared row stride of a 256-channel row (256 + 16: conflict-free ldmatrix)
#define LDY 80            // of a 64-channel row
#define LDW2 592          // of a w2 row (576 + 16)
#define NTHREADS 256

#define P_B1 0
#define P_M1 64
#define P_S1 128
#define P_B2 192
#define P_M2 256
#define P_S2 320
#define P_B3 384
#define P_M3 640
#define P_S3 896
#define P_C1 1152
#define P_R1 1408
#define P_C2 1664
#define P_R2 1920
#define P_SR 2176
#define P_WORDS 2432

// shared memory of each kernel (bytes)
#define SMEM_W (C_MID * LDX + C_MID * LDW2 + C_IN * LDY)  // the three weight tiles
#define SMEM_FUSED (SMEM_W + P_WORDS * 4 + 2 * HALO_PX * LDX + (HALO_PX + TILE_PX) * LDY)
#define SMEM_K1 (C_MID * LDX + P_WORDS * 4 + 2 * FLAT_PX * LDX + FLAT_PX * LDY)
#define SMEM_K2 (C_MID * LDW2 + P_WORDS * 4 + 2 * HALO_PX * LDY + TILE_PX * LDY)
#define SMEM_K3 (C_IN * LDY + P_WORDS * 4 + 2 * FLAT_PX * LDY + 2 * FLAT_PX * LDX)

// ---------------------------------------------------------------------------------------------------------------
// PTX wrappers (emu/emu.h replaces them with a host emulation of the same semantics: FUSION_EMU)
// ---------------------------------------------------------------------------------------------------------------
#ifdef FUSION_EMU
#include "emu/emu.h"
#else
#define DYNAMIC_SMEM(name) extern __shared__ __align__(128) unsigned char name[]

__device__ __forceinline__ u32 smem_u32(const void* p) {
  u32 r;
  asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}

// 16 bytes global -> shared, asynchronous; src_bytes 0 fills zeros (the source address is then not read)
__device__ __forceinline__ void cp16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(dst)), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_wait_prev() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }

// four 8x8 b16 matrices (= four blocks of 8 rows x 16 bytes); lane l gives the row address of row l%8 of matrix l/8
__device__ __forceinline__ void ldsm4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));  // (ordered after shared stores by the __syncthreads between stages)
}

// c[16x8] += a[16x32] * b[32x8], int8 in, int32 accumulate
__device__ __forceinline__ void mma_s8(int (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif  // FUSION_EMU

// ---------------------------------------------------------------------------------------------------------------
// requantize (exact int64; the NumPy reference's math)
// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ int clip8(long long v, int lo) { return (int)(v < lo ? lo : (v > 127 ? 127 : v)); }

// one output channel's stage-1 parameters (bias, M, S at word offsets pb, pm, psh of the parameter array)
struct Rq {
  int b, m, s;
};
__device__ __forceinline__ Rq rq_load(const int* ps, int pb, int pm, int psh, int col) {
  return Rq{ps[pb + col], ps[pm + col], ps[psh + col]};
}
__device__ __forceinline__ int rq1(int acc, Rq q, int zo, int lo) {
  const int t = (int)((u32)acc + (u32)q.b);  // acc + bias, wrapping in int32
  const long long v = ((long long)t * (long long)q.m + (1LL << (q.s - 1))) >> q.s;
  return clip8(v + zo, lo);
}

// conv3's output channel: stage 1 (no ReLU) then the residual stage
struct Rq3 {
  Rq q;
  int c1, r1, c2, r2, sr;
};
__device__ __forceinline__ Rq3 rq3_load(const int* ps, int col) {
  return Rq3{rq_load(ps, P_B3, P_M3, P_S3, col), ps[P_C1 + col], ps[P_R1 + col], ps[P_C2 + col], ps[P_R2 + col],
             ps[P_SR + col]};
}
__device__ __forceinline__ int rq3(int acc, int r, const Rq3& p, int zo3, int zo_out) {
  const int y = rq1(acc, p.q, zo3, -128);
  const long long u = (long long)(y + p.c1) * (long long)p.r1 + (long long)(r + p.c2) * (long long)p.r2 +
                      (1LL << (p.sr - 1));
  return clip8((u >> p.sr) + zo_out, zo_out);
}

__device__ __forceinline__ void st2(i8* p, int a, int b) {
  *(unsigned short*)p = (unsigned short)((a & 0xff) | ((b & 0xff) << 8));
}

// ---------------------------------------------------------------------------------------------------------------
// the warp GEMM: acc[MT][2 NP] (16x8 tiles) += A (MT m16 tiles) x B (NP pairs of n8 tiles), KS steps of k = 32.
// a_addr[mt]: this lane's ldmatrix address at k = 0 for m-tile mt: row 16 mt + (j & 1) 8 + (lane & 7), byte (j >> 1) 16
//   (j = lane >> 3: matrices a0..a3 = rows 0-7 / 8-15 x k 0-15 / 16-31); a_koff(ks) adds step ks's byte offset.
// b_addr: this lane's address of pair 0 at k = 0 in B stored [n][k]: row (j >> 1) 8 + (lane & 7), byte (j & 1) 16
//   (matrices b0, b1 of n-tile 0, then of n-tile 1); pair p is b_pair bytes further, step ks 32 ks bytes.
// ---------------------------------------------------------------------------------------------------------------
template <int MT, int NP, int KS, class AK>
__device__ __forceinline__ void warp_gemm(int (&acc)[MT][2 * NP][4], const u32 (&a_addr)[MT], u32 b_addr, u32 b_pair,
                                          AK a_koff) {
#pragma unroll
  for (int ks = 0; ks < KS; ++ks) {
    u32 a[MT][4], b[NP][4];
    const u32 ao = a_koff(ks);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) ldsm4(a[mt], a_addr[mt] + ao);
#pragma unroll
    for (int p = 0; p < NP; ++p) ldsm4(b[p], b_addr + p * b_pair + ks * 32);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int p = 0; p < NP; ++p) {
        mma_s8(acc[mt][2 * p], a[mt], b[p][0], b[p][1]);
        mma_s8(acc[mt][2 * p + 1], a[mt], b[p][2], b[p][3]);
      }
  }
}

template <int MT, int N8>
__device__ __forceinline__ void zero_acc(int (&acc)[MT][N8][4]) {
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int n = 0; n < N8; ++n)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[m][n][i] = 0;
}

struct K1x1 {
  __device__ __forceinline__ u32 operator()(int ks) const { return (u32)(ks * 32); }
};
struct K3x3 {  // k = ((r * 3 + s) * 64 + c): tap (r, s) moves the A row by r halo rows and s pixels
  __device__ __forceinline__ u32 operator()(int ks) const {
    const int tap = ks >> 1;
    return (u32)(((tap / 3) * HALO_W + tap % 3) * LDY + (ks & 1) * 32);
  }
};

// ---------------------------------------------------------------------------------------------------------------
// the stages (a CTA of 8 warps; all shared memory)
// ---------------------------------------------------------------------------------------------------------------
// fused conv1: halo [160][LDX] -> y1 [160][LDY]; 8 jobs of 5 m16 tiles x 16 channels; halo pixels outside the image
// get conv2's pad value zo1 (not conv1 of the zero-filled input)
__device__ __forceinline__ void stage1_halo(const i8* halo, i8* y1, const i8* w1s, const int* ps, int zo1, int h0,
                                            int w0) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, j = lane >> 3, g = lane >> 2, t = lane & 3;
  const int mh = warp & 1, nq = warp >> 1;
  u32 a_addr[5];
#pragma unroll
  for (int mt = 0; mt < 5; ++mt)
    a_addr[mt] = smem_u32(halo + ((mh * 5 + mt) * 16 + (j & 1) * 8 + (lane & 7)) * LDX + (j >> 1) * 16);
  const u32 b_addr = smem_u32(w1s + (nq * 16 + (j >> 1) * 8 + (lane & 7)) * LDX + (j & 1) * 16);
  int acc[5][2][4];
  zero_acc(acc);
  warp_gemm<5, 1, C_IN / 32>(acc, a_addr, b_addr, 0u, K1x1());
  Rq q[2][2];  // this lane's 4 output channels
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) q[nt][e] = rq_load(ps, P_B1, P_M1, P_S1, nq * 16 + nt * 8 + 2 * t + e);
#pragma unroll
  for (int mt = 0; mt < 5; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = (mh * 5 + mt) * 16 + g + 8 * h;
      const int ih = h0 - 1 + row / HALO_W, iw = w0 - 1 + row % HALO_W;
      const bool inside = ih >= 0 && ih < IMG && iw >= 0 && iw < IMG;
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int col = nq * 16 + nt * 8 + 2 * t;
        const int q0 = inside ? rq1(acc[mt][nt][2 * h], q[nt][0], zo1, zo1) : zo1;
        const int q1 = inside ? rq1(acc[mt][nt][2 * h + 1], q[nt][1], zo1, zo1) : zo1;
        st2(y1 + row * LDY + col, q0, q1);
      }
    }
}

// unfused conv1: a [128][LDX] -> y [128][LDY]; 8 jobs of 2 m16 tiles x 32 channels
__device__ __forceinline__ void stage1_flat(const i8* a, i8* y, const i8* w1s, const int* ps, int zo1) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, j = lane >> 3, g = lane >> 2, t = lane & 3;
  const int mq = warp & 3, nh = warp >> 2;
  u32 a_addr[2];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
    a_addr[mt] = smem_u32(a + ((mq * 2 + mt) * 16 + (j & 1) * 8 + (lane & 7)) * LDX + (j >> 1) * 16);
  const u32 b_addr = smem_u32(w1s + (nh * 32 + (j >> 1) * 8 + (lane & 7)) * LDX + (j & 1) * 16);
  int acc[2][4][4];
  zero_acc(acc);
  warp_gemm<2, 2, C_IN / 32>(acc, a_addr, b_addr, 16u * LDX, K1x1());
  Rq q[4][2];  // this lane's 8 output channels
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) q[nt][e] = rq_load(ps, P_B1, P_M1, P_S1, nh * 32 + nt * 8 + 2 * t + e);
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = (mq * 2 + mt) * 16 + g + 8 * h;
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int col = nh * 32 + nt * 8 + 2 * t;
        st2(y + row * LDY + col, rq1(acc[mt][nt][2 * h], q[nt][0], zo1, zo1),
            rq1(acc[mt][nt][2 * h + 1], q[nt][1], zo1, zo1));
      }
    }
}

// conv2 (fused and unfused): yin [160][LDY] (the 16 x 10 halo, pads already zo1) -> yout [112][LDY];
// warps 0..6, each one m16 tile (two output rows of 8 pixels) x all 64 channels
__device__ __forceinline__ void stage2(const i8* yin, i8* yout, const i8* w2s, const int* ps, int zo2) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, j = lane >> 3, g = lane >> 2, t = lane & 3;
  if (warp >= TILE_PX / 16) return;
  u32 a_addr[1];
  a_addr[0] = smem_u32(yin + ((2 * warp + (j & 1)) * HALO_W + (lane & 7)) * LDY + (j >> 1) * 16);
  const u32 b_addr = smem_u32(w2s + ((j >> 1) * 8 + (lane & 7)) * LDW2 + (j & 1) * 16);
  int acc[1][8][4];
  zero_acc(acc);
  warp_gemm<1, 4, 9 * C_MID / 32>(acc, a_addr, b_addr, 16u * LDW2, K3x3());
  Rq q[8][2];  // this lane's 16 output channels
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) q[nt][e] = rq_load(ps, P_B2, P_M2, P_S2, nt * 8 + 2 * t + e);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int p = warp * 16 + g + 8 * h;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int col = nt * 8 + 2 * t;
      st2(yout + p * LDY + col, rq1(acc[0][nt][2 * h], q[nt][0], zo2, zo2),
          rq1(acc[0][nt][2 * h + 1], q[nt][1], zo2, zo2));
    }
  }
}

// conv3 + residual (fused and unfused): yin [NMT * 16][LDY] -> in place over the residual rows (res_row(p): the
// shared address of pixel p's 256 input channels); warp w owns output channels 32 w .. 32 w + 31
struct ResFlat {
  i8* base;
  __device__ __forceinline__ i8* operator()(int p) const { return base + p * LDX; }
};
struct ResHaloCentre {
  i8* base;
  __device__ __forceinline__ i8* operator()(int p) const { return base + ((p / TW + 1) * HALO_W + p % TW + 1) * LDX; }
};

template <int NMT, class RR>
__device__ __forceinline__ void stage3(const i8* yin, RR res_row, const i8* w3s, const int* ps, int zo3, int zo_out) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, j = lane >> 3, g = lane >> 2, t = lane & 3;
  const u32 b_addr = smem_u32(w3s + (warp * 32 + (j >> 1) * 8 + (lane & 7)) * LDY + (j & 1) * 16);
  Rq3 q[4][2];  // this lane's 8 output channels, for all its m tiles
#pragma unroll
  for (int nt = 0; nt < 4; ++nt)
#pragma unroll
    for (int e = 0; e < 2; ++e) q[nt][e] = rq3_load(ps, warp * 32 + nt * 8 + 2 * t + e);
#pragma unroll 1
  for (int m = 0; m < NMT; ++m) {
    u32 a_addr[1];
    a_addr[0] = smem_u32(yin + (m * 16 + (j & 1) * 8 + (lane & 7)) * LDY + (j >> 1) * 16);
    int acc[1][4][4];
    zero_acc(acc);
    warp_gemm<1, 2, C_MID / 32>(acc, a_addr, b_addr, 16u * LDY, K1x1());
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      i8* rp = res_row(m * 16 + g + 8 * h);
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int col = warp * 32 + nt * 8 + 2 * t;
        const int o0 = rq3(acc[0][nt][2 * h], rp[col], q[nt][0], zo3, zo_out);
        const int o1 = rq3(acc[0][nt][2 * h + 1], rp[col + 1], q[nt][1], zo3, zo_out);
        st2(rp + col, o0, o1);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// tile movement (256 threads; 16-byte chunks, consecutive threads on consecutive chunks)
// ---------------------------------------------------------------------------------------------------------------
struct Tile {
  int n, h0, w0;
};
__device__ __forceinline__ Tile spatial_tile(int tile) {
  const int r = tile % TILES_PER_IMG;
  return Tile{tile / TILES_PER_IMG, (r / (IMG / TW)) * TH, (r % (IMG / TW)) * TW};
}

// rows x row_bytes from global (row stride row_bytes) to shared (row stride ld), plain loads (weights, parameters)
__device__ __forceinline__ void copy_rows(i8* dst, int ld, const i8* src, int rows, int row_bytes) {
  const int per_row = row_bytes / 16;
  for (int q = threadIdx.x; q < rows * per_row; q += NTHREADS) {
    const int r = q / per_row, c = q % per_row;
    *(uint4*)(dst + r * ld + c * 16) = *(const uint4*)(src + (long long)r * row_bytes + c * 16);
  }
}

// the (TH + 2) x (TW + 2) halo of a CH-channel NHWC tensor; outside the image: zero-filled (pad_word < 0) or the
// bytes of pad_word
template <int CH>
__device__ __forceinline__ void load_halo(i8* dst, int ld, const i8* src, Tile tl, long long pad_word) {
  constexpr int PER = CH / 16;
  for (int q = threadIdx.x; q < HALO_PX * PER; q += NTHREADS) {
    const int idx = q / PER, c = q % PER;
    const int ih = tl.h0 - 1 + idx / HALO_W, iw = tl.w0 - 1 + idx % HALO_W;
    const bool ok = ih >= 0 && ih < IMG && iw >= 0 && iw < IMG;
    i8* d = dst + idx * ld + c * 16;
    if (ok || pad_word < 0) {
      const i8* s = ok ? src + ((((long long)tl.n * IMG + ih) * IMG + iw) * CH + c * 16) : src;
      cp16(d, s, ok);
    } else {
      const u32 w = (u32)pad_word;
      *(uint4*)d = make_uint4(w, w, w, w);
    }
  }
}

// the TH x TW centre pixels of a CH-channel tile in shared memory (pixel p at row(p)) -> global NHWC
template <int CH, class Row>
__device__ __forceinline__ void store_spatial(i8* dst, Row row, Tile tl) {
  constexpr int PER = CH / 16;
  for (int q = threadIdx.x; q < TILE_PX * PER; q += NTHREADS) {
    const int p = q / PER, c = q % PER;
    const long long o = (((long long)tl.n * IMG + tl.h0 + p / TW) * IMG + tl.w0 + p % TW) * CH + c * 16;
    *(uint4*)(dst + o) = *(const uint4*)(row(p) + c * 16);
  }
}

// FLAT_PX consecutive pixels (from pixel px0 of total) of a CH-channel tensor <-> shared rows of stride ld
template <int CH>
__device__ __forceinline__ void load_flat(i8* dst, int ld, const i8* src, long long px0, long long total) {
  constexpr int PER = CH / 16;
  for (int q = threadIdx.x; q < FLAT_PX * PER; q += NTHREADS) {
    const int r = q / PER, c = q % PER;
    const bool ok = px0 + r < total;
    cp16(dst + r * ld + c * 16, ok ? src + (px0 + r) * CH + c * 16 : src, ok);
  }
}
template <int CH>
__device__ __forceinline__ void store_flat(i8* dst, const i8* src, int ld, long long px0, long long total) {
  constexpr int PER = CH / 16;
  for (int q = threadIdx.x; q < FLAT_PX * PER; q += NTHREADS) {
    const int r = q / PER, c = q % PER;
    if (px0 + r < total) *(uint4*)(dst + (px0 + r) * CH + c * 16) = *(const uint4*)(src + r * ld + c * 16);
  }
}

struct RowY {  // pixel p of a [TILE_PX][LDY] tile
  const i8* base;
  __device__ __forceinline__ const i8* operator()(int p) const { return base + p * LDY; }
};
struct RowHaloCentre {
  const i8* base;
  __device__ __forceinline__ const i8* operator()(int p) const {
    return base + ((p / TW + 1) * HALO_W + p % TW + 1) * LDX;
  }
};

__device__ __forceinline__ void load_params(int* ps, const int* params) {
  copy_rows((i8*)ps, 0, (const i8*)params, 1, P_WORDS * 4);
}

// ---------------------------------------------------------------------------------------------------------------
// the kernels
// ---------------------------------------------------------------------------------------------------------------
extern "C" __global__ void smem_sizes(int* out) {
  out[0] = SMEM_FUSED;
  out[1] = SMEM_K1;
  out[2] = SMEM_K2;
  out[3] = SMEM_K3;
}

// the fused block: per tile of TH x TW pixels, the 16 x 10 x 256 halo of x in; out written in place over the halo's
// centre (out[p][k] needs x[p][k] only), then stored
extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
    fused_bottleneck(const i8* __restrict__ x, const i8* __restrict__ w1, const i8* __restrict__ w2,
                     const i8* __restrict__ w3, const int* __restrict__ params, i8* __restrict__ out, int N, int zo1,
                     int zo2, int zo3, int zo_out) {
  DYNAMIC_SMEM(smem);
  i8* w1s = (i8*)smem;
  i8* w2s = w1s + C_MID * LDX;
  i8* w3s = w2s + C_MID * LDW2;
  int* ps = (int*)(w3s + C_IN * LDY);
  i8* halo0 = (i8*)(ps + P_WORDS);  // two halo buffers, HALO_PX * LDX bytes apart
  i8* y1 = halo0 + 2 * HALO_PX * LDX;
  i8* y2 = y1 + HALO_PX * LDY;
  const int ntiles = N * TILES_PER_IMG;
  if ((int)blockIdx.x >= ntiles) return;
  copy_rows(w1s, LDX, w1, C_MID, C_IN);
  copy_rows(w2s, LDW2, w2, C_MID, 9 * C_MID);
  copy_rows(w3s, LDY, w3, C_IN, C_MID);
  load_params(ps, params);
  load_halo<C_IN>(halo0, LDX, x, spatial_tile(blockIdx.x), -1);
  cp_commit();
  int it = 0;
  for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x, ++it) {
    i8* cur = halo0 + (it & 1) * (HALO_PX * LDX);
    const int next = tile + gridDim.x;
    if (next < ntiles) load_halo<C_IN>(halo0 + ((it + 1) & 1) * (HALO_PX * LDX), LDX, x, spatial_tile(next), -1);
    cp_commit();
    cp_wait_prev();
    __syncthreads();
    const Tile tl = spatial_tile(tile);
    stage1_halo(cur, y1, w1s, ps, zo1, tl.h0, tl.w0);
    __syncthreads();
    stage2(y1, y2, w2s, ps, zo2);
    __syncthreads();
    stage3<TILE_PX / 16>(y2, ResHaloCentre{cur}, w3s, ps, zo3, zo_out);
    __syncthreads();
    store_spatial<C_IN>(out, RowHaloCentre{cur}, tl);
    __syncthreads();
  }
}

// unfused 1: y1 = conv1x1(x) over tiles of FLAT_PX pixels
extern "C" __global__ void __launch_bounds__(NTHREADS, 2)
    k1_conv1x1(const i8* __restrict__ x, const i8* __restrict__ w1, const int* __restrict__ params,
               i8* __restrict__ y1g, int N, int zo1) {
  DYNAMIC_SMEM(smem);
  i8* w1s = (i8*)smem;
  int* ps = (int*)(w1s + C_MID * LDX);
  i8* a0 = (i8*)(ps + P_WORDS);  // two input buffers, FLAT_PX * LDX bytes apart
  i8* o = a0 + 2 * FLAT_PX * LDX;
  const long long total = (long long)N * IMG * IMG;
  const int ntiles = (int)((total + FLAT_PX - 1) / FLAT_PX);
  if ((int)blockIdx.x >= ntiles) return;
  copy_rows(w1s, LDX, w1, C_MID, C_IN);
  load_params(ps, params);
  load_flat<C_IN>(a0, LDX, x, (long long)blockIdx.x * FLAT_PX, total);
  cp_commit();
  int it = 0;
  for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x, ++it) {
    const int next = tile + gridDim.x;
    if (next < ntiles) load_flat<C_IN>(a0 + ((it + 1) & 1) * (FLAT_PX * LDX), LDX, x, (long long)next * FLAT_PX, total);
    cp_commit();
    cp_wait_prev();
    __syncthreads();
    stage1_flat(a0 + (it & 1) * (FLAT_PX * LDX), o, w1s, ps, zo1);
    __syncthreads();
    store_flat<C_MID>(y1g, o, LDY, (long long)tile * FLAT_PX, total);
    __syncthreads();
  }
}

// unfused 2: y2 = conv3x3(y1) over spatial tiles (the halo's outside pixels filled with zo1)
extern "C" __global__ void __launch_bounds__(NTHREADS, 2)
    k2_conv3x3(const i8* __restrict__ y1g, const i8* __restrict__ w2, const int* __restrict__ params,
               i8* __restrict__ y2g, int N, int zo1, int zo2) {
  DYNAMIC_SMEM(smem);
  i8* w2s = (i8*)smem;
  int* ps = (int*)(w2s + C_MID * LDW2);
  i8* h0buf = (i8*)(ps + P_WORDS);  // two halo buffers, HALO_PX * LDY bytes apart
  i8* o = h0buf + 2 * HALO_PX * LDY;
  const int ntiles = N * TILES_PER_IMG;
  if ((int)blockIdx.x >= ntiles) return;
  const long long pad_word = (long long)((u32)(zo1 & 0xff) * 0x01010101u);
  copy_rows(w2s, LDW2, w2, C_MID, 9 * C_MID);
  load_params(ps, params);
  load_halo<C_MID>(h0buf, LDY, y1g, spatial_tile(blockIdx.x), pad_word);
  cp_commit();
  int it = 0;
  for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x, ++it) {
    const int next = tile + gridDim.x;
    if (next < ntiles)
      load_halo<C_MID>(h0buf + ((it + 1) & 1) * (HALO_PX * LDY), LDY, y1g, spatial_tile(next), pad_word);
    cp_commit();
    cp_wait_prev();
    __syncthreads();
    stage2(h0buf + (it & 1) * (HALO_PX * LDY), o, w2s, ps, zo2);
    __syncthreads();
    store_spatial<C_MID>(y2g, RowY{o}, spatial_tile(tile));
    __syncthreads();
  }
}

// unfused 3: out = conv1x1(y2) + residual x over tiles of FLAT_PX pixels (out in place over the residual tile)
extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
    k3_conv1x1_res(const i8* __restrict__ y2g, const i8* __restrict__ x, const i8* __restrict__ w3,
                   const int* __restrict__ params, i8* __restrict__ out, int N, int zo3, int zo_out) {
  DYNAMIC_SMEM(smem);
  i8* w3s = (i8*)smem;
  int* ps = (int*)(w3s + C_IN * LDY);
  i8* a0 = (i8*)(ps + P_WORDS);           // two conv inputs, FLAT_PX * LDY bytes apart
  i8* r0 = a0 + 2 * FLAT_PX * LDY;        // two residual / output tiles, FLAT_PX * LDX bytes apart
  const long long total = (long long)N * IMG * IMG;
  const int ntiles = (int)((total + FLAT_PX - 1) / FLAT_PX);
  if ((int)blockIdx.x >= ntiles) return;
  copy_rows(w3s, LDY, w3, C_IN, C_MID);
  load_params(ps, params);
  load_flat<C_MID>(a0, LDY, y2g, (long long)blockIdx.x * FLAT_PX, total);
  load_flat<C_IN>(r0, LDX, x, (long long)blockIdx.x * FLAT_PX, total);
  cp_commit();
  int it = 0;
  for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x, ++it) {
    const int next = tile + gridDim.x, nb = (it + 1) & 1;
    if (next < ntiles) {
      load_flat<C_MID>(a0 + nb * (FLAT_PX * LDY), LDY, y2g, (long long)next * FLAT_PX, total);
      load_flat<C_IN>(r0 + nb * (FLAT_PX * LDX), LDX, x, (long long)next * FLAT_PX, total);
    }
    cp_commit();
    cp_wait_prev();
    __syncthreads();
    i8* res = r0 + (it & 1) * (FLAT_PX * LDX);
    stage3<FLAT_PX / 16>(a0 + (it & 1) * (FLAT_PX * LDY), ResFlat{res}, w3s, ps, zo3, zo_out);
    __syncthreads();
    store_flat<C_IN>(out, res, LDX, (long long)tile * FLAT_PX, total);
    __syncthreads();
  }
}
