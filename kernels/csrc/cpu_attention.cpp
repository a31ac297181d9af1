// Paged attention's CPU kernels as torch operators (pagoda_cpu::write_kv, pagoda_cpu::attention).
//
// Built at first use by kernels/cpu_ops.py with the system's C++ compiler against torch's headers,
// and run on torch's own intra-op thread pool (at::parallel_for under OpenMP, torch's libgomp). Each query row is computed alone,
// in float32, by the same loop in the same order whether it is a decode, a verify step's draft, a
// chunk after a cached prefix or a whole prompt, whatever else the step holds: a position's
// attention output does not depend on how its step was batched or its prompt chunked.
// Semantics: kernels/reference.py (`write_kv`, `paged_attention`).
//
// kv_cache: [num_blocks, 2, block_size, num_kv_heads, head_dim], contiguous.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace {

template <typename T>
void write_kv_impl(const at::Tensor& key, const at::Tensor& value, at::Tensor& cache, const at::Tensor& slots) {
  const int64_t n = key.size(0), kvh = key.size(1), d = key.size(2), bs = cache.size(2);
  const int64_t* slot = slots.data_ptr<int64_t>();
  const T* k = key.data_ptr<T>();
  const T* v = value.data_ptr<T>();
  T* c = cache.data_ptr<T>();
  const int64_t row = kvh * d;  // one slot's K (or V) heads
  for (int64_t t = 0; t < n; ++t) {
    if (slot[t] < 0) continue;  // padding
    TORCH_CHECK(slot[t] < cache.size(0) * bs, "write_kv: slot ", slot[t], " is past the cache");
    const int64_t block = slot[t] / bs, offset = slot[t] % bs;
    T* kdst = c + ((block * 2 + 0) * bs + offset) * row;
    T* vdst = c + ((block * 2 + 1) * bs + offset) * row;
    for (int64_t h = 0; h < kvh; ++h) {
      const T* ks = k + t * key.stride(0) + h * key.stride(1);
      const T* vs = v + t * value.stride(0) + h * value.stride(1);
      std::copy(ks, ks + d, kdst + h * d);
      std::copy(vs, vs + d, vdst + h * d);
    }
  }
}

void write_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor kv_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type() && value.scalar_type() == kv_cache.scalar_type(),
              "write_kv: K, V and the cache must share a dtype");
  TORCH_CHECK(kv_cache.dim() == 5 && key.dim() == 3 && key.sizes() == value.sizes() &&
                  key.size(1) == kv_cache.size(3) && key.size(2) == kv_cache.size(4) &&
                  slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0),
              "write_kv: shapes");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && kv_cache.is_contiguous(), "write_kv: layout");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "write_kv: int64 slots");
  switch (kv_cache.scalar_type()) {
    case at::kFloat: return write_kv_impl<float>(key, value, kv_cache, slot_mapping);
    case at::kBFloat16: return write_kv_impl<c10::BFloat16>(key, value, kv_cache, slot_mapping);
    case at::kHalf: return write_kv_impl<c10::Half>(key, value, kv_cache, slot_mapping);
    default: TORCH_CHECK(false, "write_kv: unsupported cache dtype ", kv_cache.scalar_type());
  }
}

// Every reduction below runs in an order fixed by the row's own keys and elements alone, and the
// library is built with -ffp-contract=off: whatever tile or step a row is computed in, each of its
// floats is the same. A score is q . k as 4 partial sums (head dim mod 4) combined pairwise; a
// softmax's total is 16 partial sums (key index mod 16 from the row's first key) combined pairwise;
// an output element is 4 partial sums over the row's keys (key index mod 4) combined pairwise.
// Tiles and packs of query heads only share loads of K and V. Vectors are GCC's vector extensions (16 floats:
// one AVX-512 register, two AVX2 ones), elementwise IEEE operations, so a vector lane computes what
// the scalar code of a row's tail computes.
constexpr int64_t TILE = 16;    // query rows of one sequence computed together (sharing K and V as floats)
constexpr int64_t LANES = 16;  // floats per vector
typedef float vfloat __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(LANES * sizeof(int32_t))));

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

