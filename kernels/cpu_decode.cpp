// hf-mhc's CPU decode kernels: one fused call per mHC site for a few tokens without autograd (greedy decoding).
//
// coeffs_pre: streams [T, n, C] -> y [T, C] (streams' dtype), post [T, n], comb [T, n, n] (float32; empty for the
//   identity map). flat_n = flat * rsqrt(mean(flat^2) + norm_eps); mix = flat_n @ fn.T (one GEMM); then per token
//   the residual map (0 sinkhorn, 1 unconstrained, 2 identity, 3 permutations) and y = sum_i pre[i] X[i].
// head: streams [T, n, C] -> y [T, C], pre_h = sigmoid(hc_scale * mix + hc_base) + eps.
// post_res: X'[i] = sum_j comb[j, i] X[j] + post[i] y (comb empty: X'[i] = X[i] + post[i] y), in float32, cast back.
// The formulas and their order of operations are those of hf_mhc/mhc_reference.py.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
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

// flat_n [T, n*C] float32: the RMS-normalised flattened streams. The squares are summed in kLanes float32 partial
// sums (which the compiler vectorises) added up in double.
constexpr int64_t kLanes = 16;

template <typename scalar_t>
at::Tensor normalized_flat(const at::Tensor& x, double norm_eps) {
  const int64_t tokens = x.size(0), width = x.size(1);
  auto out = at::empty({tokens, width}, x.options().dtype(at::kFloat));
  const scalar_t* src = x.data_ptr<scalar_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const scalar_t* row = src + t * width;
      float* out_row = dst + t * width;
      for (int64_t k = 0; k < width; ++k) out_row[k] = static_cast<float>(row[k]);
      float lanes[kLanes] = {};
      int64_t k = 0;
      for (; k + kLanes <= width; k += kLanes)
        for (int64_t l = 0; l < kLanes; ++l) lanes[l] += out_row[k + l] * out_row[k + l];
      double squares = 0.0;
      for (; k < width; ++k) squares += static_cast<double>(out_row[k]) * out_row[k];
      for (int64_t l = 0; l < kLanes; ++l) squares += lanes[l];
      const float mean = static_cast<float>(squares / static_cast<double>(width));
      const float rstd = 1.0f / std::sqrt(mean + static_cast<float>(norm_eps));
      for (k = 0; k < width; ++k) out_row[k] = out_row[k] * rstd;
    }
  });
  return out;
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

std::vector<int64_t> lead_shape(const at::Tensor& streams, int64_t last) {
  std::vector<int64_t> shape(streams.sizes().begin(), streams.sizes().end() - 2);
  shape.push_back(last);
  return shape;
}

std::vector<at::Tensor> coeffs_pre(const at::Tensor& streams, const at::Tensor& fn, const at::Tensor& base,
                                   const at::Tensor& scale, int64_t iters, double eps, double norm_eps,
                                   int64_t residual_map, double post_magnitude) {
  check_streams(streams, "mhc_coeffs_pre");
  const int64_t n = streams.size(-2), hidden = streams.size(-1);
  const auto x = streams.reshape({-1, n * hidden}).contiguous();
  const int64_t tokens = x.size(0);
  const int64_t n_comb = residual_map == kIdentity ? 0 : (residual_map == kPermutations ? fn.size(0) - 2 * n : n * n);
  TORCH_CHECK(fn.size(0) == 2 * n + n_comb && fn.size(1) == n * hidden, "mhc_coeffs_pre: fn has the wrong shape");
  const auto base32 = base.to(at::kFloat).contiguous();
  const auto scale32 = scale.to(at::kFloat).contiguous();
  const auto opts = x.options().dtype(at::kFloat);
  auto y = at::empty({tokens, hidden}, x.options());
  auto post = at::empty({tokens, n}, opts);
  auto comb = residual_map == kIdentity ? at::empty({0}, opts) : at::empty({tokens, n, n}, opts);
  auto pre = at::empty({tokens, n}, opts);
  const std::vector<int64_t> perms = residual_map == kPermutations ? permutations(n) : std::vector<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "mhc_coeffs_pre", [&] {
    const auto mix = at::mm(normalized_flat<scalar_t>(x, norm_eps), fn.to(at::kFloat).t());
    const int64_t m = mix.size(1);
    const float* mix_ptr = mix.data_ptr<float>();
    const float* b = base32.data_ptr<float>();
    const float* s = scale32.data_ptr<float>();
    float* pre_ptr = pre.data_ptr<float>();
    float* post_ptr = post.data_ptr<float>();
    float* comb_ptr = residual_map == kIdentity ? nullptr : comb.data_ptr<float>();
    const float e = static_cast<float>(eps), magnitude = static_cast<float>(post_magnitude);
    at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> weights(n_comb);
      for (int64_t t = begin; t < end; ++t) {
        const float* w = mix_ptr + t * m;
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
      for (int64_t t = begin; t < end; ++t)
        collapse<scalar_t>(x.data_ptr<scalar_t>(), pre_ptr, y.data_ptr<scalar_t>(), t, n, hidden, acc);
    });
  });
  auto comb_shape = lead_shape(streams, n);
  comb_shape.push_back(n);
  return {y.view(lead_shape(streams, hidden)), post.view(lead_shape(streams, n)),
          residual_map == kIdentity ? comb : comb.view(comb_shape)};
}

