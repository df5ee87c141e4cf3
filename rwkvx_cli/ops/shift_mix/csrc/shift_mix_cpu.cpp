// shift_mix forward and backward on the CPU: LayerNorm, token shift and M lerps, one pass over
// the rows. Memory-bound, so every input is read from memory once and every output written once
// per call: OpenMP threads take contiguous ranges of the B·T rows, and a row's few passes (its
// LayerNorm's sums, then the outputs) run on data already in L1.
//
// Layout: x, y_m, dy_m, dx, dx_add [B, T, C] contiguous; weight, bias [C]; mix an array of M
// pointers to the lerps' weights [C] each (the model's M parameters, or the rows of one [M, C]
// tensor), dmix [M, C];
// state, state_out and their gradients [B, C]; mean, rstd [B, T]. The M outputs and their
// gradients are arrays of M pointers (a null gradient is absent: zero); a null dstate_out or
// dx_add is zero too, and a null state is the zero state, whose gradient (dstate, null) is not
// written. starts [B, T] (bytes, 0 or 1; null: none) marks the rows where a document starts: their
// x̂[t-1] is 0, whatever the row before or the state holds (docs/operators.md#document-starts).
//
// Forward, per row: n = (x - mean) rstd (biased variance), x̂ = n w + b,
//   y_m = x̂ + (x̂[t-1] - x̂) mix_m   (x̂[-1] = state; x̂[t-1] = 0 where t starts a document),
//   state_out = x̂[T-1]
// Backward, per row, with S = Σ_m dy_m and P = Σ_m dy_m mix_m (P[T] = dstate_out; P[t] = 0 where
// t starts a document: nothing of row t reaches row t-1 or the state):
//   dx̂[t] = S[t] - P[t] + P[t+1]       dstate = P[0]       dmix_m += dy_m (x̂[t-1] - x̂)
//   dw += dx̂ n   db += dx̂   g = dx̂ w   dx = rstd (g - mean_C(g) - n mean_C(g n)) + dx_add
//
// Precision. The outputs that matter are near-cancelling differences of O(1) terms: y_m = x̂ +
// (x̂[t-1] - x̂) mix_m comes close to 0, and so does dx = rstd (g - mean(g) - n mean(g n)). An
// fp32 rounding of x̂ or dx̂ (a few 1e-8 absolute) is a large relative error there, so those two
// chains run in fp64 ("wide": one storage vector's lanes as doubles): the forward's row statistics,
// x̂ and the lerps, rounded once at the store; the backward's S, P (products of two fp32 values are
// exact in fp64), dx̂, g and dx, rounded once at the store. Everything else is fp32 (the storage
// precision), which costs no accuracy where nothing cancels: the backward's n (from the fp32 mean
// and 1/std the forward kept), x̂[t-1] - x̂ (only dmix reads it), and the sums into dmix, dweight
// and dbias. Those are summed per thread in fp32 over tiles of TILE rows (a row's additions are a
// load, an FMA and a store per vector, in L1), and each tile's sums are added into fp64 totals; the
// thread totals are added in thread order at the end, so the result depends on the thread count
// only through rounding, and is the same from run to run. For fp64 storage everything is fp64.
//
// The parameters are converted once per call: fp64 copies of weight, bias and mix (zero-padded to
// whole vectors) for the wide arithmetic. Row tails (C not a multiple of the vector) are loaded
// zero-filled and stored partially; every scratch row is padded, so it is read and written whole.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../csrc/simd.h"

#if defined(__SSE2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t GRAIN = 8192;  // elements per thread at least: a smaller share costs more to start than it saves
constexpr int TILE = 16;         // rows per fp32 partial sum of the parameter gradients

typedef simd::Vec<double>::type D;  // a native fp64 vector
constexpr int LD = simd::Vec<double>::L;

// K native fp64 vectors as one value: the lanes of one storage vector in fp64 (K = 2 for fp32
// storage, 1 for fp64). A struct of native vectors, not a vector type twice the native width: GCC
// keeps those in memory and moves them a quadword at a time.
template <int K>
struct Wide {
  D v[K];
  Wide& operator+=(Wide o) {
    for (int k = 0; k < K; k++) v[k] += o.v[k];
    return *this;
  }
};