// exp(x) for x <= 0: Cephes' expf (range reduction by ln 2, a degree-6 polynomial; within 2 ulp),
// branch-free, for a float or a vector alike. n = round(x / ln 2) by the 1.5 * 2^23 trick.
template <typename V, typename I>
inline V exp_nonpositive(V x) {
  x = x < -87.3f ? V{} - 87.3f : x;
  const V n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  V r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V y = r * 1.9875691500e-4f + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  I bits;
  if constexpr (std::is_same_v<V, float>) {
    bits = (static_cast<int32_t>(n) + 127) << 23;
  } else {
    bits = (__builtin_convertvector(n, vint) + 127) << 23;
  }
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}

// Softmax of one row's scores s[0, n) in place; `sink` (gpt-oss; -inf: none) is one more logit in
// the denominator, whose key has a zero value.
inline void softmax(float* s, int64_t n, float sink = -std::numeric_limits<float>::infinity()) {
  float top = sink;
  for (int64_t j = 0; j < n; ++j) top = std::max(top, s[j]);
  vfloat total{};
  int64_t j = 0;
  for (; j + LANES <= n; j += LANES) {
    const vfloat e = exp_nonpositive<vfloat, vint>(load(s + j) - top);
    store(s + j, e);
    total += e;
  }
  float part[LANES];
  store(part, total);
  for (; j < n; ++j) part[j % LANES] += (s[j] = exp_nonpositive<float, int32_t>(s[j] - top));
  for (int64_t width = LANES / 2; width > 0; width /= 2)
    for (int64_t l = 0; l < width; ++l) part[l] += part[l + width];
  if (sink > -std::numeric_limits<float>::infinity()) part[0] += exp_nonpositive<float, int32_t>(sink - top);
  const float inverse = 1.f / part[0];
  for (int64_t i = 0; i < n; ++i) s[i] *= inverse;
}

// A row of d values as floats (bfloat16: the upper half of a float's bits, a loop that vectorizes).
template <typename T>
inline void to_float(const T* x, float* y, int64_t d, int64_t stride = 1) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const uint16_t* bits = reinterpret_cast<const uint16_t*>(x);
    for (int64_t i = 0; i < d; ++i) {
      const uint32_t word = uint32_t(bits[i]) << 16;
      std::memcpy(y + i * stride, &word, sizeof word);
    }
  } else {
    for (int64_t i = 0; i < d; ++i) y[i * stride] = static_cast<float>(x[i]);
  }
}

// One KV head's keys [lo, hi) of a sequence as floats: K in blocks of LANES keys, each block
// [d][LANES] (key lo + b * LANES + lane), so a block's scores are one vector step per head dim; V as rows.
template <typename T>
void gather(const T* cache, int64_t num_blocks, const int32_t* table, int64_t lo, int64_t hi, int64_t bs, int64_t kvh,
            int64_t d, int64_t g, std::vector<float>& keys, std::vector<float>& values) {
  const int64_t row_stride = kvh * d, width = hi - lo;
  keys.assign((width + LANES - 1) / LANES * d * LANES, 0.f);
  values.resize(width * d);
  for (int64_t t = lo; t < hi; ++t) {
    TORCH_CHECK(table[t / bs] >= 0 && table[t / bs] < num_blocks, "attention: block ", table[t / bs], " is past the cache");
    const int64_t block = int64_t(table[t / bs]) * 2 * bs + t % bs;
    to_float(cache + block * row_stride + g * d, keys.data() + ((t - lo) / LANES) * d * LANES + (t - lo) % LANES, d,
             LANES);
    to_float(cache + (block + bs) * row_stride + g * d, values.data() + (t - lo) * d, d);
  }
}

