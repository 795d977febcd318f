// hf-mhc's CPU decode kernels: one fused call per mHC site for a few tokens without autograd (greedy decoding).
//
// coeffs_pre: streams [T, n, C] -> y [T, C] (streams' dtype), post [T, n], comb [T, n, n] (float32; empty for the
//   identity map). flat_n = flat * rsqrt(mean(flat^2) + norm_eps); mix = flat_n @ fn.T (dot products for up to
//   kDotTokens tokens, one GEMM for more); then per token the residual map (0 sinkhorn, 1 unconstrained,
//   2 identity, 3 permutations) and y = sum_i pre[i] X[i].
// head: streams [T, n, C] -> y [T, C], pre_h = sigmoid(hc_scale * mix + hc_base) + eps.
// post_res: X'[i] = sum_j comb[j, i] X[j] + post[i] y (comb empty: X'[i] = X[i] + post[i] y), in float32, cast back.
// The formulas and their order of operations are those of hf_mhc/mhc_reference.py.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <numeric>
#include <vector>

namespace {

constexpr int64_t kSinkhorn = 0, kUnconstrained = 1, kIdentity = 2, kPermutations = 3;

inline float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

// In-place softmax of `v[0:size]`, as torch's: exp(v - max) / sum.
inline void softmax(float* v, int64_t size) {
  float top = -INFINITY;
  for (int64_t k = 0; k < size; ++k) top = std::max(top, v[k]);
  float total = 0.0f;
  for (int64_t k = 0; k < size; ++k) {
    v[k] = std::exp(v[k] - top);
    total += v[k];
  }
  for (int64_t k = 0; k < size; ++k) v[k] = v[k] / total;
}

// Sinkhorn-Knopp on one row-major n x n matrix of logits, in place: softmax over each row + eps, a column
// normalisation, then iters - 1 rounds of rows then columns, each M / (sum + eps).
void sinkhorn(float* m, int64_t n, int64_t iters, float eps) {
  for (int64_t i = 0; i < n; ++i) {
    softmax(m + i * n, n);
    for (int64_t j = 0; j < n; ++j) m[i * n + j] += eps;
  }
  for (int64_t step = 0; step < 2 * iters - 1; ++step) {
    const bool columns = step % 2 == 0;
    for (int64_t k = 0; k < n; ++k) {
      float total = 0.0f;
      for (int64_t l = 0; l < n; ++l) total += columns ? m[l * n + k] : m[k * n + l];
      const float denominator = total + eps;
      for (int64_t l = 0; l < n; ++l) {
        float& entry = columns ? m[l * n + k] : m[k * n + l];
        entry = entry / denominator;
      }
    }
  }
}

// The n! permutations of 0..n-1 in lexicographic order (itertools.permutations), flattened [n!, n].
std::vector<int64_t> permutations(int64_t n) {
  std::vector<int64_t> order(n), all;
  std::iota(order.begin(), order.end(), 0);
  do {
    all.insert(all.end(), order.begin(), order.end());
  } while (std::next_permutation(order.begin(), order.end()));
  return all;
}

// The tensor itself where it is already float32 and contiguous (no operator call), else a float32 contiguous copy.
at::Tensor float_contiguous(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat && t.is_contiguous() ? t : t.to(at::kFloat).contiguous();
}

// Sums of products in kLanes float32 partial sums, which the compiler vectorises, added up in double at the end.
constexpr int64_t kLanes = 16;

// Up to this many tokens the map logits are kLanes-wise dot products; more go to one GEMM (at::mm_out).
constexpr int64_t kDotTokens = 8;

inline float dot(const float* a, const float* b, int64_t size) {
  float lanes[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= size; k += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += a[k + l] * b[k + l];
  double total = 0.0;
  for (; k < size; ++k) total += static_cast<double>(a[k]) * b[k];
  for (int64_t l = 0; l < kLanes; ++l) total += lanes[l];
  return static_cast<float>(total);
}

// flat [T, width] float32 <- the RMS-normalised rows of x [T, width]: row * rsqrt(mean(row^2) + norm_eps).
template <typename scalar_t>
void normalize_rows(const scalar_t* src, int64_t tokens, int64_t width, double norm_eps, float* dst) {
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* row = src + t * width;
      float* out_row = dst + t * width;
      for (int64_t k = 0; k < width; ++k) out_row[k] = static_cast<float>(row[k]);
      const float mean = dot(out_row, out_row, width) / static_cast<float>(width);
      const float rstd = 1.0f / std::sqrt(mean + static_cast<float>(norm_eps));
      for (int64_t k = 0; k < width; ++k) out_row[k] = out_row[k] * rstd;
    }
  });
}