template <int K>
inline Wide<K> operator+(Wide<K> a, Wide<K> b) {
  return a += b;
}
template <int K>
inline Wide<K> operator-(Wide<K> a, Wide<K> b) {
  for (int k = 0; k < K; k++) a.v[k] -= b.v[k];
  return a;
}
template <int K>
inline Wide<K> operator*(Wide<K> a, Wide<K> b) {
  for (int k = 0; k < K; k++) a.v[k] *= b.v[k];
  return a;
}
template <int K>
inline Wide<K> operator*(Wide<K> a, double s) {
  for (int k = 0; k < K; k++) a.v[k] *= s;
  return a;
}
template <int K>
inline Wide<K> operator+(Wide<K> a, double s) {
  for (int k = 0; k < K; k++) a.v[k] += s;
  return a;
}
template <int K>
inline Wide<K> operator-(Wide<K> a, double s) {
  for (int k = 0; k < K; k++) a.v[k] -= s;
  return a;
}

template <typename V>
struct is_wide : std::false_type {};
template <int K>
struct is_wide<Wide<K>> : std::true_type {};

// A storage vector (S, L lanes of F) and the same lanes in fp64 (W).
template <typename F>
struct Lanes {
  static constexpr int L = simd::Vec<F>::L;
  typedef typename simd::Vec<F>::type S;
  typedef Wide<L / LD> W;
};

// A row a storage vector at a time: body(c, n) for its whole vectors with n a compile-time L, then
// for its tail (C not a multiple of L) with n the number of lanes left. The loads and stores below
// take n: whole vectors for Full<L> (and for the scratch rows, padded to whole vectors), a tail's
// first n lanes (the rest zero on loads, untouched on stores) in a separate instance of the body,
// so the main loop never takes the tail's path through memory.
// (GCC may otherwise keep a large body out of line, its accumulators in memory.)
#define INLINE __attribute__((always_inline))

template <int N>
using Full = std::integral_constant<int, N>;

template <int L, typename Body>
INLINE inline void for_vectors(int C, Body&& body) {
  int c = 0;
  for (; c + L <= C; c += L) body(c, Full<L>{});
  if (c < C) body(c, C - c);
}

// Unaligned vector loads and stores as typed accesses: GCC lets a vector access alias only its
// element type, where a memcpy may alias anything, and would make the loops reload every pointer
// and count after each store.
typedef simd::Vec<float>::type FV;
typedef float FVu __attribute__((vector_size(sizeof(FV)), aligned(alignof(float))));
typedef double Du __attribute__((vector_size(sizeof(D)), aligned(alignof(double))));
inline FV loadv(const float* p) { return *reinterpret_cast<const FVu*>(p); }
inline D loadv(const double* p) { return *reinterpret_cast<const Du*>(p); }
inline void storev(float* p, FV v) { *reinterpret_cast<FVu*>(p) = v; }
inline void storev(double* p, D v) { *reinterpret_cast<Du*>(p) = v; }

template <typename V, typename T>
inline V load(const T* p) {
  if constexpr (is_wide<V>::value) {
    V v;
    for (int k = 0; k < (int)(sizeof(V) / sizeof(D)); k++) v.v[k] = loadv(p + k * LD);
    return v;
  } else {
    return loadv(p);
  }
}

template <typename V, typename T>
inline void store(T* p, V v) {
  if constexpr (is_wide<V>::value)
    for (int k = 0; k < (int)(sizeof(V) / sizeof(D)); k++) storev(p + k * LD, v.v[k]);
  else
    storev(p, v);
}

template <typename V, typename T, int N>
inline V load(const T* p, Full<N>) {
  return load<V>(p);
}

template <typename V, typename T, int N>
inline void store(T* p, V v, Full<N>) {
  store(p, v);
}

template <typename V, typename T>
inline V load(const T* p, int n) {
  V v = {};
  for (int l = 0; l < n; l++) v[l] = p[l];
  return v;
}

template <typename V, typename T>
inline void store(T* p, V v, int n) {
  for (int l = 0; l < n; l++) p[l] = v[l];
}

// fp32 <-> fp64, a storage vector at a time: x86 takes the instructions that convert a half (GCC 12
// lowers __builtin_convertvector from a half-width vector through the stack); elsewhere (NEON, the
// AVX-512 layout built for AVX2) the halves are shuffled out and converted.
typedef float FH __attribute__((vector_size(sizeof(FV) / 2)));

template <size_t... I>
inline FH low_half(FV x, std::index_sequence<I...>) {
  return __builtin_shufflevector(x, x, I...);
}
template <size_t... I>
inline FH high_half(FV x, std::index_sequence<I...>) {
  return __builtin_shufflevector(x, x, (I + sizeof...(I))...);
}
template <size_t... I>
inline FV join(FH lo, FH hi, std::index_sequence<I...>) {
  return __builtin_shufflevector(lo, hi, I...);
}