at::Tensor head(const at::Tensor& streams, const at::Tensor& hc_fn, const at::Tensor& hc_base,
                const at::Tensor& hc_scale, double eps, double norm_eps) {
  check_streams(streams, "mhc_head");
  const int64_t n = streams.size(-2), hidden = streams.size(-1);
  const auto x = streams.reshape({-1, n * hidden}).contiguous();
  const int64_t tokens = x.size(0);
  TORCH_CHECK(hc_fn.size(0) == n && hc_fn.size(1) == n * hidden, "mhc_head: hc_fn has the wrong shape");
  const auto base32 = hc_base.to(at::kFloat).contiguous();
  const float s = hc_scale.to(at::kFloat).item<float>();
  auto y = at::empty({tokens, hidden}, x.options());
  auto pre = at::empty({tokens, n}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "mhc_head", [&] {
    const auto mix = at::mm(normalized_flat<scalar_t>(x, norm_eps), hc_fn.to(at::kFloat).t());
    const float* mix_ptr = mix.data_ptr<float>();
    const float* b = base32.data_ptr<float>();
    float* pre_ptr = pre.data_ptr<float>();
    const float e = static_cast<float>(eps);
    at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> acc(hidden);
      for (int64_t t = begin; t < end; ++t) {
        for (int64_t i = 0; i < n; ++i) pre_ptr[t * n + i] = sigmoid(mix_ptr[t * n + i] * s + b[i]) + e;
        collapse<scalar_t>(x.data_ptr<scalar_t>(), pre_ptr, y.data_ptr<scalar_t>(), t, n, hidden, acc);
      }
    });
  });
  return y.view(lead_shape(streams, hidden));
}

at::Tensor post_res(const at::Tensor& streams, const at::Tensor& y, const at::Tensor& post, const at::Tensor& comb,
                    bool identity) {
  check_streams(streams, "mhc_post_res");
  TORCH_CHECK(y.scalar_type() == streams.scalar_type(), "mhc_post_res: y needs the streams' dtype");
  const int64_t n = streams.size(-2), hidden = streams.size(-1);
  const auto x = streams.reshape({-1, n, hidden}).contiguous();
  const int64_t tokens = x.size(0);
  const auto y2 = y.reshape({tokens, hidden}).contiguous();
  const auto post32 = post.to(at::kFloat).reshape({tokens, n}).contiguous();
  const auto comb32 = identity ? comb : comb.to(at::kFloat).reshape({tokens, n, n}).contiguous();
  auto out = at::empty_like(x);
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
  return out.view(streams.sizes());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("coeffs_pre", &coeffs_pre, "mHC site entry for a few tokens: (y, post, comb)");
  m.def("head", &head, "mHC head read-out for a few tokens: y");
  m.def("post_res", &post_res, "mHC stream merge for a few tokens: new streams");
}
