// channel_mix's own elementwise kernel on the CPU: relu², forward and backward, one pass each
// (torch's composition takes two forward and three backward). The LayerNorm and token shift are
// shift_mix's kernel (ops/shift_mix/csrc), the matmuls torch's (ops/channel_mix/fused.py).
//
//   forward:   a = relu(h)²
//   backward:  dh = 2 sqrt(a) da      (relu(h) = sqrt(a): the gradient from the output, h not kept)
//
// Any shape, as rows × cols contiguous values (two ints keep the count past 2³¹ without an int64
// argument); OpenMP over contiguous ranges of at least GRAIN values.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "../../csrc/simd.h"

#if defined(__SSE2__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace {

using simd::Vec;

constexpr int64_t GRAIN = 32768;

template <typename F, typename Op>
void elementwise(int64_t n, int threads, Op op) {
  constexpr int L = Vec<F>::L;
  const int64_t blocks = (n + GRAIN - 1) / GRAIN;
  const int nt = (int)std::max<int64_t>(1, std::min<int64_t>(threads, blocks));
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t blk = 0; blk < blocks; blk++) {
    const int64_t i0 = blk * GRAIN, i1 = std::min(n, i0 + GRAIN);
    int64_t i = i0;
    for (; i + L <= i1; i += L) op(i, L);
    if (i < i1) op(i, (int)(i1 - i));
  }
}

template <typename F>
inline typename Vec<F>::type load(const F* p, int n) {
  typename Vec<F>::type x = {};
  if (n == Vec<F>::L)
    std::memcpy(&x, p, sizeof(x));
  else
    for (int l = 0; l < n; l++) x[l] = p[l];
  return x;
}

template <typename F>
inline void store(F* p, typename Vec<F>::type x, int n) {
  if (n == Vec<F>::L)
    std::memcpy(p, &x, sizeof(x));
  else
    for (int l = 0; l < n; l++) p[l] = x[l];
}

// √x lane by lane in the build's own instruction: GCC vectorises no sqrt call without
// -fno-math-errno (a negative argument would set errno), which the shared flags leave out.
template <typename F>
inline typename Vec<F>::type vsqrt(typename Vec<F>::type x) {
  constexpr bool f32 = sizeof(F) == 4;
#if defined(__AVX512F__) && RWKVX_SIMD_BYTES == 64
  if constexpr (f32)
    return (typename Vec<F>::type)_mm512_sqrt_ps((__m512)x);
  else
    return (typename Vec<F>::type)_mm512_sqrt_pd((__m512d)x);
#elif defined(__AVX__) || defined(__SSE2__) || defined(__aarch64__)
#if defined(__AVX__)
  constexpr int P = 32;  // bytes per instruction (the AVX-512 layout on AVX2: two)
#else
  constexpr int P = 16;
#endif
  static_assert(sizeof(x) % P == 0, "a vector is whole instructions wide");
  for (size_t o = 0; o < sizeof(x); o += P) {
    char* p = reinterpret_cast<char*>(&x) + o;
#if defined(__AVX__)
    if constexpr (f32)
      _mm256_storeu_ps((float*)p, _mm256_sqrt_ps(_mm256_loadu_ps((const float*)p)));
    else
      _mm256_storeu_pd((double*)p, _mm256_sqrt_pd(_mm256_loadu_pd((const double*)p)));
#elif defined(__SSE2__)
    if constexpr (f32)
      _mm_storeu_ps((float*)p, _mm_sqrt_ps(_mm_loadu_ps((const float*)p)));
    else
      _mm_storeu_pd((double*)p, _mm_sqrt_pd(_mm_loadu_pd((const double*)p)));
#else
    if constexpr (f32)
      vst1q_f32((float*)p, vsqrtq_f32(vld1q_f32((const float*)p)));
    else
      vst1q_f64((double*)p, vsqrtq_f64(vld1q_f64((const double*)p)));
#endif
  }
  return x;
#else
  for (int l = 0; l < Vec<F>::L; l++) x[l] = std::sqrt(x[l]);
  return x;
#endif
}

template <typename F>
void forward(const F* h, F* a, int64_t n, int threads) {
  typedef typename Vec<F>::type V;
  elementwise<F>(n, threads, [=](int64_t i, int k) {
    V x = load(h + i, k);
    x = x < 0 ? V{} : x;  // relu, a NaN kept as torch.relu keeps it
    store(a + i, x * x, k);
  });
}

template <typename F>
void backward(const F* da, const F* a, F* dh, int64_t n, int threads) {
  typedef typename Vec<F>::type V;
  elementwise<F>(n, threads, [=](int64_t i, int k) {
    store(dh + i, 2 * vsqrt<F>(load(a + i, k)) * load(da + i, k), k);
  });
}

}  // namespace

extern "C" {

#define RWKVX_EXPORT(F, SUFFIX)                                                                           \
  void channel_mix_forward_##SUFFIX(const F* h, F* a, int rows, int cols, int threads) {                \
    forward<F>(h, a, (int64_t)rows * cols, threads);                                                      \
  }                                                                                                       \
  void channel_mix_backward_##SUFFIX(const F* da, const F* a, F* dh, int rows, int cols, int threads) { \
    backward<F>(da, a, dh, (int64_t)rows * cols, threads);                                                \
  }

RWKVX_EXPORT_PRECISIONS
}
