// The int8 logits head's CPU kernel as a torch operator (pagoda_cpu::int8_logits), built into the
// same library as cpu_attention.cpp by kernels/cpu_ops.py.
//
// out[m, n] = (sum over k of x[m, k] * q[n, k]) * scale[n] (+ bias[n]), in float32: every logit of
// a row as the float32 product of the int8 weights, not rounded to bfloat16 (torch's
// _weight_int8pack_mm rounds its output; two of a row's best logits then often tie). The weights are
// read once per step whatever the number of rows: a block of weight rows is widened to floats once
// and every row of x is multiplied with it, where torch's kernel reads the weights again per row.
// Each output is one dot product in a fixed order (16 lanes over k, the tail zero-padded, the lanes
// summed by one reduction), whatever the number of rows and whichever block computed it: a row's
// logits do not depend on what else shares its step.
//
// And the int4 linear layers' kernel (pagoda_cpu::int4_mm, where the CPU has AVX512_BF16): y = x w^T
// for x [m, k] bfloat16 and group-wise int4 weights, w = (q - 8) * scale + zero (torch's tinygemm
// convention), in the layout `int4_pack` (kernels/cpu_ops.py) writes. Each output is computed by the
// same loop whatever m is: 16 outputs a vector, the groups in order, four partial sums a group added
// in a fixed order, then scaled; so a row's output does not depend on what else shares its step. A
// block of weights is widened once for up to 4 rows of x (torch's kernel widens it again for each row).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK = 4;  // weight rows widened together
constexpr int64_t TILE = 4;   // rows of x multiplied with a block together (TILE x BLOCK accumulators)

// A dot product's element kind: `Float` (x and the weights as floats, one fused multiply-add per
// 16 lanes) and, where the CPU has AVX512_BF16, `BFloat16` (x as it is, the weights widened to
// bfloat16, exactly: an int8 is a bfloat16; one vdpbf16ps per 32 products, each product exact, the
// sums in float32). Each has `width` elements a vector, `dots<tile>` and `widen`.
struct Float {
  using T = float;
  static constexpr int64_t width = 16;
  static float from(float v) { return v; }
  static float from(c10::BFloat16 v) { return static_cast<float>(v); }
  static void widen(const int8_t* q, int64_t k, float* w) {
    for (int64_t i = 0; i < k; ++i) w[i] = static_cast<float>(q[i]);
  }
#if defined(__AVX512F__)
  template <int64_t tile>
  static void dots(const float* x, const float* w, int64_t kp, float* result) {
    __m512 acc[tile][BLOCK];
    for (int64_t m = 0; m < tile; ++m)
      for (int64_t r = 0; r < BLOCK; ++r) acc[m][r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < kp; i += width) {
      __m512 wv[BLOCK];
      for (int64_t r = 0; r < BLOCK; ++r) wv[r] = _mm512_loadu_ps(w + r * kp + i);
      for (int64_t m = 0; m < tile; ++m) {
        const __m512 xv = _mm512_loadu_ps(x + m * kp + i);
        for (int64_t r = 0; r < BLOCK; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
      }
    }
    for (int64_t m = 0; m < tile; ++m)
      for (int64_t r = 0; r < BLOCK; ++r) result[m * BLOCK + r] = _mm512_reduce_add_ps(acc[m][r]);
  }
#else
  typedef float vfloat __attribute__((vector_size(width * sizeof(float))));

  template <int64_t tile>
  static void dots(const float* x, const float* w, int64_t kp, float* result) {
    vfloat acc[tile][BLOCK] = {};
    for (int64_t i = 0; i < kp; i += width) {
      vfloat wv[BLOCK], xv;
      for (int64_t r = 0; r < BLOCK; ++r) std::memcpy(&wv[r], w + r * kp + i, sizeof(vfloat));
      for (int64_t m = 0; m < tile; ++m) {
        std::memcpy(&xv, x + m * kp + i, sizeof xv);
        for (int64_t r = 0; r < BLOCK; ++r) acc[m][r] += xv * wv[r];
      }
    }
    for (int64_t m = 0; m < tile; ++m)
      for (int64_t r = 0; r < BLOCK; ++r) {
        float part[width];
        std::memcpy(part, &acc[m][r], sizeof part);
        for (int64_t half = width / 2; half > 0; half /= 2)
          for (int64_t l = 0; l < half; ++l) part[l] += part[l + half];
        result[m * BLOCK + r] = part[0];
      }
  }
#endif
};

#if defined(__AVX512BF16__)
struct BFloat16 {
  using T = c10::BFloat16;
  static constexpr int64_t width = 32;
  static c10::BFloat16 from(c10::BFloat16 v) { return v; }
  static void widen(const int8_t* q, int64_t k, c10::BFloat16* w) {
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) {
      const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i))));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + i), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(f)));
    }
    for (; i < k; ++i) w[i] = c10::BFloat16(static_cast<float>(q[i]));
  }
  template <int64_t tile>
  static void dots(const c10::BFloat16* x, const c10::BFloat16* w, int64_t kp, float* result) {
    __m512 acc[tile][BLOCK];
    for (int64_t m = 0; m < tile; ++m)
      for (int64_t r = 0; r < BLOCK; ++r) acc[m][r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < kp; i += width) {
      __m512bh wv[BLOCK];
      for (int64_t r = 0; r < BLOCK; ++r) wv[r] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + r * kp + i));
      for (int64_t m = 0; m < tile; ++m) {
        const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x + m * kp + i));
        for (int64_t r = 0; r < BLOCK; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xv, wv[r]);
      }
    }
    for (int64_t m = 0; m < tile; ++m)
      for (int64_t r = 0; r < BLOCK; ++r) result[m * BLOCK + r] = _mm512_reduce_add_ps(acc[m][r]);
  }
};
#endif

