// Host emulation of what bottleneck.cu takes from CUDA: one CTA at a time, each CUDA thread a std::thread, the
// warp-collective PTX (ldmatrix .x4, mma.sync m16n8k32 s8) computed from all 32 lanes' operands with the PTX ISA's
// fragment layouts, __syncthreads a block barrier, cp.async a synchronous copy (the earliest completion the hardware
// may show). Included by bottleneck.cu under FUSION_EMU (emu_main.cpp); not CUDA code.
#pragma once
#include <barrier>
#include <cstring>

#define __device__
#define __forceinline__ inline
#define __global__
#define __launch_bounds__(...)
#define __restrict__ __restrict

struct uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
struct uint2 {
  unsigned x, y;
};
inline uint2 make_uint2(unsigned a, unsigned b) { return uint2{a, b}; }
struct int4 {
  int x, y, z, w;
};
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline int __mulhi(int a, int b) { return (int)(((long long)a * (long long)b) >> 32); }

struct EmuDim {
  unsigned x;
};
extern thread_local EmuDim threadIdx;
extern EmuDim blockIdx, gridDim;

struct EmuWarp {
  std::barrier<>* bar;
  u32 addr[32];
  u32 a[32][4];
  u32 b[32][2];
};
struct EmuCta {
  unsigned char* smem;
  std::barrier<>* bar;
  EmuWarp warp[8];
};
extern EmuCta* emu_cta;

#define DYNAMIC_SMEM(name) unsigned char* name = emu_cta->smem

inline void __syncthreads() { emu_cta->bar->arrive_and_wait(); }

inline u32 smem_u32(const void* p) { return (u32)((const unsigned char*)p - emu_cta->smem); }

inline void cp16(void* dst, const void* src, bool valid) {
  if (valid)
    std::memcpy(dst, src, 16);
  else
    std::memset(dst, 0, 16);
}
inline void cp_commit() {}
inline void cp_wait_prev() {}
inline void cp_wait_all() {}

inline int keep_reg(int v) { return v; }

// prmt.b32 d, a, 0, sel (default mode): byte n of d is byte (sel >> 4n) & 7 of {0, a} (a: bytes 0..3), or with bit 3
// of that nibble set, that byte's sign bit replicated
inline u32 prmt(u32 a, u32 sel) {
  const unsigned long long src = a;
  u32 d = 0;
  for (int n = 0; n < 4; ++n) {
    const u32 nib = (sel >> (4 * n)) & 0xf;
    u32 byte = (u32)(src >> (8 * (nib & 7))) & 0xff;
    if (nib & 8) byte = (byte & 0x80) ? 0xff : 0;
    d |= byte << (8 * n);
  }
  return d;
}

// ldmatrix.m8n8.x4.b16: lane l gives the address of row l % 8 of matrix l / 8; register i of lane l holds 4 bytes
// of matrix i: row l / 4, bytes 4 (l % 4) .. 4 (l % 4) + 3
inline void ldsm4(u32 (&r)[4], u32 addr) {
  const int lane = threadIdx.x & 31;
  EmuWarp& w = emu_cta->warp[threadIdx.x >> 5];
  w.addr[lane] = addr;
  w.bar->arrive_and_wait();
  for (int i = 0; i < 4; ++i) std::memcpy(&r[i], emu_cta->smem + w.addr[8 * i + (lane >> 2)] + 4 * (lane & 3), 4);
  w.bar->arrive_and_wait();
}

inline int emu_byte(u32 word, int k) { return (int)(signed char)((word >> (8 * (k & 3))) & 0xff); }

// mma.sync.m16n8k32.row.col.s32.s8.s8.s32 (g = lane / 4, t = lane % 4):
//   a0: A[g][4t + i], a1: A[g + 8][4t + i], a2: A[g][16 + 4t + i], a3: A[g + 8][16 + 4t + i]
//   b0: B[4t + i][g], b1: B[16 + 4t + i][g]
//   c0: C[g][2t], c1: C[g][2t + 1], c2: C[g + 8][2t], c3: C[g + 8][2t + 1]
inline void mma_s8(int (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  const int lane = threadIdx.x & 31;
  EmuWarp& w = emu_cta->warp[threadIdx.x >> 5];
  for (int i = 0; i < 4; ++i) w.a[lane][i] = a[i];
  w.b[lane][0] = b0;
  w.b[lane][1] = b1;
  w.bar->arrive_and_wait();
  const int g = lane >> 2, t = lane & 3;
  for (int i = 0; i < 4; ++i) {
    const int m = g + (i >= 2 ? 8 : 0), n = 2 * t + (i & 1);
    unsigned sum = (unsigned)c[i];
    for (int k = 0; k < 32; ++k) {
      const int av = emu_byte(w.a[(m % 8) * 4 + (k % 16) / 4][(m >= 8 ? 1 : 0) + (k >= 16 ? 2 : 0)], k);
      const int bv = emu_byte(w.b[n * 4 + (k % 16) / 4][k >= 16 ? 1 : 0], k);
      sum += (unsigned)(av * bv);
    }
    c[i] = (int)sum;
  }
  w.bar->arrive_and_wait();
}