// mix [T, m] = normalize_rows(x) @ fn.T for x [T, width] and a float32 contiguous fn [m, width].
template <typename scalar_t>
std::vector<float> map_logits(const scalar_t* x, int64_t tokens, int64_t width, const at::Tensor& fn,
                              double norm_eps) {
  const int64_t m = fn.size(0);
  std::vector<float> flat(tokens * width), mix(tokens * m);
  normalize_rows<scalar_t>(x, tokens, width, norm_eps, flat.data());
  const float* w = fn.data_ptr<float>();
  if (tokens <= kDotTokens) {
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t r = 0; r < m; ++r) mix[t * m + r] = dot(flat.data() + t * width, w + r * width, width);
  } else {
    const auto options = at::TensorOptions().dtype(at::kFloat);
    auto out = at::from_blob(mix.data(), {tokens, m}, options);
    at::mm_out(out, at::from_blob(flat.data(), {tokens, width}, options), fn.t());
  }
  return mix;
}

// acc[c] = sum_j w[j * stride] * X[j, c] over the n streams X [n, C], in stream order (contiguous inner loops).
template <typename scalar_t>
inline void weighted_sum(const scalar_t* x, const float* w, int64_t stride, int64_t n, int64_t hidden, float* acc) {
  for (int64_t c = 0; c < hidden; ++c) acc[c] = w[0] * static_cast<float>(x[c]);
  for (int64_t j = 1; j < n; ++j) {
    const float weight = w[j * stride];
    const scalar_t* row = x + j * hidden;
    for (int64_t c = 0; c < hidden; ++c) acc[c] += weight * static_cast<float>(row[c]);
  }
}

// y[t] = sum_i weights[t, i] * X[t, i], accumulated in float32, cast to the streams' dtype.
template <typename scalar_t>
void collapse(const scalar_t* x, const float* weights, scalar_t* y, int64_t t, int64_t n, int64_t hidden,
              std::vector<float>& acc) {
  weighted_sum(x + t * n * hidden, weights + t * n, 1, n, hidden, acc.data());
  scalar_t* out = y + t * hidden;
  for (int64_t c = 0; c < hidden; ++c) out[c] = static_cast<scalar_t>(acc[c]);
}

void check_streams(const at::Tensor& streams, const char* op) {
  TORCH_CHECK(streams.device().is_cpu(), op, " runs on CPU tensors");
  TORCH_CHECK(streams.dim() >= 3, op, " needs streams [..., T, n, C]");
  const auto dtype = streams.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              " needs float32, bfloat16 or float16 streams");
}

// The streams' leading (token) dims followed by `last`.
std::vector<int64_t> lead_shape(const at::Tensor& streams, std::initializer_list<int64_t> last) {
  std::vector<int64_t> shape(streams.sizes().begin(), streams.sizes().end() - 2);
  shape.insert(shape.end(), last);
  return shape;
}