// The dot products of `count` <= TILE rows of x with a block, each by the same loop as in a full tile.
template <typename D>
void dots_rows(const typename D::T* x, int64_t count, const typename D::T* w, int64_t kp, float* result) {
  switch (count) {
    case 4: return D::template dots<4>(x, w, kp, result);
    case 3: return D::template dots<3>(x, w, kp, result);
    case 2: return D::template dots<2>(x, w, kp, result);
    default: return D::template dots<1>(x, w, kp, result);
  }
}

// Rows of x in D's element, each padded with zeros to kp (a whole number of vectors).
template <typename D, typename X>
std::vector<typename D::T> padded_rows(const X* x, int64_t rows, int64_t k, int64_t stride, int64_t kp) {
  std::vector<typename D::T> y(rows * kp, typename D::T(0.f));
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t i = 0; i < k; ++i) y[m * kp + i] = D::from(x[m * stride + i]);
  return y;
}

template <typename D, typename S>
void int8_logits_impl(const typename D::T* x, int64_t rows, int64_t k, int64_t kp, const int8_t* q, int64_t n,
                      const S* scales, const S* bias, float* out) {
  at::parallel_for(0, (n + BLOCK - 1) / BLOCK, 64, [&](int64_t begin, int64_t end) {
    std::vector<typename D::T> w(BLOCK * kp, typename D::T(0.f));
    float result[TILE * BLOCK];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n0 = b * BLOCK, count = std::min(BLOCK, n - n0);
      for (int64_t r = 0; r < count; ++r) D::widen(q + (n0 + r) * k, k, w.data() + r * kp);
      if (count < BLOCK) std::fill(w.begin() + count * kp, w.end(), typename D::T(0.f));
      for (int64_t m0 = 0; m0 < rows; m0 += TILE) {
        const int64_t tile = std::min(TILE, rows - m0);
        dots_rows<D>(x + m0 * kp, tile, w.data(), kp, result);
        for (int64_t m = 0; m < tile; ++m)
          for (int64_t r = 0; r < count; ++r) {
            float logit = result[m * BLOCK + r] * static_cast<float>(scales[n0 + r]);
            if (bias != nullptr) logit += static_cast<float>(bias[n0 + r]);
            out[(m0 + m) * n + n0 + r] = logit;
          }
      }
    }
  });
}

template <typename D, typename X>
void int8_logits_as(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                    const std::optional<at::Tensor>& bias, at::Tensor& out) {
  const int64_t rows = x.size(0), k = x.size(1), n = q.size(0), kp = (k + D::width - 1) / D::width * D::width;
  const auto xs = padded_rows<D>(x.data_ptr<X>(), rows, k, x.stride(0), kp);
  if (scales.scalar_type() == at::kBFloat16)
    return int8_logits_impl<D>(xs.data(), rows, k, kp, q.data_ptr<int8_t>(), n, scales.data_ptr<c10::BFloat16>(),
                               bias ? bias->data_ptr<c10::BFloat16>() : nullptr, out.data_ptr<float>());
  TORCH_CHECK(scales.scalar_type() == at::kFloat, "int8_logits: scales are bfloat16 or float32, not ",
              scales.scalar_type());
  int8_logits_impl<D>(xs.data(), rows, k, kp, q.data_ptr<int8_t>(), n, scales.data_ptr<float>(),
                      bias ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>());
}