inline Wide<2> widen(FV x) {
  Wide<2> w;
#if defined(__AVX512F__) && RWKVX_SIMD_BYTES == 64
  const __m512 v = (__m512)x;
  w.v[0] = (D)_mm512_cvtps_pd(_mm512_castps512_ps256(v));
  w.v[1] = (D)_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
#elif defined(__AVX__) && RWKVX_SIMD_BYTES == 32
  const __m256 v = (__m256)x;
  w.v[0] = (D)_mm256_cvtps_pd(_mm256_castps256_ps128(v));
  w.v[1] = (D)_mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
#elif defined(__SSE2__) && RWKVX_SIMD_BYTES == 16
  const __m128 v = (__m128)x;
  w.v[0] = (D)_mm_cvtps_pd(v);
  w.v[1] = (D)_mm_cvtps_pd(_mm_movehl_ps(v, v));
#else
  constexpr auto half = std::make_index_sequence<LD>{};
  w.v[0] = __builtin_convertvector(low_half(x, half), D);
  w.v[1] = __builtin_convertvector(high_half(x, half), D);
#endif
  return w;
}

inline FV narrow(Wide<2> w) {
#if defined(__AVX512F__) && RWKVX_SIMD_BYTES == 64
  const __m256 lo = _mm512_cvtpd_ps((__m512d)w.v[0]), hi = _mm512_cvtpd_ps((__m512d)w.v[1]);
  return (FV)_mm512_castpd_ps(
      _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
#elif defined(__AVX__) && RWKVX_SIMD_BYTES == 32
  const __m128 lo = _mm256_cvtpd_ps((__m256d)w.v[0]), hi = _mm256_cvtpd_ps((__m256d)w.v[1]);
  return (FV)_mm256_insertf128_ps(_mm256_castps128_ps256(lo), hi, 1);
#elif defined(__SSE2__) && RWKVX_SIMD_BYTES == 16
  return (FV)_mm_movelh_ps(_mm_cvtpd_ps((__m128d)w.v[0]), _mm_cvtpd_ps((__m128d)w.v[1]));
#else
  return join(__builtin_convertvector(w.v[0], FH), __builtin_convertvector(w.v[1], FH),
              std::make_index_sequence<2 * LD>{});
#endif
}

// convert<To>(v): a storage vector to its wide form and back, or v itself.
template <typename To, typename From>
inline To convert(From v) {
  if constexpr (std::is_same_v<To, From>)
    return v;
  else if constexpr (std::is_same_v<From, FV>)
    return widen(v);
  else if constexpr (std::is_same_v<To, FV>)
    return narrow(v);
  else if constexpr (is_wide<To>::value)  // fp64 storage: one native vector
    return To{{v}};
  else
    return v.v[0];
}

// L values of p in fp64, loaded and converted by halves (one cvtps2pd from memory each, where a
// whole-vector load would take a load, an extract and two conversions); a tail converts its
// zero-filled vector.
template <typename T, typename N>
inline typename Lanes<T>::W load_wide(const T* p, N n) {
  typedef typename Lanes<T>::W W;
  constexpr bool whole = std::is_same_v<N, Full<Lanes<T>::L>>;
  if constexpr (std::is_same_v<T, float> && whole) {
    W w;
#if defined(__AVX512F__) && RWKVX_SIMD_BYTES == 64
    for (int k = 0; k < 2; k++) w.v[k] = (D)_mm512_cvtps_pd(_mm256_loadu_ps(p + 8 * k));
#elif defined(__AVX__) && RWKVX_SIMD_BYTES == 32
    for (int k = 0; k < 2; k++) w.v[k] = (D)_mm256_cvtps_pd(_mm_loadu_ps(p + 4 * k));
#elif defined(__SSE2__) && RWKVX_SIMD_BYTES == 16
    for (int k = 0; k < 2; k++)
      w.v[k] = (D)_mm_cvtps_pd(_mm_loadl_pi(_mm_setzero_ps(), reinterpret_cast<const __m64*>(p + 2 * k)));
#else
    w = widen(load<FV>(p));
#endif
    return w;
  } else {
    return convert<W>(load<typename Lanes<T>::S>(p, n));
  }
}

// The lanes' sum, as simd::hsum of one native vector.
template <int K>
inline double wide_sum(Wide<K> w) {
  for (int k = 1; k < K; k++) w.v[0] += w.v[k];
  return simd::hsum<double>(w.v[0]);
}

// body(std::integral_constant<int, M>{}) for M = 0 .. 8: the loops over the lerps unrolled, their
// pointers held in registers.
template <typename Body>
inline void with_mixes(int M, Body&& body) {
  switch (M) {
    case 0: return body(std::integral_constant<int, 0>{});
    case 1: return body(std::integral_constant<int, 1>{});
    case 2: return body(std::integral_constant<int, 2>{});
    case 3: return body(std::integral_constant<int, 3>{});
    case 4: return body(std::integral_constant<int, 4>{});
    case 5: return body(std::integral_constant<int, 5>{});
    case 6: return body(std::integral_constant<int, 6>{});
    case 7: return body(std::integral_constant<int, 7>{});
    default: return body(std::integral_constant<int, 8>{});
  }
}

inline int64_t round_up(int64_t n, int L) { return (n + L - 1) / L * L; }

// Rows [r0, r1) of thread i of nt: contiguous, in thread order, starting at a multiple of `align`.
inline void share(int64_t rows, int i, int nt, int64_t& r0, int64_t& r1, int64_t align = 1) {
  const auto start = [&](int j) { return j == nt ? rows : rows * j / nt / align * align; };
  r0 = start(i), r1 = start(i + 1);
}

inline int team(int threads, int64_t rows, int C) {
  const int64_t by_size = std::max<int64_t>(1, rows * C / GRAIN);
  return (int)std::max<int64_t>(1, std::min<int64_t>({(int64_t)threads, rows, by_size}));
}

// A thread's zeroed scratch of n values, allocated (so first written) by the thread itself and
// starting on a cache line pair of its own. Scratch that the calling thread zeroes for all of them
// (one array, a slice each) made two threads' backward 1.4x slower than their share of one's.
template <typename T>
class LocalScratch {
  static constexpr int64_t A = 128 / sizeof(T);  // two lines: the adjacent-line prefetcher fetches pairs
  std::vector<T> mem_;

 public:
  T* const data;
  explicit LocalScratch(int64_t n)
      : mem_((size_t)(n + A)),
        data(mem_.data() + (A - (int64_t)(reinterpret_cast<uintptr_t>(mem_.data()) % 128) / (int64_t)sizeof(T)) % A) {}
};

// n values of p, in fp64, into q (zero-padded to `padded`).
template <typename F>
inline void to_double(const F* p, int64_t n, int64_t padded, double* q) {
  std::copy(p, p + n, q);
  std::fill(q + n, q + padded, 0.0);
}

// The row's mean and 1/std in fp64, in one pass: the sums of d = x - x[0] and of d² (shifting by
// a value of the row keeps Σd² / C - (Σd / C)² from cancelling when the mean is large against
// the spread), in two chains of vectors.
template <typename F>
inline void row_stats(const F* x, int C, double eps, double& mean, double& rstd) {
  using K = Lanes<F>;
  typedef typename K::W W;
  const double k = x[0];
  W a0 = {}, a1 = {}, q0 = {}, q1 = {};  // named, not an array: an array would live on the stack
  int c = 0;
  for (; c + 2 * K::L <= C; c += 2 * K::L) {
    const W d0 = load_wide(x + c, Full<K::L>{}) - k, d1 = load_wide(x + c + K::L, Full<K::L>{}) - k;
    a0 += d0, q0 += d0 * d0, a1 += d1, q1 += d1 * d1;
  }
  if (c + K::L <= C) {
    const W d0 = load_wide(x + c, Full<K::L>{}) - k;
    a0 += d0, q0 += d0 * d0, c += K::L;
  }
  double a = wide_sum(a0 + a1), q = wide_sum(q0 + q1);
  for (; c < C; c++) {
    const double d = (double)x[c] - k;
    a += d, q += d * d;
  }
  const double m = a / C;
  mean = k + m;
  rstd = 1 / std::sqrt(std::max(q / C - m * m, 0.0) + eps);
}

// The forward of the rows a thread takes, in tiles of up to TILE rows: first the tile's row
// statistics (independent chains of dependent adds, a division and a square root per row, which
// overlap one another), then its outputs, the tile's x still in L1 or L2. The outputs are made R = 2
// rows at a time where the rows are consecutive steps of one sequence: the second row's x̂[t-1] is
// the first's x̂, in registers, so only every other row's x̂ goes through the fp64 row carried from
// one block to the next, and each load of a parameter vector serves two rows.
template <typename F>
struct Forward {
  using K = Lanes<F>;
  typedef typename K::S S;
  typedef typename K::W W;
  static constexpr int L = K::L;

  const F *x, *state;
  const uint8_t* starts;  // null: no document starts
  F* const* ys;
  F* state_out;
  const double *w64, *b64, *m64;  // fp64 parameters, padded rows of Cp
  int T, C;
  int64_t Cp;
  double eps;

  // x̂ of L values of row r from its statistics.
  template <typename N>
  W xhat(int64_t r, int c, N n, double rs, double shift) const {
    return (load_wide(x + r * C + c, n) * rs + shift) * load<W>(w64 + c) + load<W>(b64 + c);
  }

  // x̂ of row r into `prev` (the x̂[t-1] of a thread's first row, when it is not the state).
  void xhat_row(int64_t r, double* prev) const {
    double mu, rs;
    row_stats(x + r * C, C, eps, mu, rs);
    for_vectors<L>(C, [=](int c, auto n) INLINE { store(prev + c, xhat(r, c, n, rs, -mu * rs)); });
  }

  // Rows r .. r+R-1 of one sequence, their statistics mu, rs; prev holds x̂[r-1] and is left
  // holding x̂[r+R-1].
  template <int R, int M>
  void block(int64_t r, const double* mu, const double* rs, double* prev) const {
    double shift[R];
    for (int i = 0; i < R; i++) shift[i] = -mu[i] * rs[i];
    for_vectors<L>(C, [=](int c, auto n) INLINE {
      W xh[R], d[R];
      for (int i = 0; i < R; i++) xh[i] = xhat(r + i, c, n, rs[i], shift[i]);
      d[0] = load<W>(prev + c) - xh[0];
      for (int i = 1; i < R; i++) d[i] = xh[i - 1] - xh[i];
      store(prev + c, xh[R - 1]);
      // the M outputs' vectors, interleaved (the stores are what bounds the forward)
      for (int m = 0; m < M; m++) {
        const W mx = load<W>(m64 + m * Cp + c);
        for (int i = 0; i < R; i++) store(ys[m] + (r + i) * C + c, convert<S>(xh[i] + d[i] * mx), n);
      }
    });
  }

  template <int M>
  void rows(int64_t r0, int64_t r1, F* mean, F* rstd, double* prev) const {
    if (r0 < r1 && r0 % T) xhat_row(r0 - 1, prev);
    double mu[TILE], rs[TILE];
    for (int64_t r = r0; r < r1; r += TILE) {
      const int rows = (int)std::min<int64_t>(TILE, r1 - r);
      for (int j = 0; j < rows; j++) {
        row_stats(x + (r + j) * C, C, eps, mu[j], rs[j]);
        mean[r + j] = (F)mu[j], rstd[r + j] = (F)rs[j];
      }
      for (int j = 0; j < rows;) {
        const int64_t q = r + j, b = q / T, t = q % T;
        const bool start = starts && starts[q];
        if (!t || start) {
          if (state && !start)
            to_double(state + b * C, C, Cp, prev);
          else
            std::fill(prev, prev + Cp, 0.0);
        }
        // a pair's second row takes the first's x̂ as its x̂[t-1]: not where it starts a document
        const bool pair = j + 1 < rows && t + 1 < T && !(starts && starts[q + 1]);
        if (pair)
          block<2, M>(q, mu + j, rs + j, prev);
        else
          block<1, M>(q, mu + j, rs + j, prev);
        j += pair ? 2 : 1;
        if ((q % T) + (pair ? 1 : 0) == T - 1) std::copy(prev, prev + C, state_out + b * C);
      }
    }
  }
};

template <typename F>
void forward(const F* x, const F* weight, const F* bias, const F* const* mix, const F* state, const uint8_t* starts,
             F* const* ys, F* state_out, F* mean, F* rstd, int B, int T, int C, int M, int threads, double eps) {
  const int64_t rows = (int64_t)B * T;
  if (rows == 0 || C == 0) return;
  const int64_t Cp = round_up(C, Lanes<F>::L);
  std::vector<double> params((size_t)(M + 2) * Cp);  // weight, bias, mix_0 .. mix_{M-1}: fp64, padded rows
  double *w64 = params.data(), *b64 = w64 + Cp, *m64 = b64 + Cp;
  to_double(weight, C, Cp, w64), to_double(bias, C, Cp, b64);
  for (int m = 0; m < M; m++) to_double(mix[m], C, Cp, m64 + m * Cp);
  const int nt = team(threads, rows, C);
  const Forward<F> k{x, state, starts, ys, state_out, w64, b64, m64, T, C, Cp, eps};
#pragma omp parallel num_threads(nt)
  {
    const int i = omp_get_thread_num();
    int64_t r0, r1;
    share(rows, i, omp_get_num_threads(), r0, r1);
    LocalScratch<double> carried(Cp);  // x̂ of the row before
    with_mixes(M, [&](auto m) { k.template rows<m()>(r0, r1, mean, rstd, carried.data); });
  }
}

// The backward of the rows a thread takes, in ascending order (the order the hardware prefetchers
// follow best), in three stages a row apart:
//   lerps(q)   row q's own part of dx̂, S - P, and its P, the part row q-1's dx̂ lacks (at t = 0:
//              dstate); the fp32 sums into dmix
//   sums(q)    dx̂ = S - P + P[q+1] (dstate_out at t = T-1), g = dx̂ w, g's row sums; the fp64
//              sums into dweight and dbias
//   grad_x(q)  dx from g and its row sums
// Step j runs lerps(j), grad_x(j-2), sums(j-1): a row's sums (a chain of dependent adds along the
// row, then the divisions) have a row's lerps to overlap with before grad_x reads them.
//
// The lerps are the P of the M with a gradient (absent ones add nothing), and the per-lerp rows
// they read and write (mix, the dmix sums) are stored chunk-major: the P vectors of one chunk of
// L columns side by side, so one pointer walks them all.
template <typename F>
struct Backward {
  using K = Lanes<F>;
  typedef typename K::S S;
  typedef typename K::W W;
  static constexpr int L = K::L;

  const F* const* dys;  // the P present gradients
  const F *dstate_out, *x, *weight, *bias, *state, *mean, *rstd, *dx_add;
  const uint8_t* starts;  // null: no document starts
  const double* w64;  // fp64, padded
  const double* mix;  // the present lerps' mix in fp64, chunk-major
  F *dx, *dstate;
  int T, C;

  struct Scratch {      // a thread's
    F* dmix;            // the tile's fp32 sums into dmix, chunk-major
    double* dmix_sum;   // the thread's fp64 sums of those, chunk-major
    double *dw, *db;    // the thread's fp64 sums into dweight and dbias
    double *own[2], *next, *g[2];  // rows: S - P of the last two rows, P of the next, g of two
    double mg[2], mgn[2];          // g's row means: mean_C(g), mean_C(g n)
  };

  template <int P>
  void lerps(int64_t q, double* own, double* next, F* part) const {
    const int64_t b = q / T, t = q % T;
    const bool start = starts && starts[q];  // x̂[t-1] = 0; P goes nowhere
    const bool shifted = t && !start;         // x̂[t-1] is the row before's
    const F* xq = x + q * C;
    const F mu = mean[q], rs = rstd[q], mu_p = shifted ? mean[q - 1] : 0, rs_p = shifted ? rstd[q - 1] : 0;
    const F* dy[P ? P : 1];
    for (int p = 0; p < P; p++) dy[p] = dys[p] + q * C;
    for_vectors<L>(C, [=](int c, auto n) INLINE {
      const int64_t k = (int64_t)c * P;  // the chunk's P vectors in the chunk-major rows
      const S w = load<S>(weight + c, n), nc = (load<S>(xq + c, n) - mu) * rs;
      // x̂[t-1] - x̂ in fp32 (dmix alone reads it): the bias cancels but at t = 0, where x̂[t-1] is
      // the state (0 in the tail lanes), and at a document start, where it is 0
      const S d = shifted ? ((load<S>(xq - C + c, n) - mu_p) * rs_p - nc) * w
                          : (state && !t && !start ? load<S>(state + b * C + c, n) : S{}) -
                                (nc * w + load<S>(bias + c, n));
      W sum = {}, pm = {};
      for (int p = 0; p < P; p++) {
        const S g = load<S>(dy[p] + c, n);
        const W gw = load_wide(dy[p] + c, n);  // products of two fp32 values: exact in fp64
        sum += gw, pm += gw * load<W>(mix + k + p * L);
        F* dm = part + k + p * L;
        store(dm, load<S>(dm) + g * d);
      }
      store(own + c, sum - pm);
      if (start) pm = W{};
      if (t)
        store(next + c, pm);
      else if (dstate)
        store(dstate + b * C + c, convert<S>(pm), n);
    });
  }

  // Row q's P alone: the row after a thread's range, whose P the range's last row needs (0 where
  // row q starts a document).
  template <int P>
  void next_part(int64_t q, double* next) const {
    if (starts && starts[q]) {
      std::fill(next, next + round_up(C, L), 0.0);
      return;
    }
    for_vectors<L>(C, [=](int c, auto n) INLINE {
      W pm = {};
      for (int p = 0; p < P; p++)
        pm += load_wide(dys[p] + q * C + c, n) * load<W>(mix + (int64_t)c * P + p * L);
      store(next + c, pm);
    });
  }

  // nxt: the P row after (padded), or for the last row of a sequence (Last) dstate_out's row (null: 0).
  template <bool Last>
  void sums(int64_t q, const double* own, const std::conditional_t<Last, F, double>* nxt, Scratch& s) const {
    const F* xq = x + q * C;
    const double rs = rstd[q], shift = -(double)mean[q] * rs;
    double* g = s.g[q & 1];
    W sg = {}, sgn = {};
    for_vectors<L>(C, [&](int c, auto n) INLINE {
      const W nw = load_wide(xq + c, n) * rs + shift;
      W dxh = load<W>(own + c);
      if constexpr (!Last)
        dxh += load<W>(nxt + c);
      else if (nxt)
        dxh += load_wide(nxt + c, n);
      store(s.dw + c, load<W>(s.dw + c) + dxh * nw), store(s.db + c, load<W>(s.db + c) + dxh);
      const W gv = dxh * load<W>(w64 + c);  // 0 in the tail lanes (w64 is padded with 0)
      sg += gv, sgn += gv * nw;
      store(g + c, gv);
    });
    s.mg[q & 1] = wide_sum(sg) / C, s.mgn[q & 1] = wide_sum(sgn) / C;
  }

  // dx = rstd g - rstd (mean(g) + n mean(g n)), in fp64, rounded once (then dx_add added).
  void grad_x(int64_t q, const Scratch& s) const {
    const F* xq = x + q * C;
    const double rs = rstd[q], shift = -(double)mean[q] * rs;
    const double c0 = -rs * s.mg[q & 1], c1 = -rs * s.mgn[q & 1];
    const double* g = s.g[q & 1];
    const F* add = dx_add ? dx_add + q * C : nullptr;
    F* dxq = dx + q * C;
    for_vectors<L>(C, [=](int c, auto n) INLINE {
      const W nw = load_wide(xq + c, n) * rs + shift;
      S out = convert<S>(load<W>(g + c) * rs + (nw * c1 + c0));
      if (add) out += load<S>(add + c, n);
      store(dxq + c, out, n);
    });
  }

  // The tile's fp32 dmix sums into the thread's fp64 ones, and zeroed.
  static void flush(int64_t len, Scratch& s) {
    for (int64_t j = 0; j < len; j += L) {
      store(s.dmix_sum + j, load<W>(s.dmix_sum + j) + convert<W>(load<S>(s.dmix + j)));
      store(s.dmix + j, S{});
    }
  }

  template <int P>
  void rows(int64_t r0, int64_t r1, int64_t Cp, Scratch& s) const {
    for (int64_t j = r0; j <= r1 + 1; j++) {
      if (j < r1) {
        lerps<P>(j, s.own[j & 1], s.next, s.dmix);
        if (j % TILE == TILE - 1) flush(P * Cp, s);
      } else if (j == r1 && r1 % T) {  // row r1 continues row r1-1's sequence
        next_part<P>(r1, s.next);
      }
      if (j - 2 >= r0) grad_x(j - 2, s);
      if (j - 1 >= r0 && j - 1 < r1) {
        const int64_t q = j - 1;
        if (q % T == T - 1)
          sums<true>(q, s.own[q & 1], dstate_out ? dstate_out + q / T * C : nullptr, s);
        else
          sums<false>(q, s.own[q & 1], s.next, s);
      }
    }
    flush(P * Cp, s);
  }
};

template <typename F>
void backward(const F* const* dys, const F* dstate_out, const F* x, const F* weight, const F* bias, const F* const* mix,
              const F* state, const uint8_t* starts, const F* mean, const F* rstd, const F* dx_add, F* dx, F* dweight,
              F* dbias, F* dmix, F* dstate, int B, int T, int C, int M, int threads) {
  typedef Backward<F> Bk;
  constexpr int L = Bk::L;
  const int64_t rows = (int64_t)B * T;
  std::fill(dmix, dmix + (int64_t)M * C, F(0));  // absent lerps' stay 0
  if (rows == 0 || C == 0) {
    std::fill(dweight, dweight + C, F(0)), std::fill(dbias, dbias + C, F(0));
    if (dstate) std::fill(dstate, dstate + (int64_t)B * C, F(0));
    return;
  }
  int present[8], P = 0;  // the lerps with a gradient (M <= 8)
  const F* dyp[8];
  for (int m = 0; m < M; m++)
    if (dys[m]) dyp[P] = dys[m], present[P++] = m;
  const int64_t Cp = round_up(C, L), PC = P * Cp;
  // fp64 weight (padded) and the present lerps' mix (chunk-major: element c of lerp p at c P + p L
  // + c % L, with c rounded down to a multiple of L)
  std::vector<double> w64(Cp), mixc(std::max<int64_t>(PC, 1));
  to_double(weight, C, Cp, w64.data());
  for (int p = 0; p < P; p++)
    for (int c = 0; c < C; c++) mixc[(c - c % L) * P + p * L + c % L] = mix[present[p]][c];
  const int nt = team(threads, rows, C);
  const int64_t dstride = PC + 2 * Cp + 5 * Cp;  // per thread: dmix, dweight, dbias sums; five rows
  std::vector<double*> sums(nt);  // each thread's dmix, dweight and dbias sums, for the reduction
  const Bk k{dyp,    dstate_out, x,           weight,       bias, state, mean, rstd, dx_add,
             starts, w64.data(), mixc.data(), dx, dstate, T, C};
#pragma omp parallel num_threads(nt)
  {
    const int i = omp_get_thread_num(), used = omp_get_num_threads();
    int64_t r0, r1;
    share(rows, i, used, r0, r1, TILE);  // whole tiles: the same fp32 sums whatever the thread count
    LocalScratch<double> dscratch(dstride);  // zero: a thread that gets no rows adds nothing
    LocalScratch<F> fscratch(std::max<int64_t>(PC, 1));
    double* d = sums[i] = dscratch.data;
    typename Bk::Scratch s{fscratch.data, d, d + PC, d + PC + Cp,
                           {d + PC + 2 * Cp, d + PC + 3 * Cp}, d + PC + 4 * Cp, {d + PC + 5 * Cp, d + PC + 6 * Cp},
                           {0, 0}, {0, 0}};
    if (r0 < r1) with_mixes(P, [&](auto p) { k.template rows<p()>(r0, r1, Cp, s); });
#pragma omp barrier
    // the thread sums, added in thread order: the present lerps' dmix, then dweight and dbias
#pragma omp for schedule(static)
    for (int64_t j = 0; j < (P + 2) * (int64_t)C; j++) {
      const int64_t row = j / C, c = j % C;
      const int64_t at = row < P ? (c - c % L) * P + row * L + c % L : PC + (row - P) * Cp + c;
      double sum = sums[0][at];
      for (int q = 1; q < used; q++) sum += sums[q][at];
      (row < P ? dmix[(int64_t)present[row] * C + c] : row == P ? dweight[c] : dbias[c]) = (F)sum;
    }
  }
}

}  // namespace

extern "C" {

#define RWKVX_EXPORT(F, SUFFIX)                                                                                    \
  void shift_mix_forward_##SUFFIX(const F* x, const F* weight, const F* bias, const F* const* mix, const F* state,\
                                  const uint8_t* starts, F* const* ys, F* state_out, F* mean, F* rstd, int B,     \
                                  int T, int C, int M, int threads, double eps) {                                  \
    forward<F>(x, weight, bias, mix, state, starts, ys, state_out, mean, rstd, B, T, C, M, threads, eps);      \
  }                                                                                                                \
  void shift_mix_backward_##SUFFIX(const F* const* dys, const F* dstate_out, const F* x, const F* weight,        \
                                   const F* bias, const F* const* mix, const F* state, const uint8_t* starts,     \
                                   const F* mean, const F* rstd, const F* dx_add, F* dx, F* dweight, F* dbias,    \
                                   F* dmix, F* dstate, int B, int T, int C, int M, int threads) {                 \
    backward<F>(dys, dstate_out, x, weight, bias, mix, state, starts, mean, rstd, dx_add, dx, dweight, dbias,    \
                dmix, dstate, B, T, C, M, threads);                                                                \
  }

RWKVX_EXPORT_PRECISIONS
}