std::vector<at::Tensor> coeffs_pre(const at::Tensor& streams, const at::Tensor& fn, const at::Tensor& base,
                                   const at::Tensor& scale, int64_t iters, double eps, double norm_eps,
                                   int64_t residual_map, double post_magnitude) {
  check_streams(streams, "mhc_coeffs_pre");
  const int64_t n = streams.size(-2), hidden = streams.size(-1);
  const auto x = streams.contiguous();
  const int64_t tokens = x.numel() / (n * hidden);
  const int64_t n_comb = residual_map == kIdentity ? 0 : (residual_map == kPermutations ? fn.size(0) - 2 * n : n * n);
  TORCH_CHECK(fn.size(0) == 2 * n + n_comb && fn.size(1) == n * hidden, "mhc_coeffs_pre: fn has the wrong shape");
  const auto fn32 = float_contiguous(fn);
  const auto base32 = float_contiguous(base);
  const auto scale32 = float_contiguous(scale);
  const auto opts = x.options().dtype(at::kFloat);
  auto y = at::empty(lead_shape(streams, {hidden}), x.options());
  auto post = at::empty(lead_shape(streams, {n}), opts);
  auto comb = residual_map == kIdentity ? at::empty({0}, opts) : at::empty(lead_shape(streams, {n, n}), opts);
  std::vector<float> pre(tokens * n);
  const std::vector<int64_t> perms = residual_map == kPermutations ? permutations(n) : std::vector<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "mhc_coeffs_pre", [&] {
    const scalar_t* xs = x.data_ptr<scalar_t>();
    const std::vector<float> mix = map_logits<scalar_t>(xs, tokens, n * hidden, fn32, norm_eps);
    const int64_t m = fn32.size(0);
    const float* b = base32.data_ptr<float>();
    const float* s = scale32.data_ptr<float>();
    float* pre_ptr = pre.data();
    float* post_ptr = post.data_ptr<float>();
    float* comb_ptr = residual_map == kIdentity ? nullptr : comb.data_ptr<float>();
    const float e = static_cast<float>(eps), magnitude = static_cast<float>(post_magnitude);
    at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> weights(n_comb);
      for (int64_t t = begin; t < end; ++t) {
        const float* w = mix.data() + t * m;
        float* p = pre_ptr + t * n;
        float* q = post_ptr + t * n;
        if (residual_map == kUnconstrained) {
          float* c = comb_ptr + t * n * n;
          for (int64_t i = 0; i < n; ++i) p[i] = s[0] * std::tanh(w[i]) + b[i];
          for (int64_t i = 0; i < n; ++i) q[i] = s[1] * std::tanh(w[n + i]) + b[n + i];
          for (int64_t k = 0; k < n * n; ++k) c[k] = s[2] * std::tanh(w[2 * n + k]) + b[2 * n + k];
          continue;
        }
        for (int64_t i = 0; i < n; ++i) p[i] = sigmoid(w[i] * s[0] + b[i]) + e;
        if (residual_map == kIdentity) {
          for (int64_t i = 0; i < n; ++i) q[i] = magnitude * sigmoid(w[n + i] * s[1] + b[n + i]) + e;
          continue;
        }
        for (int64_t i = 0; i < n; ++i) q[i] = 2.0f * sigmoid(w[n + i] * s[1] + b[n + i]);
        float* c = comb_ptr + t * n * n;
        if (residual_map == kPermutations) {  // comb = sum_k softmax(z)_k P_k, P_k[i, perm_k[i]] = 1
          for (int64_t k = 0; k < n_comb; ++k) weights[k] = w[2 * n + k] * s[2] + b[2 * n + k];
          softmax(weights.data(), n_comb);
          std::fill(c, c + n * n, 0.0f);
          for (int64_t k = 0; k < n_comb; ++k)
            for (int64_t i = 0; i < n; ++i) c[i * n + perms[k * n + i]] += weights[k];
          continue;
        }
        for (int64_t k = 0; k < n * n; ++k) c[k] = w[2 * n + k] * s[2] + b[2 * n + k];
        sinkhorn(c, n, iters, e);
      }
      std::vector<float> acc(hidden);
      for (int64_t t = begin; t < end; ++t) collapse<scalar_t>(xs, pre_ptr, y.data_ptr<scalar_t>(), t, n, hidden, acc);
    });
  });
  return {y, post, comb};
}