// x [rows, k] bfloat16 or float32 (rows of stride x.stride(0)), q [n, k] int8 contiguous, scales [n]
// and bias [n] (bfloat16 or float32, alike), out [rows, n] float32 contiguous.
void int8_logits(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                 const std::optional<at::Tensor>& bias, at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == q.size(1) && scales.dim() == 1 &&
                  scales.size(0) == q.size(0) && out.dim() == 2 && out.size(0) == x.size(0) &&
                  out.size(1) == q.size(0),
              "int8_logits: shapes");
  TORCH_CHECK(x.stride(1) == 1 && q.is_contiguous() && scales.is_contiguous() && out.is_contiguous(),
              "int8_logits: layout");
  TORCH_CHECK(q.scalar_type() == at::kChar && out.scalar_type() == at::kFloat, "int8_logits: int8 weights, float32 out");
  TORCH_CHECK(!bias || (bias->scalar_type() == scales.scalar_type() && bias->is_contiguous() &&
                        bias->dim() == 1 && bias->size(0) == q.size(0)),
              "int8_logits: a bias like the scales");
  switch (x.scalar_type()) {
#if defined(__AVX512BF16__)
    case at::kBFloat16: return int8_logits_as<BFloat16, c10::BFloat16>(x, q, scales, bias, out);
#else
    case at::kBFloat16: return int8_logits_as<Float, c10::BFloat16>(x, q, scales, bias, out);
#endif
    case at::kFloat: return int8_logits_as<Float, float>(x, q, scales, bias, out);
    default: TORCH_CHECK(false, "int8_logits: x is bfloat16 or float32, not ", x.scalar_type());
  }
}


#if defined(__AVX512BF16__)
constexpr int64_t INT4_BLOCK = 16;     // outputs a vector (a block of weight rows)
constexpr int64_t INT4_TILE = 4;       // rows of x a pass over a block
constexpr int64_t INT4_PREFETCH = 512; // bytes ahead in a block's stream

// A block's weights in chunks of 8 columns x 16 rows, 64 bytes: 32 words of 4 nibbles, nibble j of
// word i is q[i / 2][8c + 2j + i % 2] (the column pairs vdpbf16ps takes). A nibble q is widened to
// the bfloat16 1 + q/16 (1.0's exponent, q in the top of the mantissa: exact, and no shuffle), so
// a group's sum of x (q - 8) is 16 * sum x (1 + q/16) - 24 * sum x.
template <int T>
void int4_tile(const uint32_t* x, int64_t kh, const float* xsum, int64_t groups, int64_t chunks,
               const uint8_t* w, const c10::BFloat16* sz, c10::BFloat16* out, int64_t n) {
  const __m512i mask = _mm512_set1_epi16(0x0078), one = _mm512_set1_epi16(0x3F80);
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 d[T][4];
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < 4; ++j) d[t][j] = _mm512_setzero_ps();
    for (int64_t c = g * chunks; c < (g + 1) * chunks; ++c) {
      const uint8_t* src = w + c * 64;
      _mm_prefetch(reinterpret_cast<const char*>(src + INT4_PREFETCH), _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(src);
      const __m512bh wv[4] = {
          (__m512bh)_mm512_or_si512(_mm512_and_si512(_mm512_slli_epi16(v, 3), mask), one),
          (__m512bh)_mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 1), mask), one),
          (__m512bh)_mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 5), mask), one),
          (__m512bh)_mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 9), mask), one)};
      for (int t = 0; t < T; ++t)
        for (int j = 0; j < 4; ++j)
          d[t][j] = _mm512_dpbf16_ps(d[t][j], wv[j], (__m512bh)_mm512_set1_epi32(x[t * kh + 4 * c + j]));
    }
    const auto* sg = reinterpret_cast<const __m256i*>(sz + g * 2 * INT4_BLOCK);
    const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(sg)), 16));
    const __m512 z = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(sg + 1)), 16));
    const __m512 s16 = _mm512_mul_ps(s, _mm512_set1_ps(16.f));
    for (int t = 0; t < T; ++t) {
      const __m512 dot = _mm512_add_ps(_mm512_add_ps(d[t][0], d[t][1]), _mm512_add_ps(d[t][2], d[t][3]));
      const float xs = xsum[t * groups + g];
      acc[t] = _mm512_fmadd_ps(dot, s16, acc[t]);
      acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(-24.f * xs), s, acc[t]);
      acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(xs), z, acc[t]);
    }
  }
  for (int t = 0; t < T; ++t)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + t * n), (__m256i)_mm512_cvtneps_pbh(acc[t]));
}

