// One ResNet-50 layer1 bottleneck block (non-downsample), INT8 NHWC, on tensor cores (mma.sync.m16n8k32.s8):
//   x [N,56,56,256] -> 1x1 256->64 (+ReLU) -> 3x3 64->64 pad 1 (+ReLU) -> 1x1 64->256 + residual x (+ReLU) -> out.
// Three ways to run it, sharing the same warp-level GEMM and epilogue code:
//   fused_bottleneck       one kernel, 14 x 8 output tiles, 1 CTA / SM (double-buffered 16 x 10 halo);
//   fused_bottleneck_7x8   one kernel, 7 x 8 output tiles, 2 CTAs / SM (<= 128 registers, <= 113 KB shared): one
//                          9 x 10 halo buffer, the next tile's halo loaded while conv2 and conv3 run, the residual
//                          read from global memory (L2: the halo load just brought it there);
//   k1_conv1x1 -> k2_conv3x3 -> k3_conv1x1_res   three kernels: the 64-channel intermediates go through global memory.
// Every kernel is persistent (a grid of at most #SM x blocks-per-SM CTAs of 256 threads, each looping over tiles),
// keeps its weights and requantize parameters in shared memory for all its tiles and loads its input tiles with
// cp.async (16-byte copies) ahead of their use.
//
// Epilogues (qcompile's exact integer math, compiler/tune/measure.py: requant, in the form qcompile's tensor-core
// kernels compile for ResNet-50: ConvSpec shift_ge33, res_i32, rq2_uniform; schedules/gemm/helpers.py):
//   stage 1, every S >= 33: v = (mulhi(t, M) + 2^(S-33)) >> (S-32) with t = acc + bias (int32, wrapping), which equals
//     (t * M + 2^(S-1)) >> S exactly (the low word of the product cannot carry into the rounded result); y = clip(v +
//     zo, lo, 127);
//   residual stage, (c1, R1, c2, R2, SR) the same for every channel (kernel arguments) and every intermediate within
//     int32: out = clip((((y3 + 128) R1 + r R2 + K0) >> SR) + zo_out, zo_out, 127), K0 = (c1 - 128) R1 + c2 R2 +
//     2^(SR-1) (mod 2^32: the sum fits int32, so the wrapped terms give the same bits).
// The weight rows are copied to shared memory permuted within each warp's output channels so that a lane's
// accumulator fragments hold contiguous channels: each lane reads its residual bytes and writes its outputs as one
// 4-, 8- or 16-byte access per row (conv3's and the unfused kernels' outputs straight to global memory, the 4 lanes
// of a row covering whole 32-byte sectors).
//
// Parameters: one int32 array of P_WORDS words (offsets P_*; the shifts sh = S - 32 as bytes), the weights w1
// [64][256], w2 [64][3][3][64] (K, R, S, C), w3 [256][64] int8. Compiles with NVRTC (CuPy RawModule) and nvcc.

typedef signed char i8;
typedef unsigned int u32;

#define IMG 56            // H = W
#define C_IN 256          // block input / output channels
#define C_MID 64          // bottleneck channels
#define TW 8              // tile width (both spatial tiles)
#define HALO_W (TW + 2)   // 10
#define TH 14             // 14 x 8 tiles (fused_bottleneck, k2_conv3x3)
#define HALO_PX ((TH + 2) * HALO_W)  // 160 = 10 m16 tiles
#define TILE_PX (TH * TW)            // 112 = 7 m16 tiles
#define TILES_PER_IMG ((IMG / TH) * (IMG / TW))  // 28
#define TH7 7             // 7 x 8 tiles (fused_bottleneck_7x8)
#define HALO7_PX ((TH7 + 2) * HALO_W)  // 90 (conv1 runs 6 m16 tiles: its rows 90..95 read y2, which follows)
#define TILE7_PX (TH7 * TW)            // 56 (conv2 and conv3 run 4 m16 tiles: see fused_bottleneck_7x8)
#define TILES7_PER_IMG ((IMG / TH7) * (IMG / TW))  // 56
#define FLAT_PX 128       // rows of a 1x1 kernel's (unfused) pixel tile
#define LDX 272           // shared row stride of a 256-channel row (256 + 16: conflict-free ldmatrix)
#define LDY 80            // of a 64-channel row
#define LDW2 592          // of a w2 row (576 + 16)
#define NTHREADS 256