struct Scratch {
  std::vector<float> q, scores, keys, values;
};

// out[h] = sum over the row's keys t of p[h][t] * v[t], for H query heads that share the keys: each
// V vector is loaded once for the H heads. Per head the sum is 4 partial sums (key index mod 4)
// combined pairwise, whatever H.
template <int64_t H, typename T>
inline void weighted_values(const float* const* p, const float* v, int64_t m, int64_t d, T* const* out) {
  int64_t i = 0;
  for (; i + LANES <= d; i += LANES) {
    vfloat acc[H][4] = {};
    int64_t t = 0;
    for (; t + 4 <= m; t += 4)
      for (int64_t u = 0; u < 4; ++u) {
        const vfloat x = load(v + (t + u) * d + i);
        for (int64_t h = 0; h < H; ++h) acc[h][u] += p[h][t + u] * x;
      }
    for (; t < m; ++t) {
      const vfloat x = load(v + t * d + i);
      for (int64_t h = 0; h < H; ++h) acc[h][t % 4] += p[h][t] * x;
    }
    for (int64_t h = 0; h < H; ++h) {
      float part[LANES];
      store(part, (acc[h][0] + acc[h][1]) + (acc[h][2] + acc[h][3]));
      for (int64_t l = 0; l < LANES; ++l) out[h][i + l] = static_cast<T>(part[l]);
    }
  }
  for (; i < d; ++i)
    for (int64_t h = 0; h < H; ++h) {
      float acc[4] = {};
      for (int64_t t = 0; t < m; ++t) acc[t % 4] += p[h][t] * v[t * d + i];
      out[h][i] = static_cast<T>((acc[0] + acc[1]) + (acc[2] + acc[3]));
    }
}

// Query rows [r0, r0 + n) of one sequence (at positions p0, p0 + 1, ...), for KV head g's group of
// query heads, over that head's keys as floats from key `base` on (`gather`). Row j sees keys
// [first_j, p0 + j] (first_j: its window's first key, else 0).
template <typename T>
void attend_tile(const T* query, int64_t qs0, int64_t qs1, const float* keys, const float* values, int64_t base,
                 int64_t r0, int64_t n, int64_t p0, int64_t window, int64_t d, int64_t g, int64_t group, float scale,
                 float softcap, const float* sinks, T* out, int64_t heads, Scratch& w) {
  auto first_of = [&](int64_t j) { return window > 0 ? std::max<int64_t>(p0 + j + 1 - window, 0) : int64_t(0); };
  const int64_t stride = (p0 + n - base + LANES - 1) / LANES * LANES;  // one head's scores: s[t - base]
  w.q.resize(d);
  w.scores.resize(group * stride);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t first = first_of(j), last = p0 + j + 1, m = last - first;  // the row's keys [first, last)
    for (int64_t h = 0; h < group; ++h) {
      to_float(query + (r0 + j) * qs0 + (g * group + h) * qs1, w.q.data(), d);
      float* s = w.scores.data() + h * stride;
      for (int64_t b = (first - base) / LANES; b * LANES < last - base; ++b) {
        const float* kt = keys + b * d * LANES;
        vfloat x[4] = {};  // by head dim mod 4 (four independent sums: no chain of dependent adds)
        int64_t i = 0;
        for (; i + 4 <= d; i += 4)
          for (int64_t u = 0; u < 4; ++u) x[u] += w.q[i + u] * load(kt + (i + u) * LANES);
        for (; i < d; ++i) x[i % 4] += w.q[i] * load(kt + i * LANES);
        x[0] = ((x[0] + x[1]) + (x[2] + x[3])) * scale;
        store(s + b * LANES, x[0]);
      }
      s += first - base;
      if (softcap > 0.f)
        for (int64_t t = 0; t < m; ++t) s[t] = softcap * std::tanh(s[t] / softcap);
      softmax(s, m, sinks ? sinks[g * group + h] : -std::numeric_limits<float>::infinity());
    }
    const float* v = values + (first - base) * d;
    for (int64_t h0 = 0; h0 < group; h0 += 4) {  // up to 4 heads per pass over V
      const float* p[4];
      T* o[4];
      const int64_t pack = std::min<int64_t>(4, group - h0);
      for (int64_t h = 0; h < pack; ++h) {
        p[h] = w.scores.data() + (h0 + h) * stride + (first - base);
        o[h] = out + ((r0 + j) * heads + g * group + h0 + h) * d;
      }
      switch (pack) {
        case 4: weighted_values<4>(p, v, m, d, o); break;
        case 3: weighted_values<3>(p, v, m, d, o); break;
        case 2: weighted_values<2>(p, v, m, d, o); break;
        default: weighted_values<1>(p, v, m, d, o); break;
      }
    }
  }
}

