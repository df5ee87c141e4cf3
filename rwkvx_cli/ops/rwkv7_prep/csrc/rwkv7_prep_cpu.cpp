// rwkv7_prep forward and backward on the CPU: RWKV-7's elementwise work between the time mix's
// matmuls and wkv7, one pass over each tensor. OpenMP over ranges of the B·T rows; each row's H
// heads of N channels in SIMD vectors (any N: a partial last vector is loaded zero-filled and
// stored lane by lane).
//
// Layout: the sequence tensors [rows, C] contiguous (rows = B·T, C = H·N), the parameters [C].
// Per head, with σ the logistic function and x = k ⊙ k_k (see ../__init__.py):
//   w = -e^{-1/2} σ(w0 + w_lora)    ag = σ(a0 + a_lora)    k' = k ⊙ (1 + (ag - 1) ⊙ k_a)
//   v' = v + (v_first - v) ⊙ σ(v0 + v_lora)                 (first layer: v' = v, not written)
//   kk = x / max(|x|, 1e-12)    a = -kk    b = kk ⊙ ag    s = Σ r ⊙ k' ⊙ r_k    bonus = s v'
// Each head takes four sweeps of its channels: w; v'; ag, k', x and the head's two sums (leaving x
// and ag in the a and b rows); a, b and the bonus, which depend on the sums. A sweep reads back
// only what an earlier one left in L1, so every tensor crosses memory once.
//
// Backward (one row and head; dX is the cotangent, any of them may be absent = zero):
//   dkk = -da + db ag                  dag = db kk                        ds = Σ dbonus ⊙ v'
//   dx = dkk / n - x (x · dkk) / n³    with n = |x| (dx = dkk / 1e-12 where n <= 1e-12: the clamp)
//   dk'' = dk' + ds r ⊙ r_k            dr = ds k' ⊙ r_k (+ dr_add)        dr_k += ds r ⊙ k'
//   dk = dx ⊙ k_k + dk'' ⊙ (1 + (ag - 1) ⊙ k_a)     dk_k += dx ⊙ k      dk_a += dk'' ⊙ k ⊙ (ag - 1)
//   dag += dk'' ⊙ k ⊙ k_a              da_lora = da0 terms = dag ag (1 - ag)
//   dw_lora = dw0 terms = -e^{-1/2} dw σ (1 - σ), σ = -e^{1/2} w: the backward takes the forward's
//             output w in place of w_lora (saved by wkv7 anyway, where w_lora would be kept for this
//             op alone) and reads σ off it with one multiplication
//   dv'' = dv' + dbonus s              dv = dv'' (1 - sv)     dv_first = dv'' sv
//   dv_lora = dv0 terms = dv'' ⊙ (v_first - v) sv (1 - sv),   sv = σ(v0 + v_lora)
// In the first layer dv = dbonus s: v' is v itself, so its own cotangent reaches v outside.
// Each head takes five sweeps: the w path; sv and the sum ds (sv left in the dv_lora row); ag and
// the sums |x|², x · dkk and s (ag left in the da_lora row); the k, a and b paths; the v path. The
// later sweeps read ag and sv back and overwrite them. The parameter gradients (sums over the
// rows) go to per-thread fp32 partials, added into per-thread fp64 totals every kBlock rows and
// summed over the threads in order: deterministic for a given thread count.
//
// Speed. The arithmetic is mostly the three logistics per element (forward and backward both
// compute them, the backward from the inputs), so σ is one exp and one division with no selects
// (logistic below). A head is split into sweeps that each touch a few streams because one loop
// over all of them (19 forward, 32 backward with the partials' six rows) needs more pointers and
// vectors than x86-64 has registers, and spilled them on every vector. The sweeps are plain loops
// over a row's pointers held in locals: the tensors' pointers reach an OpenMP region as addresses
// of shared variables, and stores through a char type (memcpy) may alias them, which made GCC
// reload every pointer through its address on every vector and keep the sums on the stack. Loads
// and stores go through a vector type of the element's alignment instead, which aliases only F.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "../../csrc/simd.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#elif defined(__ARM_NEON)
#include <arm_neon.h>
#endif