#define P_B1 0
#define P_M1 64
#define P_B2 128
#define P_M2 192
#define P_B3 256
#define P_M3 512
#define P_SH 768          // the shifts sh = S - 32 (1..30), one byte per channel: conv1 at byte 0, conv2 64, conv3 128
#define P_SH1 0
#define P_SH2 64
#define P_SH3 128
#define P_WORDS 864

// shared memory of each kernel (bytes)
#define SMEM_W (C_MID * LDX + C_MID * LDW2 + C_IN * LDY)  // the three weight tiles
#define SMEM_P (P_WORDS * 4)
#define SMEM_FUSED (SMEM_W + SMEM_P + 2 * HALO_PX * LDX + (HALO_PX + TILE_PX) * LDY)
#define SMEM_F7 (HALO7_PX * LDX + TILE7_PX * LDY + SMEM_W + HALO7_PX * LDY + SMEM_P)
#define SMEM_K1 (C_MID * LDX + SMEM_P + 2 * FLAT_PX * LDX)
#define SMEM_K2 (C_MID * LDW2 + SMEM_P + 2 * HALO_PX * LDY)
#define SMEM_K3 (C_IN * LDY + SMEM_P + 2 * FLAT_PX * LDY + 2 * FLAT_PX * LDX)

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
__device__ __forceinline__ void cp_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// four 8x8 b16 matrices (= four blocks of 8 rows x 16 bytes); lane l gives the row address of row l%8 of matrix l/8
__device__ __forceinline__ void ldsm4(u32 (&r)[4], u32 addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));  // (ordered after shared stores by the __syncthreads between stages)
}

// c[16x8] += a[16x32] * b[32x8], int8 in, int32 accumulate
// v through a register: the compiler cannot recompute it later from its inputs (nvcc otherwise re-extracts the
// per-channel shifts and rounding terms from their packed bytes at every use, inside the row loops)
__device__ __forceinline__ int keep_reg(int v) {
  int r;
  asm volatile("mov.b32 %0, %1;" : "=r"(r) : "r"(v));
  return r;
}

// prmt.b32 d, a, 0, sel (default mode: selector nibble n picks byte n of d; bit 3 replicates that byte's sign bit)
__device__ __forceinline__ u32 prmt(u32 a, u32 sel) {
  u32 d;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(d) : "r"(a), "r"(sel));
  return d;
}

