// SIMD helpers shared by the fused CPU kernels (ops/*/csrc/*.cpp): one vector type
// of the width the kernel is compiled for, and the few operations on it they need.
//
// The width follows the compiler's target (set by _native.py from RWKVX_CPU_ISA):
//   AVX-512      64-byte vectors (16 fp32 lanes), 32 registers
//   AVX2 + FMA   32-byte vectors ( 8 fp32 lanes), 16 registers
//   otherwise    16-byte vectors ( 4 fp32 lanes): SSE2 on x86-64, NEON on aarch64
// Kernels size their register blocks with kRegs: a block's accumulators must fit the
// register file, or every one of them spills to the stack on each step (a 64-byte
// vector is two ymm registers on AVX2, so code written for AVX-512's 32 zmm spills
// almost everything there). Vectors are GCC/Clang vector extensions, so the same
// source builds for every target; arithmetic on them (a * b + c contracts to FMA)
// and scalar-vector operations (the scalar is broadcast) are the compiler's.
// RWKVX_FP32 / RWKVX_FP64 choose the precisions a library exports: _native.py builds one
// library per precision (compiling only fp32, what training uses, halves the first-use build);
// with neither defined both are exported.
// RWKVX_SIMD_BYTES / RWKVX_SIMD_REGS may be predefined: the tests build the AVX-512
// layout (64, 32) with AVX2 instructions to check it on a CPU without AVX-512.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if !defined(RWKVX_FP32) && !defined(RWKVX_FP64)
#define RWKVX_FP32 1
#define RWKVX_FP64 1
#endif

// A kernel defines RWKVX_EXPORT(F, SUFFIX), its extern "C" entry points for one float type
// (`<op>_forward_##SUFFIX`, ...), and ends with RWKVX_EXPORT_PRECISIONS: those of each
// precision this build exports.
#ifdef RWKVX_FP32
#define RWKVX_EXPORT_F32 RWKVX_EXPORT(float, f32)
#else
#define RWKVX_EXPORT_F32
#endif
#ifdef RWKVX_FP64
#define RWKVX_EXPORT_F64 RWKVX_EXPORT(double, f64)
#else
#define RWKVX_EXPORT_F64
#endif
#define RWKVX_EXPORT_PRECISIONS RWKVX_EXPORT_F32 RWKVX_EXPORT_F64

#ifndef RWKVX_SIMD_BYTES
#if defined(__AVX512F__)
#define RWKVX_SIMD_BYTES 64
#elif defined(__AVX2__) && defined(__FMA__)
#define RWKVX_SIMD_BYTES 32
#else
#define RWKVX_SIMD_BYTES 16
#endif
#endif

#ifndef RWKVX_SIMD_REGS
#if defined(__AVX512F__) || defined(__aarch64__)
#define RWKVX_SIMD_REGS 32
#else
#define RWKVX_SIMD_REGS 16
#endif
#endif