namespace {

using simd::Vec;

template <typename F>
using V = typename Vec<F>::type;

// A vector at any F-aligned address: loads and stores through it alias F only (GCC treats a
// vector as its elements), where memcpy's alias everything.
template <typename F>
struct Unaligned {
  typedef F type __attribute__((vector_size(simd::kBytes), aligned(alignof(F))));
};

constexpr double kDecayScale = 0.60653065971263342360;  // e^{-1/2}
constexpr double kNormEps = 1e-12;                         // F.normalize's
constexpr int kBlock = 64;                                 // rows per fp32 partial sum

// The first n lanes (n > 0); the rest of a partial vector is zero. The partial vector has a path
// of its own: one shared with the full load would keep every loaded vector on the stack.
template <typename F>
inline V<F> ld(const F* p, int n) {
  if (n >= Vec<F>::L) return *reinterpret_cast<const typename Unaligned<F>::type*>(p);
  V<F> x = {};
  for (int l = 0; l < n; l++) x[l] = p[l];
  return x;
}

// A cotangent: where autograd gave none (p null), zeros. `dense` (every cotangent given, the
// model's case) is compiled apart, without the tests.
template <bool dense, typename F>
inline V<F> ld0(const F* p, int64_t o, int n) {
  if constexpr (dense) return ld(p + o, n);
  return p ? ld(p + o, n) : V<F>{};
}

template <typename F>
inline void st(F* p, V<F> x, int n) {
  if (n >= Vec<F>::L) {
    *reinterpret_cast<typename Unaligned<F>::type*>(p) = x;
    return;
  }
  for (int l = 0; l < n; l++) p[l] = x[l];
}

template <typename F>
inline void add(F* p, V<F> x, int n) {
  st(p, ld(p, n) + x, n);
}

// f(i, n) over a head's N channels, L at a time: the whole vectors with n = L, so that their code
// (f is inlined at both calls) has no partial-vector paths, then the partial one if any.
#define RWKVX_INLINE __attribute__((always_inline))
template <int L, typename Fn>
RWKVX_INLINE inline void sweep(int N, Fn&& f) {
  int i = 0;
  for (; i + L <= N; i += L) f(i, L);
  if (i < N) f(i, N - i);
}

// z clamped to [lo, hi], NaN kept: one max and one min instruction where the vector is one
// register (GCC spells the portable select as a compare and a blend each).
inline Vec<float>::type clamp(Vec<float>::type z, float lo, float hi) {
  typedef Vec<float>::type Vt;
#if defined(__AVX512F__) && RWKVX_SIMD_BYTES == 64
  return (Vt)_mm512_min_ps(_mm512_set1_ps(hi), _mm512_max_ps(_mm512_set1_ps(lo), (__m512)z));  // NaN: the 2nd operand
#elif defined(__AVX__) && RWKVX_SIMD_BYTES == 32
  return (Vt)_mm256_min_ps(_mm256_set1_ps(hi), _mm256_max_ps(_mm256_set1_ps(lo), (__m256)z));
#elif defined(__SSE__) && RWKVX_SIMD_BYTES == 16
  return (Vt)_mm_min_ps(_mm_set1_ps(hi), _mm_max_ps(_mm_set1_ps(lo), (__m128)z));
#elif defined(__ARM_NEON) && RWKVX_SIMD_BYTES == 16
  return (Vt)vminq_f32(vdupq_n_f32(hi), vmaxq_f32(vdupq_n_f32(lo), (float32x4_t)z));  // NaN in, NaN out
#else
  z = z < lo ? Vt{} + lo : z;
  return z > hi ? Vt{} + hi : z;
#endif
}

// σ(z) = 1 / (1 + e^{-z}) in fp32, in one branch-free expression. e^{-z} = 2^n e^r with
// n = round(-z log2 e) and r = -z - n ln2 (Cody-Waite: ln2 in two parts, so r is exact to fp32
// rounding for |n| <= 127), e^r a degree-6 polynomial, minimax for relative error on
// |r| <= ln2/2 with 1 + r fixed (under 1 ulp); n is rounded by adding 1.5 * 2^23 + 127, whose
// low mantissa bits then hold n + 127, the exponent field of 2^n. z is clamped to [-88, 87],
// where 2^n stays a normal number and e^{-z} finite: σ is then within 1e-38 of 0 or 1 ulp of 1,
// as it is beyond. The division is correctly rounded; in all σ is within 2.5 ulp over the fp32
// range. (Cephes' expf of -|z| and a select between the two halves of σ, the previous version,
// took twice the instructions.) NaN stays NaN.
inline Vec<float>::type logistic(Vec<float>::type z) {
  typedef Vec<float>::type Vt;
  typedef int32_t Vi __attribute__((vector_size(sizeof(Vt))));
  z = clamp(z, -88.0f, 87.0f);
  const Vt shift = Vt{} + (12582912.0f + 127.0f);  // 1.5 * 2^23 + 127
  const Vt t = shift - z * 1.44269504088896341f;    // n + 127 in the low bits
  const Vt n = t - shift;
  const Vt u = (z + n * 0.693359375f) - n * 2.12194440e-4f;  // u = -r = z + n (ln2_hi + ln2_lo)
  // e^r = e^{-u}: the polynomial's odd coefficients negated
  Vt p = 1.38131122e-3f * u - 8.36941227e-3f;
  p = p * u + 4.16684560e-2f;
  p = p * u - 1.66665152e-1f;
  p = p * u + 4.99999940e-1f;
  p = p * u - 1.0f;
  p = p * u + 1.0f;  // Horner: Estrin's shorter chain measured no faster here, and lost 0.7 ulp
  const Vt scale = (Vt)((Vi)t << 23);  // 2^n: n + 127 into the exponent field, the rest shifted out
  return 1.0f / (1.0f + p * scale);
}

// fp64 (the gradient checks): lane by lane with the C library (e^{-z} = inf gives 0).
inline Vec<double>::type logistic(Vec<double>::type z) {
  for (int l = 0; l < Vec<double>::L; l++) z[l] = 1 / (1 + std::exp(-z[l]));
  return z;
}

// The kernels' tensors: the inputs, then the forward's outputs or the backward's cotangents and
// gradients (see the extern "C" entry points). A row's kernel copies the pointers it needs into
// locals, offset to the row.
template <typename F>
struct Tensors {
  const F *r, *k, *v, *wl, *al, *vf, *vl;  // [rows, C]
  const F *w0, *a0, *v0, *kk, *ka, *rk;     // [C]
};

template <typename F>
struct Outputs {
  F *w, *ko, *vo, *a, *b, *bonus;
};

// One row of the forward, head by head, in four sweeps of a head's channels that each touch only
// the tensors of one part of the math: a loop over all 19 streams would need more pointers and
// vectors than there are registers, and spill them on every vector. The first layer's code
// (residual false) is compiled apart.
template <typename F, bool residual>
RWKVX_INLINE inline void forward_row(const Tensors<F>& in, const Outputs<F>& out, int64_t row, int H, int N) {
  typedef V<F> Vt;
  constexpr int L = Vec<F>::L;
  const int64_t off = row * H * N;
  const F *r = in.r + off, *k = in.k + off, *v = in.v + off, *wl = in.wl + off, *al = in.al + off;
  const F *vf = in.vf + off, *vl = in.vl + off;
  F *w = out.w + off, *ko = out.ko + off, *vo = out.vo + off, *a = out.a + off, *b = out.b + off;
  F* bonus = out.bonus + off;
  const F* vp = residual ? vo : v;  // v', read back by the last sweep
  const F dec = F(kDecayScale);
  for (int h = 0; h < H; h++) {
    const int c = h * N;  // the head's first channel, and its offset in the row
    sweep<L>(N, [&](int i, int n) RWKVX_INLINE {
      st(w + c + i, -dec * logistic(ld(in.w0 + c + i, n) + ld(wl + c + i, n)), n);
    });
    if constexpr (residual) {
      sweep<L>(N, [&](int i, int n) RWKVX_INLINE {
        const int o = c + i;
        const Vt vt = ld(v + o, n), sv = logistic(ld(in.v0 + o, n) + ld(vl + o, n));
        st(vo + o, vt + (ld(vf + o, n) - vt) * sv, n);
      });
    }
    Vt sxx = {}, srk = {};
    sweep<L>(N, [&](int i, int n) RWKVX_INLINE {
      const int o = c + i;
      const Vt ag = logistic(ld(in.a0 + o, n) + ld(al + o, n));
      const Vt kt = ld(k + o, n), x = kt * ld(in.kk + o, n);
      const Vt kn = kt * (1 + (ag - 1) * ld(in.ka + o, n));
      sxx += x * x;
      srk += ld(r + o, n) * kn * ld(in.rk + o, n);
      st(ko + o, kn, n);
      st(a + o, x, n), st(b + o, ag, n);  // x and ag, for the last sweep
    });
    const F inv = F(1) / std::max(std::sqrt(simd::hsum<F>(sxx)), F(kNormEps)), s = simd::hsum<F>(srk);
    sweep<L>(N, [&](int i, int n) RWKVX_INLINE {
      const int o = c + i;
      const Vt kkv = ld(a + o, n) * inv, ag = ld(b + o, n), vt = ld(vp + o, n);
      st(a + o, -kkv, n), st(b + o, kkv * ag, n);
      st(bonus + o, s * vt, n);
    });
  }
}

template <typename F, bool residual>
void forward(const Tensors<F> in, const Outputs<F> out, int64_t rows, int H, int N, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t row = 0; row < rows; row++) forward_row<F, residual>(in, out, row, H, N);
}

