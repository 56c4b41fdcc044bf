// Adam/AdamW over flat CPU tensors in one streaming pass, loaded by infinity/_cpu_adam_ext.py.
//
// Plain C ABI (no torch or pybind11 headers): it compiles in about a second with g++, is loaded with
// ctypes (which releases the GIL for the whole call), and does not depend on torch's C++ ABI.
//
// Per element, in one pass: read grad (fp32/bf16/fp16), scale it, apply L2 or decoupled weight decay,
// update the moments (fp32, or bf16 written with stochastic rounding), update the fp32 master, and
// write the low-precision copy-out (bf16/fp16, round to nearest even, like torch's .to()).
// Memory-bound: every stream is touched exactly once, so nothing needs re-reading from DRAM.
//
// Threads: a small persistent pool (the caller is worker 0), not OpenMP, so that this library does
// not bring a second OpenMP runtime into a process that already has torch's, and so that idle
// helpers sleep instead of spinning on the two cores the I/O threads also need.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>
#include <unistd.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && !defined(INFINITY_FORCE_SCALAR)
#define INFINITY_AVX512 1
#include <immintrin.h>
#endif

namespace {

enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2, kNone = 3 };

struct bf16_t { uint16_t x; };
struct f16_t { uint16_t x; };
struct no_out_t { uint16_t x; };

}  // namespace

extern "C" {
// Mirrored by _AdamHyper in infinity/_cpu_adam_ext.py: keep the field order and types in sync.
struct InfinityAdamHyper {
  float beta1, beta2, one_minus_beta1, one_minus_beta2;
  float eps, step_size, bc2_sqrt, decay, l2, grad_scale;
  uint32_t seed;  // stochastic-rounding stream of this step (bf16 moments only)
  int32_t flags;  // bit 0: decoupled decay (param *= decay); bit 1: L2 (grad += l2 * param);
                  // bit 2: streaming stores for `out` (set by infinity_adam_step itself)
};
}

namespace {

// ---------------------------------------------------------------- thread pool
// Work is handed out in chunks from a shared counter rather than split statically, so a helper
// that the OS has descheduled (the cores are shared with I/O threads and other processes) delays
// the step by at most one chunk: the caller takes over the rest, and never waits for a helper
// that has not started.
class Pool {
 public:
  // Runs fn(t) on the caller (t = 0) and on up to n - 1 helpers (t = 1..n-1) that join while the
  // job is open; fn must claim its own work. A second caller arriving while the pool is busy
  // (another Python thread) runs fn(0) alone instead of waiting.
  void run(int n, const std::function<void(int)>& fn) {
    std::unique_lock<std::mutex> busy(run_mu_, std::try_to_lock);
    if (n <= 1 || !busy.owns_lock()) {
      fn(0);
      return;
    }
    while (static_cast<int>(threads_.size()) < n - 1) {
      const int id = static_cast<int>(threads_.size()) + 1;
      threads_.emplace_back([this, id, g = gen_] { loop(id, g); });
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      fn_ = &fn;
      ntasks_ = n;
      open_ = true;
      active_ = 0;
      ++gen_;
    }
    cv_.notify_all();
    fn(0);
    std::unique_lock<std::mutex> lk(mu_);
    open_ = false;  // helpers that wake up from now on find nothing to do
    done_cv_.wait(lk, [&] { return active_ == 0; });
    fn_ = nullptr;
  }
  const pid_t pid = getpid();

 private:
  void loop(int id, uint64_t seen) {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      cv_.wait(lk, [&] { return gen_ != seen; });
      seen = gen_;
      if (!open_ || id >= ntasks_) continue;
      ++active_;
      const auto* fn = fn_;
      lk.unlock();
      (*fn)(id);
      lk.lock();
      if (--active_ == 0) done_cv_.notify_one();
    }
  }
  std::mutex run_mu_;  // one job at a time
  std::mutex mu_;      // guards the job description below
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* fn_ = nullptr;
  int ntasks_ = 0;     // threads allowed on this job, caller included
  bool open_ = false;  // helpers may still join
  int active_ = 0;     // helpers inside fn
  uint64_t gen_ = 0;   // job counter; a helper looks at each generation once
  std::vector<std::thread> threads_;
};