// x [m, k] bfloat16 contiguous; w [n / 16, k * 8] uint8 and sz [n / 16, k / group_size, 2, 16]
// bfloat16 (scales, zeros) from int4_pack; out [m, n] bfloat16 contiguous.
void int4_mm(const at::Tensor& x, const at::Tensor& w, const at::Tensor& sz, int64_t group_size, at::Tensor out) {
  const int64_t m = x.size(0), k = x.size(1), blocks = w.size(0), n = blocks * INT4_BLOCK;
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kByte && sz.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16, "int4_mm: dtypes");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && sz.dim() == 4 && w.dim() == 2, "int4_mm: x, out and w 2-d, sz 4-d");
  TORCH_CHECK(group_size > 0 && group_size % 8 == 0 && k % group_size == 0 && w.size(1) == k * 8 &&
                  sz.numel() == blocks * (k / group_size) * 2 * INT4_BLOCK && out.size(0) == m && out.size(1) == n,
              "int4_mm: shapes");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && sz.is_contiguous() && out.is_contiguous(), "int4_mm: layout");
  const int64_t groups = k / group_size, chunks = group_size / 8, kh = k / 2;
  const auto* xp = reinterpret_cast<const c10::BFloat16*>(x.data_ptr());
  std::vector<float> xsum(m * groups);  // each row's group sums, in one order (on one thread below 16 rows)
  at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t g = 0; g < groups; ++g) {
        float total = 0.f;
        for (int64_t i = 0; i < group_size; ++i) total += static_cast<float>(xp[r * k + g * group_size + i]);
        xsum[r * groups + g] = total;
      }
  });
  const auto* xh = reinterpret_cast<const uint32_t*>(xp);
  const auto* wp = w.data_ptr<uint8_t>();
  const auto* szp = reinterpret_cast<const c10::BFloat16*>(sz.data_ptr());
  auto* op = reinterpret_cast<c10::BFloat16*>(out.data_ptr());
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* wb = wp + b * k * 8;
      const c10::BFloat16* sb = szp + b * groups * 2 * INT4_BLOCK;
      c10::BFloat16* ob = op + b * INT4_BLOCK;
      int64_t r = 0;
      for (; r + INT4_TILE <= m; r += INT4_TILE)
        int4_tile<INT4_TILE>(xh + r * kh, kh, xsum.data() + r * groups, groups, chunks, wb, sb, ob + r * n, n);
      const auto rest = [&](auto tile) {
        int4_tile<decltype(tile)::value>(xh + r * kh, kh, xsum.data() + r * groups, groups, chunks, wb, sb, ob + r * n, n);
      };
      switch (m - r) {
        case 3: rest(std::integral_constant<int, 3>{}); break;
        case 2: rest(std::integral_constant<int, 2>{}); break;
        case 1: rest(std::integral_constant<int, 1>{}); break;
        default: break;
      }
    }
  });
}
#else
void int4_mm(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, at::Tensor) {
  TORCH_CHECK(false, "int4_mm: built without AVX512_BF16");
}
#endif

bool int4_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("int8_logits(Tensor x, Tensor q, Tensor scales, Tensor? bias, Tensor(a!) out) -> ()");
  m.impl("int8_logits", c10::DispatchKey::CPU, &int8_logits);
  m.def("int4_mm(Tensor x, Tensor w, Tensor sz, int group_size, Tensor(a!) out) -> ()");
  m.impl("int4_mm", c10::DispatchKey::CPU, &int4_mm);
  m.def("int4_supported() -> bool", &int4_supported);
}