// The cotangents of (w, k', v', a, b, bonus), null where absent; dra, a gradient added into dr
// (null: none: r's gradient from its other consumer, wkv7, when the op passes r on); and the
// gradients of the sequence inputs (those of v_first and v_lora unused in the first layer).
template <typename F>
struct Cotangents {
  const F *dw, *dko, *dvo, *da, *db, *dbo, *dra;
};

template <typename F>
struct Grads {
  F *dr, *dk, *dv, *dwl, *dal, *dvf, *dvl;
};

// The parameter gradients' partial sums, one vector of each of the P parameters per vector of a
// head's channels: [H][NV][P][L] with NV = ceil(N / L), so that one pointer and constant offsets
// reach all six (six [C] rows would take six registers). A partial vector's padding lanes collect
// whatever its zero-filled lanes produce, and are never read out.
enum { W0, A0, V0, KK, KA, RK, P };

template <typename F>
inline void acc(F* p, V<F> x) {
  typedef typename Unaligned<F>::type U;
  *reinterpret_cast<U*>(p) += x;
}

// One row of the backward, head by head, in five sweeps of the head's channels (as the forward:
// each touches a few streams): the w path; the value residual's σ and the sum ds; kk's and the
// bonus's sums; the k, a and b paths; the v path. Where a sweep needs what an earlier one left
// (ag, sv), it reads it back from the gradient row it will overwrite, still in L1.
template <typename F, bool residual, bool dense>
RWKVX_INLINE inline void backward_row(const Tensors<F>& in, const Cotangents<F>& d, const Grads<F>& g, F* part,
                                      int64_t row, int H, int N) {
  typedef V<F> Vt;
  constexpr int L = Vec<F>::L;
  const int C = H * N, NV = (N + L - 1) / L;
  const int64_t off = row * C;
  const F *r = in.r + off, *k = in.k + off, *v = in.v + off, *wl = in.wl + off, *al = in.al + off;
  const F *vf = in.vf + off, *vl = in.vl + off;
  auto at = [off](const F* p) { return p ? p + off : p; };  // an absent cotangent stays null: zeros
  const F *dw = at(d.dw), *dko = at(d.dko), *dvo = at(d.dvo), *da = at(d.da), *db = at(d.db), *dbo = at(d.dbo);
  const F* dra = at(d.dra);
  F *dr = g.dr + off, *dk = g.dk + off, *dv = g.dv + off, *dwl = g.dwl + off, *dal = g.dal + off;
  F *dvf = g.dvf + off, *dvl = g.dvl + off;
  const F dec = F(kDecayScale);
  for (int h = 0; h < H; h++) {
    const int c = h * N;                     // the head's first channel, and its offset in the row
    F* const ph = part + (size_t)h * NV * P * L;  // the head's partials; vector i's at ph + (i / L) P L
    sweep<L>(N, [&](int i, int n) RWKVX_INLINE {
      const int o = c + i;
      const Vt sw = ld(wl + o, n) * F(-1 / kDecayScale);  // σ(w0 + w_lora) = -e^{1/2} w
      const Vt dzw = -dec * ld0<dense>(dw, o, n) * sw * (1 - sw);
      st(dwl + o, dzw, n), acc(ph + i * P + W0 * L, dzw);
    });
    Vt sdb = {};  // ds = Σ dbonus ⊙ v'
    if (dense || dbo) {
      sweep<L>(N, [&](int i, int n) RWKVX_INLINE {
        const int o = c + i;
        Vt vp = ld(v + o, n);
        if constexpr (residual) {
          const Vt sv = logistic(ld(in.v0 + o, n) + ld(vl + o, n));
          vp += (ld(vf + o, n) - vp) * sv;
          st(dvl + o, sv, n);  // sv, for the v path
        }
        sdb += ld(dbo + o, n) * vp;
      });
    } else if constexpr (residual) {
      sweep<L>(N, [&](int i, int n) RWKVX_INLINE {
        const int o = c + i;
        st(dvl + o, logistic(ld(in.v0 + o, n) + ld(vl + o, n)), n);
      });
    }
    Vt sxx = {}, sxd = {}, srk = {};
    sweep<L>(N, [&](int i, int n) RWKVX_INLINE {
      const int o = c + i;
      const Vt ag = logistic(ld(in.a0 + o, n) + ld(al + o, n));
      const Vt kt = ld(k + o, n), x = kt * ld(in.kk + o, n);
      sxx += x * x;
      sxd += x * (ld0<dense>(db, o, n) * ag - ld0<dense>(da, o, n));
      srk += ld(r + o, n) * kt * (1 + (ag - 1) * ld(in.ka + o, n)) * ld(in.rk + o, n);
      st(dal + o, ag, n);  // ag, for the k path
    });
    const F nrm = std::sqrt(simd::hsum<F>(sxx)), inv = F(1) / std::max(nrm, F(kNormEps));
    const F q = nrm > F(kNormEps) ? inv * inv * inv * simd::hsum<F>(sxd) : F(0);
    const F s = simd::hsum<F>(srk), ds = simd::hsum<F>(sdb);
    sweep<L>(N, [&](int i, int n) RWKVX_INLINE {
      const int o = c + i;
      F* const pp = ph + i * P;
      const Vt ag = ld(dal + o, n), kt = ld(k + o, n), rt = ld(r + o, n);
      const Vt kkc = ld(in.kk + o, n), kac = ld(in.ka + o, n), rkc = ld(in.rk + o, n);
      const Vt dbv = ld0<dense>(db, o, n), x = kt * kkc, dkkv = dbv * ag - ld0<dense>(da, o, n);
      const Vt dx = inv * dkkv - q * x;
      const Vt f = 1 + (ag - 1) * kac, kn = kt * f;
      const Vt dkn = ld0<dense>(dko, o, n) + ds * rt * rkc;
      const Vt dag = dbv * x * inv + dkn * kt * kac, dza = dag * ag * (1 - ag);
      st(dr + o, ds * kn * rkc + (dra ? ld(dra + o, n) : Vt{}), n);
      st(dk + o, dx * kkc + dkn * f, n), st(dal + o, dza, n);
      acc(pp + KK * L, dx * kt), acc(pp + RK * L, ds * rt * kn), acc(pp + KA * L, dkn * kt * (ag - 1));
      acc(pp + A0 * L, dza);
    });
    sweep<L>(N, [&](int i, int n) RWKVX_INLINE {
      const int o = c + i;
      const Vt dvp = (residual ? ld0<dense>(dvo, o, n) : Vt{}) + ld0<dense>(dbo, o, n) * s;
      if constexpr (residual) {
        const Vt sv = ld(dvl + o, n), vt = ld(v + o, n), dzv = dvp * (ld(vf + o, n) - vt) * sv * (1 - sv);
        st(dv + o, dvp * (1 - sv), n), st(dvf + o, dvp * sv, n), st(dvl + o, dzv, n);
        acc(ph + i * P + V0 * L, dzv);
      } else {
        st(dv + o, dvp, n);
      }
    });
  }
}