Pool* pool() {
  // Leaked on purpose: joining helpers from a static destructor at exit can deadlock. After fork()
  // the child has none of the parent's helpers, so it gets a fresh pool (the old one is leaked).
  static std::mutex mu;
  static Pool* p = nullptr;
  std::lock_guard<std::mutex> lk(mu);
  if (p == nullptr || p->pid != getpid()) p = new Pool();
  return p;
}

// 64 Ki elements: 256 KiB per fp32 stream. Chunk edges are multiples of 64 elements, so no two
// threads write the same cache line of any stream (fp32 or 16-bit).
constexpr int64_t kChunk = 1 << 16;

// Calls body(chunk_index, begin, end) once per chunk of [0, n), on up to `threads` threads.
template <typename F>
void parallel_chunks(int64_t n, int threads, F body) {
  const int64_t nchunks = (n + kChunk - 1) / kChunk;
  const int nt = static_cast<int>(std::min<int64_t>(threads < 1 ? 1 : threads, nchunks));
  std::atomic<int64_t> next{0};
  std::function<void(int)> fn = [&](int) {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < nchunks;) {
      body(c, c * kChunk, std::min(n, (c + 1) * kChunk));
    }
  };
  pool()->run(nt, fn);
}

inline uint32_t hash32(uint32_t x) {  // "lowbias32" integer hash (public domain, C. Wellons)
  x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
  return x;
}
constexpr uint32_t kGolden = 0x9E3779B9u;
#ifndef INFINITY_PREFETCH_AHEAD
#define INFINITY_PREFETCH_AHEAD 256
#endif