// Work item k of n in zig-zag order (0, n-1, 1, n-2, ...): each thread's contiguous share of the
// items then holds short and long rows alike (a prompt's later queries see more keys).
inline int64_t zigzag(int64_t k, int64_t n) { return k % 2 == 0 ? k / 2 : n - 1 - k / 2; }

template <typename T>
void attention_impl(const at::Tensor& query, const at::Tensor& cache, const at::Tensor& block_tables,
                    const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q, at::Tensor& out, double scale,
                    int64_t sliding_window, double softcap, const float* sinks) {
  const int64_t heads = query.size(1), d = query.size(2);
  const int64_t bs = cache.size(2), kvh = cache.size(3), group = heads / kvh;
  const int64_t num_seqs = seq_lens.size(0), width = block_tables.size(1), num_blocks = cache.size(0);
  const T* q = query.data_ptr<T>();
  const T* c = cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = cu_seqlens_q.data_ptr<int32_t>();
  T* o = out.data_ptr<T>();
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1);
  auto first_key = [&](int64_t s) {  // the first key a query of sequence s sees
    const int64_t p = lens[s] - (starts[s + 1] - starts[s]);
    return sliding_window > 0 ? std::max<int64_t>(p + 1 - sliding_window, 0) : int64_t(0);
  };
  // A sequence of several tiles (a prompt or a chunk) has its keys as floats gathered once per KV
  // head and shared by its tiles; a one-tile sequence (a decode) gathers its own.
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (sequence, its tile's first query row)
  std::vector<int64_t> shared(num_seqs, -1);  // sequence -> its first (sequence, KV head) buffer
  std::vector<int64_t> shared_seqs;
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(0 <= starts[s] && starts[s] <= starts[s + 1] && starts[s + 1] <= query.size(0) &&
                    starts[s + 1] - starts[s] <= lens[s] && lens[s] <= width * bs,
                "attention: sequence ", s, "'s query rows or length");
    for (int64_t r = starts[s]; r < starts[s + 1]; r += TILE) tiles.emplace_back(s, r);
    if (starts[s + 1] - starts[s] > TILE) {
      shared[s] = static_cast<int64_t>(shared_seqs.size()) * kvh;
      shared_seqs.push_back(s);
    }
  }
  std::vector<std::vector<float>> shared_keys(shared_seqs.size() * kvh), shared_values(shared_seqs.size() * kvh);
  at::parallel_for(0, static_cast<int64_t>(shared_keys.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = shared_seqs[i / kvh];
      gather(c, num_blocks, tables + s * width, first_key(s), int64_t(lens[s]), bs, kvh, d, i % kvh, shared_keys[i],
             shared_values[i]);
    }
  });
  const int64_t items = static_cast<int64_t>(tiles.size()) * kvh;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t k = begin; k < end; ++k) {
      const int64_t w = zigzag(k, items), g = w % kvh;
      const auto [s, r0] = tiles[w / kvh];
      const int64_t n = std::min<int64_t>(TILE, starts[s + 1] - r0);
      const int64_t p0 = lens[s] - (starts[s + 1] - r0);  // row r0's position in its sequence
      const float *keys, *values;
      if (shared[s] >= 0) {
        keys = shared_keys[shared[s] + g].data();
        values = shared_values[shared[s] + g].data();
      } else {
        gather(c, num_blocks, tables + s * width, first_key(s), p0 + n, bs, kvh, d, g, scratch.keys, scratch.values);
        keys = scratch.keys.data();
        values = scratch.values.data();
      }
      attend_tile<T>(q, qs0, qs1, keys, values, first_key(s), r0, n, p0, sliding_window, d, g, group, float(scale),
                     float(softcap), sinks, o, heads, scratch);
    }
  });
}