// The parameter gradients' sums over rows: each thread's range of rows adds into its fp32 partials
// (layout above), those into its fp64 totals every kBlock rows, and the totals over the threads in
// order make grads[p] (nullptr: not wanted).
template <typename F, bool residual, bool dense>
void backward(const Tensors<F> in, const Cotangents<F> d, const Grads<F> g, F* dw0, F* da0, F* dv0, F* dkk, F* dka,
              F* drk, int64_t rows, int H, int N, int threads) {
  constexpr int L = Vec<F>::L;
  const int NV = (N + L - 1) / L;
  const size_t size = (size_t)H * NV * P * L;
  std::vector<double> totals(threads * size, 0.0);
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num(), nt = omp_get_num_threads();
    const int64_t lo = rows * t / nt, hi = rows * (t + 1) / nt;
    std::vector<V<F>> part(size / L, V<F>{});  // vector-aligned
    F* const pf = reinterpret_cast<F*>(part.data());
    double* mine = totals.data() + t * size;
    for (int64_t r0 = lo; r0 < hi; r0 += kBlock) {
      for (int64_t row = r0; row < std::min(hi, r0 + kBlock); row++)
        backward_row<F, residual, dense>(in, d, g, pf, row, H, N);
      for (size_t j = 0; j < size; j++) mine[j] += pf[j], pf[j] = F(0);
    }
  }
  F* const grads[P] = {dw0, da0, residual ? dv0 : nullptr, dkk, dka, drk};
  for (int p = 0; p < P; p++) {
    if (!grads[p]) continue;
    for (int h = 0; h < H; h++)
      for (int i = 0; i < N; i++) {
        const size_t j = (((size_t)h * NV + i / L) * P + p) * L + i % L;
        double s = 0;
        for (int t = 0; t < threads; t++) s += totals[t * size + j];
        grads[p][h * N + i] = F(s);
      }
  }
}

}  // namespace