namespace simd {

constexpr int kBytes = RWKVX_SIMD_BYTES;
constexpr int kRegs = RWKVX_SIMD_REGS;

template <typename F>
struct Vec {
  typedef F type __attribute__((vector_size(kBytes)));
  static constexpr int L = kBytes / sizeof(F);  // lanes
};

// The largest power of two b <= n (n a power of two) with per * b + fixed <= kRegs, at
// least 1: how many vectors of a row one block takes when each costs `per` registers
// and the loop needs `fixed` more (broadcast scalars, temporaries).
constexpr int block(int n, int per, int fixed) {
  int b = 1;
  while (b * 2 <= n && per * b * 2 + fixed <= kRegs) b *= 2;
  return b;
}

template <typename F>
inline typename Vec<F>::type load(const F* p) {
  typename Vec<F>::type x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

template <typename F>
inline void store(F* p, typename Vec<F>::type x) {
  std::memcpy(p, &x, sizeof(x));
}

// Asks for the cache lines of p[0, n) ahead of use. The kernels read each step's
// inputs from a [B, T, H, N] tensor, a stride of H * N between steps: a pattern the
// hardware prefetchers follow poorly for the 6 to 8 such streams a kernel reads.
template <typename F>
inline void prefetch(const F* p, int n, bool for_write = false) {
  for (int i = 0; i < n; i += 64 / sizeof(F))
    for_write ? __builtin_prefetch(p + i, 1) : __builtin_prefetch(p + i, 0);
}

// Horizontal sum, in registers: AVX-512's reduction where it exists, else a halving
// tree of shuffles (a round trip through memory costs a store-forwarding stall).
template <typename F>
inline F hsum(typename Vec<F>::type x) {
#if defined(__AVX512F__) && RWKVX_SIMD_BYTES == 64
  if constexpr (sizeof(F) == 4)
    return _mm512_reduce_add_ps(reinterpret_cast<__m512>(x));
  else
    return _mm512_reduce_add_pd(reinterpret_cast<__m512d>(x));
#elif defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
  constexpr int L = Vec<F>::L;
  typedef F V8 __attribute__((vector_size(8 * sizeof(F))));
  typedef F V4 __attribute__((vector_size(4 * sizeof(F))));
  typedef F V2 __attribute__((vector_size(2 * sizeof(F))));
  V8 x8;
  if constexpr (L == 16)
    x8 = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  V4 x4;
  if constexpr (L >= 8) {
    if constexpr (L == 8) std::memcpy(&x8, &x, sizeof(x8));
    x4 = __builtin_shufflevector(x8, x8, 0, 1, 2, 3) + __builtin_shufflevector(x8, x8, 4, 5, 6, 7);
  }
  V2 x2;
  if constexpr (L >= 4) {
    if constexpr (L == 4) std::memcpy(&x4, &x, sizeof(x4));
    x2 = __builtin_shufflevector(x4, x4, 0, 1) + __builtin_shufflevector(x4, x4, 2, 3);
  } else {
    std::memcpy(&x2, &x, sizeof(x2));
  }
  return x2[0] + x2[1];
#else
  F s = 0;
  for (int l = 0; l < Vec<F>::L; l++) s += x[l];
  return s;
#endif
}

// The horizontal sums of L vectors at once, into one vector (lane i = Σ x[i]): log2(L)
// rounds of pairwise shuffles and adds, 2L - 2 shuffles for all L sums where one
// hsum alone takes about 2 log2(L). x is overwritten.
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
template <typename V, int L, int S, int... I>
inline V pair_sums(V a, V b, std::integer_sequence<int, I...>) {
  // Lane i takes lanes j and j + S of a (or b, for odd blocks of S lanes): j = 2S (i / 2S) + i % S.
  return __builtin_shufflevector(a, b, (((I / S) % 2 ? L : 0) + I / (2 * S) * 2 * S + I % S)...) +
         __builtin_shufflevector(a, b, (((I / S) % 2 ? L : 0) + I / (2 * S) * 2 * S + I % S + S)...);
}

template <typename F, int S = 1>
inline typename Vec<F>::type hsums(typename Vec<F>::type* x) {
  constexpr int L = Vec<F>::L;
  if constexpr (S >= L) {
    return x[0];
  } else {
    for (int i = 0; i < L / (2 * S); i++)
      x[i] = pair_sums<typename Vec<F>::type, L, S>(x[2 * i], x[2 * i + 1], std::make_integer_sequence<int, L>{});
    return hsums<F, 2 * S>(x);
  }
}
#else
template <typename F>
inline typename Vec<F>::type hsums(typename Vec<F>::type* x) {
  typename Vec<F>::type out;
  for (int i = 0; i < Vec<F>::L; i++) out[i] = hsum<F>(x[i]);
  return out;
}
#endif

// Σ_i a_i b_i (b = nullptr: Σ_i a_i) over n values, in vectors: a scalar loop would be one
// chain of dependent adds (the compiler may not reorder them), n times their latency.
template <typename F>
inline F dot(const F* a, const F* b, int n) {
  constexpr int L = Vec<F>::L;
  typename Vec<F>::type acc = {};
  int i = 0;
  for (; i + L <= n; i += L) acc += b ? load(a + i) * load(b + i) : load(a + i);
  F s = hsum<F>(acc);
  for (; i < n; i++) s += b ? a[i] * b[i] : a[i];
  return s;
}

// e^x for x <= 0 in fp32 (Cephes expf: x = n ln2 + r, degree-6 polynomial in r,
// about 1 ulp), exactly 0 below -87.3 (so e^{-1e38} = 0).
inline Vec<float>::type exp_nonpos(Vec<float>::type x) {
  typedef Vec<float>::type V;
  typedef int32_t VI __attribute__((vector_size(kBytes)));
  const V lo = V{} - 87.3365447504f;
  const auto tiny = x < lo;
  x = x < lo ? lo : x;
  x = x > 0.0f ? V{} : x;
  const V fx = x * 1.44269504088896341f + 0.5f;
  V n = __builtin_convertvector(__builtin_convertvector(fx, VI), V);
  n = n > fx ? n - 1.0f : n;  // floor
  const V r = x - n * 0.693359375f + n * 2.12194440e-4f;
  const V z = r * r;
  V p = 1.9875691500e-4f * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * z + r + 1.0f;
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
  const V res = p * (V)bits;
  return tiny ? V{} : res;
}

// fp64 (the gradient checks): lane by lane with the C library.
inline Vec<double>::type exp_nonpos(Vec<double>::type x) {
  for (int l = 0; l < Vec<double>::L; l++) x[l] = std::exp(x[l]);
  return x;
}

}  // namespace simd

// What this library was compiled for, so the caller can check it got the build it asked for.
extern "C" __attribute__((visibility("default"))) int rwkvx_simd_bytes() { return RWKVX_SIMD_BYTES; }