// Causal attention of every query row over its sequence's paged keys, each row computed alone
// (query r of sequence s, at position p, sees keys [0, p], or (p - W, p] under a window W). The
// semantics of kernels/reference.py's paged_attention; rows past cu_seqlens_q[-1] are left untouched.
void attention(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
               const at::Tensor& seq_lens, const at::Tensor& cu_seqlens_q, at::Tensor out, double scale,
               int64_t sliding_window, double logit_softcap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == kv_cache.scalar_type(),
              "attention: the query, the cache and the output must share a dtype");
  TORCH_CHECK(query.stride(2) == 1 && out.is_contiguous() && kv_cache.is_contiguous(), "attention: layout");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
                  seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous() &&
                  cu_seqlens_q.scalar_type() == at::kInt && cu_seqlens_q.is_contiguous(),
              "attention: int32 tables, lengths and query offsets");
  TORCH_CHECK(query.size(1) % kv_cache.size(3) == 0, "attention: heads per KV head");
  TORCH_CHECK(!sinks || (sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->dim() == 1 &&
                         sinks->size(0) == query.size(1)),
              "attention: sinks are float32 [num_heads]");
  const float* sink_logits = sinks ? sinks->data_ptr<float>() : nullptr;
  TORCH_CHECK(kv_cache.dim() == 5 && query.dim() == 3 && query.size(2) == kv_cache.size(4) &&
                  out.sizes() == query.sizes() && block_tables.dim() == 2 &&
                  block_tables.size(0) >= seq_lens.size(0) && cu_seqlens_q.size(0) == seq_lens.size(0) + 1,
              "attention: shapes");
  switch (kv_cache.scalar_type()) {
    case at::kFloat:
      return attention_impl<float>(query, kv_cache, block_tables, seq_lens, cu_seqlens_q, out, scale, sliding_window,
                                   logit_softcap, sink_logits);
    case at::kBFloat16:
      return attention_impl<c10::BFloat16>(query, kv_cache, block_tables, seq_lens, cu_seqlens_q, out, scale,
                                           sliding_window, logit_softcap, sink_logits);
    case at::kHalf:
      return attention_impl<c10::Half>(query, kv_cache, block_tables, seq_lens, cu_seqlens_q, out, scale,
                                       sliding_window, logit_softcap, sink_logits);
    default: TORCH_CHECK(false, "attention: unsupported dtype ", kv_cache.scalar_type());
  }
}

// The compiled decode step's attention with no Python in it: each attention layer registers its
// KV cache and constants under its layer id (`register_layer`, when the cache is set), the step's
// metadata is set once per step (`set_step`), and the graph's `layer_attention(q, k, v, id)` writes
// K and V and attends. A step the operators do not take (KV cache groups, image spans: `simple`
// false), a layer not registered, or tensors of another dtype or layout go to the Python operator
// `pagoda::attention` (worker/models/layers.py), which does the same through `attend`. The step is
// the model's thread's; the registry is locked, since a layer collected or given a cache on another
// thread changes it while the model's thread may be reading it (torch.ops calls release the GIL).
struct Layer {
  at::Tensor cache;
  double scale;
  int64_t window;
  double softcap;
  std::optional<at::Tensor> sinks;
};