__device__ __forceinline__ void mma_s8(int (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#endif  // FUSION_EMU

// ---------------------------------------------------------------------------------------------------------------
// requantize (32-bit, exact for S >= 33 and the residual stage within int32; see the top of the file)
// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ int clampi(int v, int lo, int hi) { return max(min(v, hi), lo); }

struct Rq {  // one output channel's stage-1 parameters: bias, M, sh = S - 32 and 2^(sh - 1)
  int b, m, sh, rnd;
};
__device__ __forceinline__ int rq_v(int acc, const Rq& q) {  // round(t * M / 2^S), t = acc + b (wrapping)
  const int t = (int)((u32)acc + (u32)q.b);
  return (__mulhi(t, q.m) + q.rnd) >> q.sh;
}
__device__ __forceinline__ Rq rq_make(int b, int m, u32 sh) {
  return Rq{b, m, keep_reg((int)sh), keep_reg(1 << (sh - 1))};
}

// NC contiguous channels' parameters from ch0 (a multiple of 4): bias and M as 16-byte loads, the shifts 4 at a time
template <int NC>
__device__ __forceinline__ void rq_load(Rq (&q)[NC], const int* ps, int pb, int pm, int psh, int ch0) {
  const unsigned char* sh = (const unsigned char*)(ps + P_SH) + psh + ch0;
#pragma unroll
  for (int i = 0; i < NC; i += 4) {
    const int4 b = *(const int4*)(ps + pb + ch0 + i), m = *(const int4*)(ps + pm + ch0 + i);
    const u32 s = *(const u32*)(sh + i);
    q[i] = rq_make(b.x, m.x, s & 0xff);
    q[i + 1] = rq_make(b.y, m.y, (s >> 8) & 0xff);
    q[i + 2] = rq_make(b.z, m.z, (s >> 16) & 0xff);
    q[i + 3] = rq_make(b.w, m.w, s >> 24);
  }
}

__device__ __forceinline__ u32 pack4(int a, int b, int c, int d) {
  return (u32)(a & 0xff) | ((u32)(b & 0xff) << 8) | ((u32)(c & 0xff) << 16) | ((u32)d << 24);
}
// byte k of w, sign-extended: one prmt (selector nibbles k, then 8 + k three times: byte k's sign bit replicated)
__device__ __forceinline__ int byte_s(u32 w, int k) { return (int)prmt(w, 0x8880u + 0x1111u * (u32)k); }

// the residual stage's parameters (kernel arguments, the same for every channel)
struct Res {
  u32 r1, r2, k0;
  int sr, zo3rel, zo_out;  // zo3rel = zo3 + 128 (stage 1 of conv3 as y3 + 128: clip(v + zo3 + 128, 0, 255))
};
__device__ __forceinline__ Res res_params(int zo3, int zo_out, int c1, int r1, int c2, int r2, int sr) {
  const u32 k0 = (u32)(c1 - 128) * (u32)r1 + (u32)c2 * (u32)r2 + (1u << (sr - 1));
  return Res{(u32)r1, (u32)r2, (u32)keep_reg((int)k0), sr, zo3 + 128, zo_out};  // (kept: nvcc would split r R2 + K0
                                                                                // back into (r + c2) R2 + ...)
}
__device__ __forceinline__ int res_v(int acc, const Rq& q, int r, const Res& p) {
  const int y = clampi(rq_v(acc, q) + p.zo3rel, 0, 255);
  const int u = (int)((u32)y * p.r1 + ((u32)r * p.r2 + p.k0));
  return clampi((u >> p.sr) + p.zo_out, p.zo_out, 127);
}

// one row of a lane's ReLU-stage outputs: acc[nt][2h + e] is channel 2 nt + e of the lane's 2 NT -> NT / 2 words
template <int NT>
__device__ __forceinline__ void relu_row(u32 (&w)[NT / 2], const int (&acc)[NT][4], int h, const Rq (&q)[2 * NT],
                                         int zo) {
#pragma unroll
  for (int i = 0; i < NT / 2; ++i) {
    int o[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) o[k] = clampi(rq_v(acc[2 * i + k / 2][2 * h + (k & 1)], q[4 * i + k]) + zo, zo, 127);
    w[i] = pack4(o[0], o[1], o[2], o[3]);
  }
}

template <int NW>
__device__ __forceinline__ void st_words(i8* p, const u32 (&w)[NW]) {
  if constexpr (NW == 1) {
    *(u32*)p = w[0];
  } else if constexpr (NW == 2) {
    *(uint2*)p = make_uint2(w[0], w[1]);
  } else {
    *(uint4*)p = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// conv3 + residual, one row of a lane's 8 channels: residual bytes r (8), outputs -> 8 bytes at o
__device__ __forceinline__ void res_row(i8* o, const int (&acc)[4][4], int h, const Rq (&q)[8], uint2 r,
                                        const Res& p) {
  int v[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = res_v(acc[k / 2][2 * h + (k & 1)], q[k], byte_s(k < 4 ? r.x : r.y, k & 3), p);
  *(uint2*)o = make_uint2(pack4(v[0], v[1], v[2], v[3]), pack4(v[4], v[5], v[6], v[7]));
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
// where a stage's rows go / come from (pixel p of a tile -> a row pointer; nullptr: no such pixel)
// ---------------------------------------------------------------------------------------------------------------
struct Tile {
  int n, h0, w0;
};
template <int TH_>
__device__ __forceinline__ Tile spatial_tile(int tile) {
  constexpr int PER = (IMG / TH_) * (IMG / TW);
  const int r = tile % PER;
  return Tile{tile / PER, (r / (IMG / TW)) * TH_, (r % (IMG / TW)) * TW};
}

template <int TH_, int CH>
struct GlobalSpatial {  // pixel p of a TH_ x TW tile of a CH-channel NHWC tensor (32-bit offsets from the tile's origin)
  i8* origin;
  __device__ __forceinline__ GlobalSpatial(const i8* base, Tile tl)
      : origin((i8*)base + (((long long)tl.n * IMG + tl.h0) * IMG + tl.w0) * CH) {}
  __device__ __forceinline__ i8* operator()(int p) const {
    return p < TH_ * TW ? origin + ((p / TW) * IMG + p % TW) * CH : nullptr;
  }
};
template <int CH>
struct GlobalFlat {  // pixel px0 + p of a CH-channel tensor of total pixels
  i8* origin;
  int rows;  // pixels of the tile inside the tensor
  __device__ __forceinline__ GlobalFlat(i8* base, long long px0, long long total)
      : origin(base + px0 * CH), rows((int)(total - px0 < FLAT_PX ? total - px0 : FLAT_PX)) {}
  __device__ __forceinline__ i8* operator()(int p) const { return p < rows ? origin + p * CH : nullptr; }
};
struct SharedRows {  // row p (< rows) of a shared tile of stride ld
  i8* base;
  int ld, rows;
  __device__ __forceinline__ i8* operator()(int p) const { return p < rows ? base + p * ld : nullptr; }
};
struct HaloCentre {  // pixel p of the 14 x 8 tile in its 16 x 10 halo (256-channel rows)
  i8* base;
  __device__ __forceinline__ i8* operator()(int p) const { return base + ((p / TW + 1) * HALO_W + p % TW + 1) * LDX; }
};

// ---------------------------------------------------------------------------------------------------------------
// the stages (a CTA of 8 warps)
// ---------------------------------------------------------------------------------------------------------------
// fused conv1: halo [(TH_ + 2) x 10 rows, read as 2 MT m16 tiles][LDX] -> y1 [.][LDY]; 8 jobs of MT m16 tiles x 16
// channels (w1s rows permuted in groups of 16); halo pixels outside the image get conv2's pad value zo1
template <int TH_, int MT>
__device__ __forceinline__ void stage1_halo(const i8* halo, i8* y1, const i8* w1s, const int* ps, int zo1, Tile tl) {
  constexpr int HPX = (TH_ + 2) * HALO_W;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, j = lane >> 3, g = lane >> 2, t = lane & 3;
  const int mh = warp & 1, nq = warp >> 1, ch0 = nq * 16 + 4 * t;
  u32 a_addr[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    a_addr[mt] = smem_u32(halo + ((mh * MT + mt) * 16 + (j & 1) * 8 + (lane & 7)) * LDX + (j >> 1) * 16);
  const u32 b_addr = smem_u32(w1s + (nq * 16 + (j >> 1) * 8 + (lane & 7)) * LDX + (j & 1) * 16);
  int acc[MT][2][4];
  zero_acc(acc);
  warp_gemm<MT, 1, C_IN / 32>(acc, a_addr, b_addr, 0u, K1x1());
  Rq q[4];
  rq_load<4>(q, ps, P_B1, P_M1, P_SH1, ch0);
  const u32 pad = (u32)(zo1 & 0xff) * 0x01010101u;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = (mh * MT + mt) * 16 + g + 8 * h;
      if (row >= HPX) continue;
      const int ih = tl.h0 - 1 + row / HALO_W, iw = tl.w0 - 1 + row % HALO_W;
      u32 w[1];
      relu_row<2>(w, acc[mt], h, q, zo1);
      const bool inside = ih >= 0 && ih < IMG && iw >= 0 && iw < IMG;
      *(u32*)(y1 + row * LDY + ch0) = inside ? w[0] : pad;
    }
}

// unfused conv1: a [128][LDX] -> y1 in global memory; 8 jobs of 2 m16 tiles x 32 channels (w1s permuted by 32)
__device__ __forceinline__ void stage1_flat(const i8* a, GlobalFlat<C_MID> out, const i8* w1s, const int* ps,
                                            int zo1) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, j = lane >> 3, g = lane >> 2, t = lane & 3;
  const int mq = warp & 3, nh = warp >> 2, ch0 = nh * 32 + 8 * t;
  u32 a_addr[2];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
    a_addr[mt] = smem_u32(a + ((mq * 2 + mt) * 16 + (j & 1) * 8 + (lane & 7)) * LDX + (j >> 1) * 16);
  const u32 b_addr = smem_u32(w1s + (nh * 32 + (j >> 1) * 8 + (lane & 7)) * LDX + (j & 1) * 16);
  int acc[2][4][4];
  zero_acc(acc);
  warp_gemm<2, 2, C_IN / 32>(acc, a_addr, b_addr, 16u * LDX, K1x1());
  Rq q[8];
  rq_load<8>(q, ps, P_B1, P_M1, P_SH1, ch0);
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      i8* o = out((mq * 2 + mt) * 16 + g + 8 * h);
      if (!o) continue;
      u32 w[2];
      relu_row<4>(w, acc[mt], h, q, zo1);
      st_words<2>(o + ch0, w);
    }
}

// conv2 (fused and unfused): yin [halo rows][LDY] (the (TH_ + 2) x 10 halo, pads already zo1) -> out(p); a warp job
// is one m16 tile (two output rows of 8 pixels) x 8 NT channels (w2s permuted in groups of 8 NT); 14 x 8, NT 8:
// warps 0..6; 7 x 8, NT 4: 4 m16 tiles (the last one half outside the tile) x 2 channel halves
template <int TH_, int NT, class Out>
__device__ __forceinline__ void stage2(const i8* yin, Out out, const i8* w2s, const int* ps, int zo2) {
  constexpr int NMT = (TH_ * TW + 15) / 16, NG = C_MID / (8 * NT);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, j = lane >> 3, g = lane >> 2, t = lane & 3;
  if (warp >= NMT * NG) return;
  const int mt = warp % NMT, ng = warp / NMT, ch0 = ng * 8 * NT + 2 * NT * t;
  u32 a_addr[1];
  a_addr[0] = smem_u32(yin + ((2 * mt + (j & 1)) * HALO_W + (lane & 7)) * LDY + (j >> 1) * 16);
  const u32 b_addr = smem_u32(w2s + (ng * 8 * NT + (j >> 1) * 8 + (lane & 7)) * LDW2 + (j & 1) * 16);
  int acc[1][NT][4];
  zero_acc(acc);
  warp_gemm<1, NT / 2, 9 * C_MID / 32>(acc, a_addr, b_addr, 16u * LDW2, K3x3());
  Rq q[2 * NT];
  rq_load<2 * NT>(q, ps, P_B2, P_M2, P_SH2, ch0);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    i8* o = out(mt * 16 + g + 8 * h);
    if (!o) continue;
    u32 w[NT / 2];
    relu_row<NT>(w, acc[0], h, q, zo2);
    st_words<NT / 2>(o + ch0, w);
  }
}

// conv3 + residual: yin [NMT * 16][LDY] -> out(p), residual bytes at res(p); warp w owns output channels 32 w ..
// 32 w + 31 (w3s permuted in groups of 32), all m tiles in turn, software-pipelined: m tile m + 1's MMAs are issued
// before m tile m's epilogue (the tensor cores work while the epilogue's integer math issues)
template <int NMT, class RR, class Out>
__device__ __forceinline__ void stage3(const i8* yin, RR res, Out out, const i8* w3s, const int* ps, const Res& rp) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, j = lane >> 3, g = lane >> 2, t = lane & 3;
  const int ch0 = warp * 32 + 8 * t;
  const u32 b_addr = smem_u32(w3s + (warp * 32 + (j >> 1) * 8 + (lane & 7)) * LDY + (j & 1) * 16);
  const u32 a_addr0 = smem_u32(yin + ((j & 1) * 8 + (lane & 7)) * LDY + (j >> 1) * 16);
  Rq q[8];
  rq_load<8>(q, ps, P_B3, P_M3, P_SH3, ch0);
  const auto gemm = [&](int (&acc)[1][4][4], int m) {
    const u32 a_addr[1] = {a_addr0 + (u32)(m * 16 * LDY)};
    zero_acc(acc);
    warp_gemm<1, 2, C_MID / 32>(acc, a_addr, b_addr, 16u * LDY, K1x1());
  };
  const auto epilogue = [&](const int (&acc)[1][4][4], int m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int p = m * 16 + g + 8 * h;
      i8* o = out(p);
      if (o) res_row(o + ch0, acc[0], h, q, *(const uint2*)(res(p) + ch0), rp);
    }
  };
  int acc0[1][4][4], acc1[1][4][4];
  gemm(acc0, 0);
#pragma unroll 1
  for (int m = 0; m < NMT; m += 2) {
    if (m + 1 < NMT) gemm(acc1, m + 1);
    epilogue(acc0, m);
    if (m + 1 < NMT) {
      if (m + 2 < NMT) gemm(acc0, m + 2);
      epilogue(acc1, m + 1);
    }
  }
}

// conv3 + residual of the 7 x 8 tile: as stage3, the residual read from global memory one m tile ahead (the loads of
// m tile m + 1 in flight during m tile m's MMAs and epilogue)
template <class RR, class Out>
__device__ __forceinline__ void stage3_prefetch(const i8* yin, RR res, Out out, const i8* w3s, const int* ps,
                                                const Res& rp) {
  constexpr int NMT = (TILE7_PX + 15) / 16;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, j = lane >> 3, g = lane >> 2, t = lane & 3;
  const int ch0 = warp * 32 + 8 * t;
  const u32 b_addr = smem_u32(w3s + (warp * 32 + (j >> 1) * 8 + (lane & 7)) * LDY + (j & 1) * 16);
  Rq q[8];
  rq_load<8>(q, ps, P_B3, P_M3, P_SH3, ch0);
  // (rows past the tile, and past the last m tile, load the tile's last pixel instead: read, never used)
  const auto res_at = [&](int p) { return *(const uint2*)(res(p < TILE7_PX ? p : TILE7_PX - 1) + ch0); };
  uint2 r[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) r[h] = res_at(g + 8 * h);
#pragma unroll 1
  for (int m = 0; m < NMT; ++m) {
    uint2 rn[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) rn[h] = res_at((m + 1) * 16 + g + 8 * h);
    u32 a_addr[1];
    a_addr[0] = smem_u32(yin + (m * 16 + (j & 1) * 8 + (lane & 7)) * LDY + (j >> 1) * 16);
    int acc[1][4][4];
    zero_acc(acc);
    warp_gemm<1, 2, C_MID / 32>(acc, a_addr, b_addr, 16u * LDY, K1x1());
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      i8* o = out(m * 16 + g + 8 * h);
      if (o) res_row(o + ch0, acc[0], h, q, r[h], rp);
      r[h] = rn[h];
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// tile movement (256 threads; 16-byte chunks, consecutive threads on consecutive chunks)
// ---------------------------------------------------------------------------------------------------------------
// the weights' rows x row_bytes from global (row stride row_bytes) to shared (row stride ld), plain loads; shared row
// c holds global row perm(c): in each group of 8 NT rows (a warp's output channels), row 8 nt + 2 t + e (the channel
// of n8 tile nt that lane t's fragment holds, e = 0, 1) holds channel 2 NT t + 2 nt + e: lane t's 2 NT accumulator
// columns are then 2 NT contiguous channels
template <int NT>
__device__ __forceinline__ void copy_w_perm(i8* dst, int ld, const i8* src, int rows, int row_bytes) {
  const int per_row = row_bytes / 16;
  for (int q = threadIdx.x; q < rows * per_row; q += NTHREADS) {
    const int r = q / per_row, c = q % per_row, k = r % (8 * NT);
    const int from = r - k + ((k & 7) >> 1) * 2 * NT + (k >> 3) * 2 + (k & 1);
    *(uint4*)(dst + r * ld + c * 16) = *(const uint4*)(src + (long long)from * row_bytes + c * 16);
  }
}

__device__ __forceinline__ void load_params(int* ps, const int* params) {
  for (int q = threadIdx.x; q < P_WORDS / 4; q += NTHREADS) ((int4*)ps)[q] = ((const int4*)params)[q];
}

// the (TH_ + 2) x (TW + 2) halo of a CH-channel NHWC tensor; outside the image: zero-filled (pad_word < 0) or the
// bytes of pad_word
template <int CH, int TH_>
__device__ __forceinline__ void load_halo(i8* dst, int ld, const i8* src, Tile tl, long long pad_word) {
  constexpr int PER = CH / 16, HPX = (TH_ + 2) * HALO_W;
  for (int q = threadIdx.x; q < HPX * PER; q += NTHREADS) {
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

// FLAT_PX consecutive pixels (from pixel px0 of total) of a CH-channel tensor -> shared rows of stride ld
template <int CH>
__device__ __forceinline__ void load_flat(i8* dst, int ld, const i8* src, long long px0, long long total) {
  constexpr int PER = CH / 16;
  for (int q = threadIdx.x; q < FLAT_PX * PER; q += NTHREADS) {
    const int r = q / PER, c = q % PER;
    const bool ok = px0 + r < total;
    cp16(dst + r * ld + c * 16, ok ? src + (px0 + r) * CH + c * 16 : src, ok);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// the kernels
// ---------------------------------------------------------------------------------------------------------------
extern "C" __global__ void smem_sizes(int* out) {
  out[0] = SMEM_FUSED;
  out[1] = SMEM_F7;
  out[2] = SMEM_K1;
  out[3] = SMEM_K2;
  out[4] = SMEM_K3;
}

// the fused block, 14 x 8 tiles: per tile the 16 x 10 x 256 halo of x in (double-buffered), out straight to global
extern "C" __global__ void __launch_bounds__(NTHREADS, 1)
    fused_bottleneck(const i8* __restrict__ x, const i8* __restrict__ w1, const i8* __restrict__ w2,
                     const i8* __restrict__ w3, const int* __restrict__ params, i8* __restrict__ out, int N, int zo1,
                     int zo2, int zo3, int zo_out, int c1, int r1, int c2, int r2, int sr) {
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
  const Res rp = res_params(zo3, zo_out, c1, r1, c2, r2, sr);
  copy_w_perm<2>(w1s, LDX, w1, C_MID, C_IN);
  copy_w_perm<8>(w2s, LDW2, w2, C_MID, 9 * C_MID);
  copy_w_perm<4>(w3s, LDY, w3, C_IN, C_MID);
  load_params(ps, params);
  load_halo<C_IN, TH>(halo0, LDX, x, spatial_tile<TH>(blockIdx.x), -1);
  cp_commit();
  int it = 0;
  for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x, ++it) {
    i8* cur = halo0 + (it & 1) * (HALO_PX * LDX);
    const int next = tile + gridDim.x;
    if (next < ntiles)
      load_halo<C_IN, TH>(halo0 + ((it + 1) & 1) * (HALO_PX * LDX), LDX, x, spatial_tile<TH>(next), -1);
    cp_commit();
    cp_wait_prev();
    __syncthreads();
    const Tile tl = spatial_tile<TH>(tile);
    stage1_halo<TH, HALO_PX / 32>(cur, y1, w1s, ps, zo1, tl);
    __syncthreads();
    stage2<TH, 8>(y1, SharedRows{y2, LDY, TILE_PX}, w2s, ps, zo2);
    __syncthreads();
    stage3<TILE_PX / 16>(y2, HaloCentre{cur}, GlobalSpatial<TH, C_IN>(out, tl), w3s, ps, rp);
    __syncthreads();  // (the next iteration's load overwrites this halo)
  }
}

// the fused block, 7 x 8 tiles, 2 CTAs per SM. Shared memory, in this order (what the m16 tiles' extra rows read):
// halo [90][LDX] (conv1's rows 90..95 read y2: not written during conv1), y2 [56][LDY] (conv3's rows 56..63 read
// w1s), w1s, w2s, w3s, y1 [90][LDY] (conv2's rows of pixels 56..63 read up to y1 row 99: the parameters), params
extern "C" __global__ void __launch_bounds__(NTHREADS, 2)
    fused_bottleneck_7x8(const i8* __restrict__ x, const i8* __restrict__ w1, const i8* __restrict__ w2,
                         const i8* __restrict__ w3, const int* __restrict__ params, i8* __restrict__ out, int N,
                         int zo1, int zo2, int zo3, int zo_out, int c1, int r1, int c2, int r2, int sr) {
  DYNAMIC_SMEM(smem);
  i8* halo = (i8*)smem;
  i8* y2 = halo + HALO7_PX * LDX;
  i8* w1s = y2 + TILE7_PX * LDY;
  i8* w2s = w1s + C_MID * LDX;
  i8* w3s = w2s + C_MID * LDW2;
  i8* y1 = w3s + C_IN * LDY;
  int* ps = (int*)(y1 + HALO7_PX * LDY);
  const int ntiles = N * TILES7_PER_IMG;
  if ((int)blockIdx.x >= ntiles) return;
  const Res rp = res_params(zo3, zo_out, c1, r1, c2, r2, sr);
  copy_w_perm<2>(w1s, LDX, w1, C_MID, C_IN);
  copy_w_perm<4>(w2s, LDW2, w2, C_MID, 9 * C_MID);
  copy_w_perm<4>(w3s, LDY, w3, C_IN, C_MID);
  load_params(ps, params);
  load_halo<C_IN, TH7>(halo, LDX, x, spatial_tile<TH7>(blockIdx.x), -1);
  cp_commit();
  for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const Tile tl = spatial_tile<TH7>(tile);
    cp_wait_all();
    __syncthreads();  // this tile's halo in; the last tile's conv3 done with y2
    stage1_halo<TH7, 3>(halo, y1, w1s, ps, zo1, tl);
    __syncthreads();  // y1 complete; the halo free
    const int next = tile + gridDim.x;
    if (next < ntiles) load_halo<C_IN, TH7>(halo, LDX, x, spatial_tile<TH7>(next), -1);
    cp_commit();
    stage2<TH7, 4>(y1, SharedRows{y2, LDY, TILE7_PX}, w2s, ps, zo2);
    __syncthreads();  // y2 complete
    stage3_prefetch(y2, GlobalSpatial<TH7, C_IN>(x, tl), GlobalSpatial<TH7, C_IN>(out, tl), w3s, ps, rp);
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
  const long long total = (long long)N * IMG * IMG;
  const int ntiles = (int)((total + FLAT_PX - 1) / FLAT_PX);
  if ((int)blockIdx.x >= ntiles) return;
  copy_w_perm<4>(w1s, LDX, w1, C_MID, C_IN);
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
    stage1_flat(a0 + (it & 1) * (FLAT_PX * LDX), GlobalFlat<C_MID>(y1g, (long long)tile * FLAT_PX, total), w1s, ps,
                zo1);
    __syncthreads();
  }
}

// unfused 2: y2 = conv3x3(y1) over 14 x 8 tiles (the halo's outside pixels filled with zo1)
extern "C" __global__ void __launch_bounds__(NTHREADS, 2)
    k2_conv3x3(const i8* __restrict__ y1g, const i8* __restrict__ w2, const int* __restrict__ params,
               i8* __restrict__ y2g, int N, int zo1, int zo2) {
  DYNAMIC_SMEM(smem);
  i8* w2s = (i8*)smem;
  int* ps = (int*)(w2s + C_MID * LDW2);
  i8* h0buf = (i8*)(ps + P_WORDS);  // two halo buffers, HALO_PX * LDY bytes apart
  const int ntiles = N * TILES_PER_IMG;
  if ((int)blockIdx.x >= ntiles) return;
  const long long pad_word = (long long)((u32)(zo1 & 0xff) * 0x01010101u);
  copy_w_perm<8>(w2s, LDW2, w2, C_MID, 9 * C_MID);
  load_params(ps, params);
  load_halo<C_MID, TH>(h0buf, LDY, y1g, spatial_tile<TH>(blockIdx.x), pad_word);
  cp_commit();
  int it = 0;
  for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x, ++it) {
    const int next = tile + gridDim.x;
    if (next < ntiles)
      load_halo<C_MID, TH>(h0buf + ((it + 1) & 1) * (HALO_PX * LDY), LDY, y1g, spatial_tile<TH>(next), pad_word);
    cp_commit();
    cp_wait_prev();
    __syncthreads();
    stage2<TH, 8>(h0buf + (it & 1) * (HALO_PX * LDY), GlobalSpatial<TH, C_MID>(y2g, spatial_tile<TH>(tile)), w2s, ps,
                  zo2);
    __syncthreads();
  }
}

// unfused 3: out = conv1x1(y2) + residual x over tiles of FLAT_PX pixels (the residual tile in shared memory)
extern "C" __global__ void __launch_bounds__(NTHREADS, 2)
    k3_conv1x1_res(const i8* __restrict__ y2g, const i8* __restrict__ x, const i8* __restrict__ w3,
                   const int* __restrict__ params, i8* __restrict__ out, int N, int zo3, int zo_out, int c1, int r1,
                   int c2, int r2, int sr) {
  DYNAMIC_SMEM(smem);
  i8* w3s = (i8*)smem;
  int* ps = (int*)(w3s + C_IN * LDY);
  i8* a0 = (i8*)(ps + P_WORDS);           // two conv inputs, FLAT_PX * LDY bytes apart
  i8* r0 = a0 + 2 * FLAT_PX * LDY;        // two residual tiles, FLAT_PX * LDX bytes apart
  const long long total = (long long)N * IMG * IMG;
  const int ntiles = (int)((total + FLAT_PX - 1) / FLAT_PX);
  if ((int)blockIdx.x >= ntiles) return;
  const Res rp = res_params(zo3, zo_out, c1, r1, c2, r2, sr);
  copy_w_perm<4>(w3s, LDY, w3, C_IN, C_MID);
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
    stage3<FLAT_PX / 16>(a0 + (it & 1) * (FLAT_PX * LDY), SharedRows{r0 + (it & 1) * (FLAT_PX * LDX), LDX, FLAT_PX},
                         GlobalFlat<C_IN>(out, (long long)tile * FLAT_PX, total), w3s, ps, rp);
    __syncthreads();
  }
}