at::Tensor head(const at::Tensor& streams, const at::Tensor& hc_fn, const at::Tensor& hc_base,
                const at::Tensor& hc_scale, double eps, double norm_eps) {
  check_streams(streams, "mhc_head");
  const int64_t n = streams.size(-2), hidden = streams.size(-1);
  const auto x = streams.contiguous();
  const int64_t tokens = x.numel() / (n * hidden);
  TORCH_CHECK(hc_fn.size(0) == n && hc_fn.size(1) == n * hidden, "mhc_head: hc_fn has the wrong shape");
  const auto fn32 = float_contiguous(hc_fn);
  const auto base32 = float_contiguous(hc_base);
  const float s = float_contiguous(hc_scale).data_ptr<float>()[0];
  auto y = at::empty(lead_shape(streams, {hidden}), x.options());
  std::vector<float> pre(tokens * n);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "mhc_head", [&] {
    const scalar_t* xs = x.data_ptr<scalar_t>();
    const std::vector<float> mix = map_logits<scalar_t>(xs, tokens, n * hidden, fn32, norm_eps);
    const float* b = base32.data_ptr<float>();
    float* pre_ptr = pre.data();
    const float e = static_cast<float>(eps);
    at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(hidden);
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t i = 0; i < n; ++i) pre_ptr[t * n + i] = sigmoid(mix[t * n + i] * s + b[i]) + e;
        collapse<scalar_t>(xs, pre_ptr, y.data_ptr<scalar_t>(), t, n, hidden, acc);
      }
    });
  });
  return y;
}

at::Tensor post_res(const at::Tensor& streams, const at::Tensor& y, const at::Tensor& post, const at::Tensor& comb,
                    bool identity) {
  check_streams(streams, "mhc_post_res");
  TORCH_CHECK(y.scalar_type() == streams.scalar_type(), "mhc_post_res: y needs the streams' dtype");
  const int64_t n = streams.size(-2), hidden = streams.size(-1);
  const auto x = streams.contiguous();
  const int64_t tokens = x.numel() / (n * hidden);
  TORCH_CHECK(y.numel() == tokens * hidden && post.numel() == tokens * n && (identity || comb.numel() == tokens * n * n),
              "mhc_post_res: y, post or comb does not match the streams' tokens");
  const auto y2 = y.contiguous();
  const auto post32 = float_contiguous(post);
  const auto comb32 = identity ? comb : float_contiguous(comb);
  auto out = at::empty(streams.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "mhc_post_res", [&] {
    const scalar_t* xs = x.data_ptr<scalar_t>();
    const scalar_t* ys = y2.data_ptr<scalar_t>();
    const float* ps = post32.data_ptr<float>();
    const float* cs = identity ? nullptr : comb32.data_ptr<float>();
    scalar_t* os = out.data_ptr<scalar_t>();
    at::parallel_for(0, tokens * n, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(hidden);
      for (int64_t row = begin; row < end; ++row) {  // row = (token, output stream i)
        const int64_t t = row / n, i = row % n;
        const scalar_t* xt = xs + t * n * hidden;
        const scalar_t* yt = ys + t * hidden;
        const float p = ps[t * n + i];
        scalar_t* o = os + row * hidden;
        if (identity) {
          for (int64_t c = 0; c < hidden; ++c)
            o[c] = static_cast<scalar_t>(static_cast<float>(xt[i * hidden + c]) + p * static_cast<float>(yt[c]));
          continue;
        }
        weighted_sum(xt, cs + t * n * n + i, n, n, hidden, acc.data());  // sum_j comb[j, i] X[j]
        for (int64_t c = 0; c < hidden; ++c) o[c] = static_cast<scalar_t>(acc[c] + p * static_cast<float>(yt[c]));
      }
    });
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("coeffs_pre", &coeffs_pre, "mHC site entry for a few tokens: (y, post, comb)");
  m.def("head", &head, "mHC head read-out for a few tokens: y");
  m.def("post_res", &post_res, "mHC stream merge for a few tokens: new streams");
}