struct Step {
  at::Tensor slots, tables, lens, starts;
  bool simple = false;
};

std::unordered_map<int64_t, Layer>& layers() {
  static std::unordered_map<int64_t, Layer> registry;
  return registry;
}

std::mutex& layers_lock() {
  static std::mutex lock;
  return lock;
}

// The layer's registration, copied (its tensors shared) under the lock; nullopt: none.
std::optional<Layer> find_layer(int64_t id) {
  std::lock_guard<std::mutex> guard(layers_lock());
  const auto found = layers().find(id);
  if (found == layers().end()) return std::nullopt;
  return found->second;
}

Step& step() {
  static Step current;
  return current;
}

int64_t served = 0, handed_back = 0;  // layer_attention's calls: in C++, and to the Python operator

std::vector<int64_t> layer_attention_counts() { return {served, handed_back}; }

void register_layer(int64_t id, at::Tensor cache, double scale, int64_t window, double softcap,
                    std::optional<at::Tensor> sinks) {
  Layer layer{std::move(cache), scale, window, softcap, std::move(sinks)};
  std::lock_guard<std::mutex> guard(layers_lock());
  layers()[id] = std::move(layer);
}

void unregister_layer(int64_t id) {
  std::optional<Layer> gone;  // its tensors released after the lock
  std::lock_guard<std::mutex> guard(layers_lock());
  const auto found = layers().find(id);
  if (found == layers().end()) return;
  gone = std::move(found->second);
  layers().erase(found);
}

void set_step(at::Tensor slots, at::Tensor tables, at::Tensor lens, at::Tensor starts, bool simple) {
  step() = Step{std::move(slots), std::move(tables), std::move(lens), std::move(starts), simple};
}

void clear_step() { step() = Step{}; }

at::Tensor layer_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t id) {
  const std::optional<Layer> found = find_layer(id);
  const Step& current = step();
  if (!current.simple || !found || q.scalar_type() != found->cache.scalar_type() ||
      k.scalar_type() != q.scalar_type() || v.scalar_type() != q.scalar_type() || q.dim() != 3 || k.dim() != 3 ||
      v.dim() != 3 || q.stride(2) != 1 || k.stride(2) != 1 || v.stride(2) != 1) {
    static const auto python = c10::Dispatcher::singleton()
                                   .findSchemaOrThrow("pagoda::attention", "")
                                   .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t)>();
    ++handed_back;
    return python.call(q, k, v, id);
  }
  ++served;
  const Layer& layer = *found;
  write_kv(k, v, layer.cache, current.slots);
  at::Tensor out = q.new_empty(q.sizes());
  attention(q, layer.cache, current.tables, current.lens, current.starts, out, layer.scale, layer.window,
            layer.softcap, layer.sinks);
  return out.view({q.size(0), q.size(1) * q.size(2)});
}

}  // namespace

TORCH_LIBRARY(pagoda_cpu, m) {
  m.def("write_kv(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
  m.def("attention(Tensor query, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, Tensor cu_seqlens_q, "
        "Tensor(a!) out, float scale, int sliding_window, float logit_softcap, Tensor? sinks) -> ()");
  m.impl("write_kv", c10::DispatchKey::CPU, &write_kv);
  m.impl("attention", c10::DispatchKey::CPU, &attention);
  m.def("register_layer(int id, Tensor cache, float scale, int window, float softcap, Tensor? sinks) -> ()",
        &register_layer);
  m.def("unregister_layer(int id) -> ()", &unregister_layer);
  m.def("set_step(Tensor slots, Tensor tables, Tensor lens, Tensor starts, bool simple) -> ()", &set_step);
  m.def("clear_step() -> ()", &clear_step);
  m.def("layer_attention_counts() -> int[]", &layer_attention_counts);
  m.def("layer_attention(Tensor q, Tensor k, Tensor v, int id) -> Tensor");
  m.impl("layer_attention", c10::DispatchKey::CPU, &layer_attention);
}