extern "C" {

// present: bit i set when cotangent i of (dw, dk', dv', da, db, dbonus) is given; an absent one is
// zero (its pointer is never read). dra: added into dr (null: nothing). residual = 0 (the first
// layer): v_first, v_lora, v0, v', the cotangent of v' and their gradients are not read or written.
#define RWKVX_EXPORT(F, SUFFIX)                                                                                    \
  void rwkv7_prep_forward_##SUFFIX(const F* r, const F* k, const F* v, const F* wl, const F* al, const F* vf,     \
                                   const F* vl, const F* w0, const F* a0, const F* v0, const F* kk, const F* ka,   \
                                   const F* rk, F* w, F* ko, F* vo, F* a, F* b, F* bonus, int rows, int H, int N,  \
                                   int residual, int threads) {                                                    \
    const Tensors<F> in = {r, k, v, wl, al, vf, vl, w0, a0, v0, kk, ka, rk};                                       \
    const Outputs<F> out = {w, ko, vo, a, b, bonus};                                                               \
    (residual ? forward<F, true> : forward<F, false>)(in, out, rows, H, N, threads);                               \
  }                                                                                                                \
  void rwkv7_prep_backward_##SUFFIX(                                                                               \
      const F* r, const F* k, const F* v, const F* wl, const F* al, const F* vf, const F* vl, const F* w0,         \
      const F* a0, const F* v0, const F* kk, const F* ka, const F* rk, const F* dw, const F* dko, const F* dvo,    \
      const F* da, const F* db, const F* dbo, const F* dra, F* dr, F* dk, F* dv, F* dwl, F* dal, F* dvf, F* dvl,   \
      F* dw0, F* da0,                                                                                              \
      F* dv0, F* dkk, F* dka, F* drk, int rows, int H, int N, int residual, int present, int threads) {            \
    const F* c[6] = {dw, dko, dvo, da, db, dbo};                                                                   \
    for (int i = 0; i < 6; i++)                                                                                    \
      if (!(present >> i & 1)) c[i] = nullptr;                                                                     \
    const bool dense = (present | (residual ? 0 : 4)) == 63;                                                       \
    const Tensors<F> in = {r, k, v, wl, al, vf, vl, w0, a0, v0, kk, ka, rk};                                       \
    const Cotangents<F> d = {c[0], c[1], c[2], c[3], c[4], c[5], dra};                                             \
    const Grads<F> g = {dr, dk, dv, dwl, dal, dvf, dvl};                                                           \
    auto fn = residual ? (dense ? backward<F, true, true> : backward<F, true, false>)                              \
                       : (dense ? backward<F, false, true> : backward<F, false, false>);                           \
    fn(in, d, g, dw0, da0, dv0, dkk, dka, drk, rows, H, N, threads);                                               \
  }

RWKVX_EXPORT_PRECISIONS
}