// ---------------------------------------------------------------- scalar path (any x86-64 / ARM)
inline float bits_to_f(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t f_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline float load_s(const float* p, int64_t i) { return p[i]; }
inline float load_s(const bf16_t* p, int64_t i) { return bits_to_f(uint32_t(p[i].x) << 16); }
// fp16 <-> fp32 with integer and fp32 arithmetic only. x86 GCC has `_Float16` only from GCC 12
// (Ubuntu 22.04 ships 11), so these are the conversions of c10::Half (Maratyszcza's FP16 library,
// which torch uses): bit for bit what torch's .half() / .float() give, round to nearest even,
// subnormals, infinities and NaN (a NaN becomes the quiet 0x7E00 with its sign) included. They
// rely on IEEE fp32 arithmetic in round-to-nearest mode: no -ffast-math in BASE_FLAGS.
inline float half_to_float(uint16_t h) {
  const uint32_t w = uint32_t(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  // Normal numbers, Inf and NaN: shift exponent and mantissa into place, rebias by scaling.
  const float normalized = bits_to_f((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  // Subnormals: the mantissa under an exponent of 2^-1, minus that 2^-1, is exact.
  const float denormalized = bits_to_f((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t denormalized_cutoff = 1u << 27;
  return bits_to_f(sign | (two_w < denormalized_cutoff ? f_to_bits(denormalized)
                                                        : f_to_bits(normalized)));
}
inline uint16_t float_to_half(float f) {
  // Scale so that the fp32 addition below rounds the mantissa to fp16's 10 bits (nearest even),
  // overflowing to Inf where fp16 does; subnormal results get a fixed minimum exponent.
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = f_to_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bits_to_f((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = f_to_bits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return uint16_t((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}
inline float load_s(const f16_t* p, int64_t i) { return half_to_float(p[i].x); }
inline void store_s(float* p, int64_t i, float x) { p[i] = x; }
inline void store_s(bf16_t* p, int64_t i, float x) {  // round to nearest even, like c10::BFloat16
  const uint32_t u = f_to_bits(x);
  p[i].x = std::isnan(x) ? 0x7FC0 : uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline void store_s(f16_t* p, int64_t i, float x) { p[i].x = float_to_half(x); }
inline void store_s(no_out_t*, int64_t, float) {}
// Stochastic rounding to bf16: add 16 random bits below the kept mantissa, then truncate. The
// result is x rounded up with probability equal to the dropped fraction, so E[stored] = x.
inline void store_sr(float* p, int64_t i, float x, uint32_t) { p[i] = x; }
inline void store_sr(bf16_t* p, int64_t i, float x, uint32_t r16) {
  p[i].x = std::isnan(x) ? 0x7FC0 : uint16_t((f_to_bits(x) + r16) >> 16);
}

template <typename G, typename S, typename O>
void adam_scalar(float* p, const G* g, S* m, S* v, O* out, int64_t b, int64_t e,
                 const InfinityAdamHyper& h) {
  const bool decoupled = h.flags & 1, l2 = h.flags & 2;
  const float inv_bc2 = 1.0f / h.bc2_sqrt;
  for (int64_t i = b; i < e; ++i) {
    float gi = load_s(g, i) * h.grad_scale;
    float pi = p[i];
    if (l2) gi = std::fma(h.l2, pi, gi);
    if (decoupled) pi *= h.decay;
    float mi = load_s(m, i), vi = load_s(v, i);
    mi = std::fma(h.one_minus_beta1, gi - mi, mi);
    vi = std::fma(gi * h.one_minus_beta2, gi, vi * h.beta2);
    const float den = std::fma(std::sqrt(vi), inv_bc2, h.eps);
    pi = std::fma(-h.step_size, mi / den, pi);
    p[i] = pi;
    const uint32_t r = hash32(uint32_t(i) * kGolden + h.seed);
    store_sr(m, i, mi, r & 0xFFFFu);
    store_sr(v, i, vi, r >> 16);
    store_s(out, i, pi);
  }
}

#ifdef INFINITY_AVX512
// ---------------------------------------------------------------- AVX-512 path
// kFull: a whole vector of 16 elements, plain loads/stores. Otherwise the tail, with masked ones
// (masked stores are slow on some CPUs, e.g. AMD Zen 4, so the main loop never uses them).
template <bool kFull> inline __m512 load_v(const float* p, __mmask16 k) {
  return kFull ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(k, p);
}
template <bool kFull> inline __m256i load_16(const void* p, __mmask16 k) {
  return kFull ? _mm256_loadu_si256(static_cast<const __m256i*>(p)) : _mm256_maskz_loadu_epi16(k, p);
}
template <bool kFull> inline void store_16(void* p, __mmask16 k, __m256i x) {
  if (kFull) _mm256_storeu_si256(static_cast<__m256i*>(p), x);
  else _mm256_mask_storeu_epi16(p, k, x);
}
template <bool kFull> inline __m512 load_v(const bf16_t* p, __mmask16 k) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load_16<kFull>(p, k)), 16));
}
template <bool kFull> inline __m512 load_v(const f16_t* p, __mmask16 k) {
  return _mm512_cvtph_ps(load_16<kFull>(p, k));
}
template <bool kFull> inline void store_v(float* p, __mmask16 k, __m512 x) {
  if (kFull) _mm512_storeu_ps(p, x);
  else _mm512_mask_storeu_ps(p, k, x);
}
template <bool kFull> inline void store_bf16_bits(bf16_t* p, __mmask16 k, __m512 x, __m512i rounded) {
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC00000));
  store_16<kFull>(p, k, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
template <bool kFull> inline void store_v(bf16_t* p, __mmask16 k, __m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  store_bf16_bits<kFull>(p, k, x, _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))));
}
template <bool kFull> inline void store_v(f16_t* p, __mmask16 k, __m512 x) {
  store_16<kFull>(p, k, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
template <bool kFull> inline void store_v(no_out_t*, __mmask16, __m512) {}
template <bool kFull> inline void store_sr_v(float* p, __mmask16 k, __m512 x, __m512i) {
  store_v<kFull>(p, k, x);
}
// No NaN fix-up needed here: x is computed, so a NaN is quiet (bit 22 set) and adding 16 low bits
// cannot carry out of the mantissa: it stays NaN after truncation.
template <bool kFull> inline void store_sr_v(bf16_t* p, __mmask16 k, __m512 x, __m512i r16) {
  const __m512i bits = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), r16), 16);
  store_16<kFull>(p, k, _mm512_cvtepi32_epi16(bits));
}
inline __m512i hash32_v(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846ca68bu)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

inline __m512i xorshift32_v(__m512i x) {  // Marsaglia's xorshift32 (13, 17, 5), per lane
  x = _mm512_xor_si512(x, _mm512_slli_epi32(x, 13));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 17));
  return _mm512_xor_si512(x, _mm512_slli_epi32(x, 5));
}

struct AdamConsts {
  __m512 b2, omb1, omb2, eps, neg_step, inv_bc2, decay, wd, gs;
  bool decoupled, l2, stream_out;
  explicit AdamConsts(const InfinityAdamHyper& h)
      : b2(_mm512_set1_ps(h.beta2)), omb1(_mm512_set1_ps(h.one_minus_beta1)),
        omb2(_mm512_set1_ps(h.one_minus_beta2)), eps(_mm512_set1_ps(h.eps)),
        neg_step(_mm512_set1_ps(-h.step_size)), inv_bc2(_mm512_set1_ps(1.0f / h.bc2_sqrt)),
        decay(_mm512_set1_ps(h.decay)), wd(_mm512_set1_ps(h.l2)), gs(_mm512_set1_ps(h.grad_scale)),
        decoupled(h.flags & 1), l2(h.flags & 2), stream_out(h.flags & 4) {}
};

// 16 elements starting at i: everything but the moment stores, which are left in mv and vv.
template <bool kFull, typename G, typename S, typename O>
inline void adam16_core(float* p, const G* g, const S* m, const S* v, O* out, int64_t i, __mmask16 k,
                        const AdamConsts& c, __m512& mv, __m512& vv) {
  __m512 gv = _mm512_mul_ps(load_v<kFull>(g + i, k), c.gs);
  __m512 pv = load_v<kFull>(p + i, k);
  if (c.l2) gv = _mm512_fmadd_ps(c.wd, pv, gv);
  if (c.decoupled) pv = _mm512_mul_ps(pv, c.decay);
  mv = load_v<kFull>(m + i, k);
  vv = load_v<kFull>(v + i, k);
  mv = _mm512_fmadd_ps(c.omb1, _mm512_sub_ps(gv, mv), mv);
  vv = _mm512_fmadd_ps(_mm512_mul_ps(gv, c.omb2), gv, _mm512_mul_ps(vv, c.b2));
  const __m512 den = _mm512_fmadd_ps(_mm512_sqrt_ps(vv), c.inv_bc2, c.eps);
  pv = _mm512_fmadd_ps(c.neg_step, _mm512_div_ps(mv, den), pv);
  store_v<kFull>(p + i, k, pv);
  if constexpr (kFull && sizeof(O) == 2 && !std::is_same<O, no_out_t>::value) {
    if (c.stream_out) {  // see [stream the copy-out] in infinity_adam_step
      __m256i bits;
      if constexpr (std::is_same<O, bf16_t>::value) {
        const __m512i u = _mm512_castps_si512(pv);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
        r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(pv, pv, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
        bits = _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
      } else {
        bits = _mm512_cvtps_ph(pv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      }
      _mm256_stream_si256(reinterpret_cast<__m256i*>(out + i), bits);
      return;
    }
  }
  store_v<kFull>(out + i, k, pv);
}

// 16 elements starting at i; `rng` holds 32 random bits per lane (bf16 moments only) and is
// advanced here.
template <bool kFull, typename G, typename S, typename O>
inline void adam16(float* p, const G* g, S* m, S* v, O* out, int64_t i, __mmask16 k,
                   const AdamConsts& c, __m512i& rng) {
  __m512 mv, vv;
  adam16_core<kFull>(p, g, m, v, out, i, k, c, mv, vv);
  if constexpr (std::is_same<S, bf16_t>::value) {
    const __m512i r = rng;
    rng = xorshift32_v(rng);
    store_sr_v<kFull>(m + i, k, mv, _mm512_and_si512(r, _mm512_set1_epi32(0xFFFF)));
    store_sr_v<kFull>(v + i, k, vv, _mm512_srli_epi32(r, 16));
  } else {
    store_v<kFull>(m + i, k, mv);
    store_v<kFull>(v + i, k, vv);
  }
}

// Upper 16 bits of each 32-bit lane of lo (elements 0..15) then hi (16..31), in order: one
// vpermt2w instead of a shift and a vpmovdw (2 uops on Zen 4) per 16 elements.
inline __m512i high_halves(__m512i lo, __m512i hi) {
  const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33,
                                       31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  return _mm512_permutex2var_epi16(lo, odd, hi);
}

// 32 elements of bf16 moments starting at i, bit for bit what two adam16 calls store (the same
// rng draws in the same order), with each moment written as one 64-byte store.
template <typename G, typename O>
inline void adam32_bf16(float* p, const G* g, bf16_t* m, bf16_t* v, O* out, int64_t i,
                        const AdamConsts& c, __m512i& rng) {
  __m512 m0, v0, m1, v1;
  adam16_core<true>(p, g, m, v, out, i, __mmask16(0xFFFF), c, m0, v0);
  adam16_core<true>(p, g, m, v, out, i + 16, __mmask16(0xFFFF), c, m1, v1);
  const __m512i r0 = rng, r1 = xorshift32_v(r0);
  rng = xorshift32_v(r1);
  const __m512i low16 = _mm512_set1_epi32(0xFFFF);
  const __m512i ms = high_halves(_mm512_add_epi32(_mm512_castps_si512(m0), _mm512_and_si512(r0, low16)),
                                 _mm512_add_epi32(_mm512_castps_si512(m1), _mm512_and_si512(r1, low16)));
  const __m512i vs = high_halves(_mm512_add_epi32(_mm512_castps_si512(v0), _mm512_srli_epi32(r0, 16)),
                                 _mm512_add_epi32(_mm512_castps_si512(v1), _mm512_srli_epi32(r1, 16)));
  _mm512_storeu_si512(m + i, ms);
  _mm512_storeu_si512(v + i, vs);
}

template <typename G, typename S, typename O>
void adam_avx512(float* p, const G* g, S* m, S* v, O* out, int64_t b, int64_t e,
                 const InfinityAdamHyper& h) {
  const AdamConsts c(h);
  // Rounding bits: a per-lane xorshift32 stream seeded by hashing (index * golden + seed) of the
  // chunk's first 16 elements. Chunks are fixed (kChunk), so results do not depend on threads.
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  __m512i rng = _mm512_or_si512(hash32_v(_mm512_add_epi32(
      _mm512_mullo_epi32(_mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(uint32_t(b))), iota),
                         _mm512_set1_epi32(static_cast<int>(kGolden))),
      _mm512_set1_epi32(static_cast<int>(h.seed)))), _mm512_set1_epi32(1));  // xorshift needs != 0
  constexpr bool kPrefetch = std::is_same<S, bf16_t>::value;
  int64_t i = b;
  if constexpr (std::is_same<S, bf16_t>::value) {
    // Two vectors per trip: each 16-bit stream's cache line is prefetched once, and each moment
    // is packed with one permute (see high_halves). The 16-wide loop below takes what is left.
    constexpr int64_t kAhead = INFINITY_PREFETCH_AHEAD;
    for (; i + 32 <= e; i += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(p + i + kAhead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p + i + kAhead + 16), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(g + i + kAhead), _MM_HINT_T0);
      if constexpr (sizeof(G) == 4) {
        _mm_prefetch(reinterpret_cast<const char*>(g + i + kAhead + 16), _MM_HINT_T0);
      }
      _mm_prefetch(reinterpret_cast<const char*>(m + i + kAhead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(v + i + kAhead), _MM_HINT_T0);
      adam32_bf16(p, g, m, v, out, i, c, rng);
    }
  }
  for (; i + 16 <= e; i += 16) {
    if constexpr (kPrefetch) {
      // Measured on the shared 2-core VM (noisy): a software prefetch 256 elements ahead made
      // the bf16-moment loop 5-15 % faster and the fp32 loop no faster, so only bf16 uses it.
      constexpr int64_t kAhead = INFINITY_PREFETCH_AHEAD;
      _mm_prefetch(reinterpret_cast<const char*>(p + i + kAhead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(g + i + kAhead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(m + i + kAhead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(v + i + kAhead), _MM_HINT_T0);
    }
    adam16<true>(p, g, m, v, out, i, __mmask16(0xFFFF), c, rng);
  }
  if (i < e) adam16<false>(p, g, m, v, out, i, __mmask16((1u << (e - i)) - 1u), c, rng);
  if (c.stream_out) _mm_sfence();  // order the streaming stores before the job is reported done
}
#endif

template <typename G, typename S, typename O>
void adam_range(float* p, const G* g, S* m, S* v, O* out, int64_t b, int64_t e,
                const InfinityAdamHyper& h) {
#ifdef INFINITY_AVX512
  adam_avx512(p, g, m, v, out, b, e, h);
#else
  adam_scalar(p, g, m, v, out, b, e, h);
#endif
}

// dtype code -> a typed null pointer handed to `f`, so each combination is its own instantiation.
template <typename F>
int with_grad_type(int code, F f) {
  switch (code) {
    case kF32: return f(static_cast<float*>(nullptr));
    case kBF16: return f(static_cast<bf16_t*>(nullptr));
    case kF16: return f(static_cast<f16_t*>(nullptr));
    default: return -1;
  }
}
template <typename F>
int with_state_type(int code, F f) {
  switch (code) {
    case kF32: return f(static_cast<float*>(nullptr));
    case kBF16: return f(static_cast<bf16_t*>(nullptr));
    default: return -2;
  }
}
template <typename F>
int with_out_type(int code, F f) {
  switch (code) {
    case kNone: return f(static_cast<no_out_t*>(nullptr));
    case kBF16: return f(static_cast<bf16_t*>(nullptr));
    case kF16: return f(static_cast<f16_t*>(nullptr));
    default: return -3;
  }
}

}  // namespace

extern "C" {

// Returns 0, or a negative code for an unsupported dtype (-1 grad, -2 state, -3 out).
int infinity_adam_step(float* param, const void* grad, int grad_dtype, void* exp_avg,
                       void* exp_avg_sq, int state_dtype, void* out, int out_dtype, int64_t n,
                       const InfinityAdamHyper* hyper, int threads) {
  InfinityAdamHyper h = *hyper;
  // [stream the copy-out] `out` is written and not read here: for a large step, non-temporal
  // stores skip the read-for-ownership of its cache lines (2 of the ~32 bytes per parameter) and
  // keep it from evicting the streams still being read. Small steps keep it cached for the caller.
  constexpr int64_t kStreamMinBytes = 16 << 20;
  if (out != nullptr && n * 2 >= kStreamMinBytes && (reinterpret_cast<uintptr_t>(out) & 31) == 0) {
    h.flags |= 4;
  }
  return with_grad_type(grad_dtype, [&](auto* gt) {
    return with_state_type(state_dtype, [&](auto* st) {
      return with_out_type(out_dtype, [&](auto* ot) {
        using G = std::remove_pointer_t<decltype(gt)>;
        using S = std::remove_pointer_t<decltype(st)>;
        using O = std::remove_pointer_t<decltype(ot)>;
        parallel_chunks(n, threads, [&](int64_t, int64_t b, int64_t e) {
          adam_range(param, static_cast<const G*>(grad), static_cast<S*>(exp_avg),
                     static_cast<S*>(exp_avg_sq), static_cast<O*>(out), b, e, h);
        });
        return 0;
      });
    });
  });
}

// [memory probe] The fp32 step's memory traffic without its arithmetic: read param, grad and
// the two moments, write param and the moments back (28 bytes a parameter), over the same
// threads and chunks as infinity_adam_step. `infinity bench adam` divides its time by the step's
// to say how close the step is to the memory's limit on this machine.
void infinity_memory_probe(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                           int64_t n, int threads) {
  parallel_chunks(n, threads, [&](int64_t, int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float g = grad[i];
      param[i] += g;
      exp_avg[i] += g;
      exp_avg_sq[i] += g;
    }
  });
}

// 1 when the AVX-512 path was compiled in, 0 for the portable scalar loop.
int infinity_adam_isa(void) {
#ifdef INFINITY_AVX512
  return 1;
#else
  return 0;
#endif
}

}  // extern "C"
