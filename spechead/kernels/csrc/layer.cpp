// The decoder layer's row-wise ops and the layers themselves as one op: rms_norm, silu_mul (SiLU(gate) * up) and
// decoder_layers, which runs every layer (Llama's, or Gemma 3's with its extra norms, GELU and sliding windows) over
// a few rows of several requests with draft_linear (gemm.cpp) or qlinear (qgemm.cpp) and the attention plans
// (attention.cpp).
//
// Row-count property: rms_norm and silu_mul compute each row alone in one fixed order, and a layer is made of
// ops that do (the GEMM, attention over each row's own visible slots), so a row's result bits do not depend on how
// many rows or requests share the call.
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>  // GeGLU's product
#include <ATen/ops/gelu.h>

#include <algorithm>
#include <tuple>
#include <utility>
#include <vector>

#include "ops.h"

namespace SPECHEAD_NS {
namespace {

// silu(g) given e = exp(-|g|); both sides computed: a select, no branch
inline float silu_from(float g, float e) {
  const float d = 1.0f + e, pos = g / d, neg = (g * e) / d;
  return g >= 0.0f ? pos : neg;
}

inline float silu1_exp(float g) {  // exp(-|g|) as silu_mul's vectors give it, for one value
#if defined(SPECHEAD_ISA_AVX512) || defined(SPECHEAD_ISA_AVX2)
  float buf[W] = {};
  buf[0] = -std::fabs(g);
  vstore(buf, vexp_nonpositive(vload(buf)));
  return buf[0];
#else
  return std::exp(-std::fabs(g));
#endif
}

at::Tensor narrow_cols(const at::Tensor& y, int64_t n) { return y.size(1) == n ? y : y.narrow(1, 0, n).contiguous(); }

}  // namespace

at::Tensor project(const at::Tensor& x, at::TensorList w, int64_t n) {
  TORCH_CHECK(w.size() == 1 || w.size() == 3, "project: a weight is one blocked tensor or (data, scale, min)");
  if (w.size() == 3) return qlinear(x, w[0], w[1], w[2], n);
  return narrow_cols(draft_linear(x, w[0], (n + kLanes - 1) / kLanes), n);
}

namespace {

// One row of rms_norm: the sum of squares in one fixed order (W-lane FMA chains, then the tail in double), then
// (x * scale) * w.
inline void rms_norm_row(const float* row, const float* pw, float* out, int64_t D, double eps) {
  Vec acc = vzero();
  int64_t i = 0;
  for (; i + W <= D; i += W) {
    const Vec v = vload(row + i);
    acc = vfma(v, v, acc);
  }
  double ss = vsum(acc);
  for (; i < D; ++i) ss += static_cast<double>(row[i]) * row[i];
  const float scale = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(D) + eps));
  const Vec sv = vset1(scale);
  i = 0;
  for (; i + W <= D; i += W) {
    const Vec v = vload(row + i);
    Vec t = vfma(v, sv, vzero());
    vstore(out + i, vfma(t, vload(pw + i), vzero()));
  }
  for (; i < D; ++i) out[i] = (row[i] * scale) * pw[i];
}

// x: contiguous 2-D fp32 rows; w (where given): a contiguous fp32 vector of x's width
void check_norm(const char* op, const at::Tensor& x, const at::Tensor* w) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous(), op,
              ": x must be a contiguous 2-D fp32 CPU tensor");
  if (w != nullptr)
    TORCH_CHECK(w->dim() == 1 && w->numel() == x.size(1) && w->scalar_type() == at::kFloat && w->is_contiguous(),
                op, ": w must be a contiguous fp32 vector of ", x.size(1), " values");
}

}  // namespace

// y = x / sqrt(mean(x^2) + eps) * w for fp32 rows. A decode step runs 61 of these on 576-wide rows; torch's CPU
// rms_norm is several ops (~12-35 us each call), this is one pass of a few microseconds. Rows are independent and
// each is summed in one fixed order, so a row's result does not depend on how many rows come with it.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_norm("rms_norm", x, &w);
  const int64_t R = x.size(0), D = x.size(1);
  at::Tensor y = at::empty_like(x);
  const float* px = x.data_ptr<float>();
  float* py = y.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) rms_norm_row(px + r * D, w.data_ptr<float>(), py + r * D, D, eps);
  return y;
}

// The residual sum h = x + a and, where w is given, rms_norm(h, w), in one pass over the rows: x + a as ATen's add
// forms it (one rounded sum an element), so the pair is bitwise (x + a, rms_norm(x + a, w)).
std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& a, const at::Tensor* w,
                                               double eps) {
  check_norm("add_rms_norm", x, w);
  TORCH_CHECK(a.sizes() == x.sizes() && a.scalar_type() == at::kFloat && a.is_contiguous(),
              "add_rms_norm: a must be a contiguous fp32 tensor of x's shape");
  const int64_t R = x.size(0), D = x.size(1);
  at::Tensor h = at::empty_like(x), y = w != nullptr ? at::empty_like(x) : h;
  const float* px = x.data_ptr<float>();
  const float* pa = a.data_ptr<float>();
  float* ph = h.data_ptr<float>();
  for (int64_t i = 0; i < R * D; ++i) ph[i] = px[i] + pa[i];
  if (w != nullptr)
    for (int64_t r = 0; r < R; ++r) rms_norm_row(ph + r * D, w->data_ptr<float>(), y.data_ptr<float>() + r * D, D, eps);
  return {h, y};
}

// gu [R, 2I] (the fused gate / up projection) -> [R, I]. silu(g) = g / (1 + e^-g), computed from e = exp(-|g|) so
// the exponential never overflows: g / (1 + e) for g >= 0, g e / (1 + e) below. One pass instead of three ops;
// the MLP uses it for every fp32 row where the kernels run, so a row's result never depends on the path it took.
at::Tensor silu_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0 && gu.scalar_type() == at::kFloat && gu.device().is_cpu() &&
                  gu.stride(1) == 1,
              "silu_mul: gu must be fp32 [R, 2I] CPU rows with unit inner stride");
  const int64_t R = gu.size(0), I = gu.size(1) / 2, ld = gu.stride(0);
  at::Tensor y = at::empty({R, I}, gu.options().memory_format(at::MemoryFormat::Contiguous));
  const float* pg = gu.data_ptr<float>();
  float* py = y.data_ptr<float>();
  // Per row, a vector at a time: e = exp(-|g|), then both sides of the select and the product with up, so that
  // every lane gets what the scalar expression (the tail's) gives: IEEE division and products, the same exp. A
  // data-dependent branch per element cost ~5 ns of mispredictions (3.7 ms of a 16-row forward of the demo
  // target); the scalar loop, which GCC does not vectorise, ~10 us a decode step's layer.
  at::parallel_for(0, R, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = pg + r * ld;
      const float* u = g + I;
      float* o = py + r * I;
      int64_t j = 0;
#if defined(SPECHEAD_ISA_AVX512) || defined(SPECHEAD_ISA_AVX2)
      for (; j + W <= I; j += W) {
        const Vec gv = vload(g + j), ev = vexp_nonpositive(vneg_abs(gv)), d = vadd(vset1(1.0f), ev);
        vstore(o + j, vmul(vselect_nonneg(gv, vdiv(gv, d), vdiv(vmul(gv, ev), d)), vload(u + j)));
      }
#endif
      for (; j < I; ++j) o[j] = silu_from(g[j], silu1_exp(g[j])) * u[j];
    }
  });
  return y;
}

namespace {

// One layer's tensors as decoder_layers takes them; a norm the layer lacks is an empty tensor.
struct LayerWeights {
  at::Tensor ln1, ln2, pre_ff, post_ff, q_norm, k_norm, k_cache, v_cache;
  at::TensorList qkv, o, gate_up, down;
};

constexpr int64_t kLayerNorms = 6;  // ln1, ln2, pre_ff, post_ff, q_norm, k_norm; then the two caches

// What Block.forward does for fp32 rows when the kernels run, as one function, from the layer's input x and its
// input norm xn (x itself where the layer has none): the fused q/k/v projection, Gemma's q / k head norms,
// attention per request (plan_attend over the requests' rows, run_plans), the output projection and residual
// (Gemma: the attention output normed first), the MLP's norm, the fused gate/up projection, SiLU(gate) * up or the
// tanh GELU's, and the down projection (Gemma: normed). Returns (h, m): the layer's output is h + m, which the
// caller sums together with the next layer's input norm. The same functions in the same order as the module path
// (ATen's gelu and product where the modules call them), so the two give bitwise the same rows.
std::pair<at::Tensor, at::Tensor> decoder_layer(const at::Tensor& x, const at::Tensor& xn, const LayerWeights& L,
                                                double eps, at::IntArrayRef widths, bool gelu,
                                                std::vector<AttendRows>& rows, at::IntArrayRef row0, double scale) {
  const int64_t T = x.size(0), D = rows[0].D, KV = L.k_cache.size(1), d = x.size(1);
  const int64_t nq = widths[0] - 2 * KV * D, I = widths[2] / 2;
  TORCH_CHECK(nq > 0 && nq % D == 0 && widths[1] == d && widths[3] == d, "decoder_layers: widths do not fit the cache");
  const at::Tensor qkv = project(xn, L.qkv, widths[0]);
  const float* pqkv = qkv.data_ptr<float>();
  const float *q = pqkv, *k = pqkv + nq, *v = pqkv + nq + KV * D;
  int64_t ldq = qkv.stride(0), ldk = ldq;
  at::Tensor qn, kn;
  if (L.q_norm.numel() > 0) {  // each head's query and key normed before RoPE
    qn = rms_norm(qkv.narrow(1, 0, nq).reshape({T * (nq / D), D}).contiguous(), L.q_norm, eps);
    kn = rms_norm(qkv.narrow(1, nq, KV * D).reshape({T * KV, D}).contiguous(), L.k_norm, eps);
    q = qn.data_ptr<float>(), k = kn.data_ptr<float>(), ldq = nq, ldk = KV * D;
  }
  at::Tensor att = at::empty({T, nq}, x.options());
  // every request's attention planned, then all their tasks in one parallel loop (run_plans)
  std::vector<AttendPlan> plans;
  plans.reserve(rows.size());
  const int64_t min_tasks = rows.size() == 1 ? 2 * at::get_num_threads() : 1;
  at::Tensor k_cache = L.k_cache, v_cache = L.v_cache;  // handles: plan_attend writes the rows' keys and values
  for (size_t p = 0; p < rows.size(); ++p) {
    const int64_t r0 = row0[p];
    plans.push_back(plan_attend(rows[p], q + r0 * ldq, ldq, k + r0 * ldk, ldk, v + r0 * qkv.stride(0),
                                qkv.stride(0), nq / D, k_cache, v_cache, scale, att.data_ptr<float>() + r0 * nq,
                                min_tasks));
  }
  run_plans(plans);
  const bool sandwich = L.pre_ff.numel() > 0;
  const at::Tensor a = project(att, L.o, d);
  const at::Tensor& ff_norm = sandwich ? L.pre_ff : L.ln2;
  const auto [h, hn] = add_rms_norm(x, sandwich ? rms_norm(a, L.ln2, eps) : a, &ff_norm, eps);
  const at::Tensor gu = project(hn, L.gate_up, widths[2]);
  const at::Tensor act = gelu ? at::gelu(gu.narrow(1, 0, I), "tanh") * gu.narrow(1, I, I) : silu_mul(gu);
  const at::Tensor m = project(act, L.down, d);
  return {h, sandwich ? rms_norm(m, L.post_ff, eps) : m};
}

}  // namespace

// The decoder layers over a few rows, one op a forward: decoder_layer for each layer in turn. ``layers`` holds, per
// layer, its six norms (ln1, ln2, pre_ff, post_ff, q_norm, k_norm; empty where it has none), the k and v caches,
// then the q/k/v, output, gate/up and down weights of ``per_weight`` tensors each (1: blocked fp32 / bf16, 3:
// quantized data, scale, min). A layer i with local[i] (Gemma's sliding window) attends with the local rotary,
// masks and first slots. Returns the inputs of the layers in ``keep`` (EAGLE-3's features), then the last layer's
// output. What this saves is the Python-level work: a call a layer of ~20 arguments each (~30 us a layer, 1 ms of
// a 10 ms decode step of the demo target on an AMD EPYC Zen 3), and for Gemma ~25 module-level calls a layer. Each
// request's rotary rows and visible slots are worked out once a forward (attend_rows), not once a layer, and a
// residual sum is formed in the pass that norms it for the next layer (add_rms_norm).
std::vector<at::Tensor> decoder_layers(const at::Tensor& x, at::TensorList layers, int64_t per_weight, double eps,
                                       at::IntArrayRef widths, bool gelu, at::IntArrayRef local, const at::Tensor& cos,
                                       const at::Tensor& sin, const at::Tensor& local_cos,
                                       const at::Tensor& local_sin, at::IntArrayRef row0, at::IntArrayRef rows,
                                       at::IntArrayRef lanes, at::IntArrayRef starts,
                                       const c10::List<std::optional<at::Tensor>>& masks, at::IntArrayRef kv_from,
                                       const c10::List<std::optional<at::Tensor>>& local_masks,
                                       at::IntArrayRef local_kv_from, double scale, at::IntArrayRef keep) {
  TORCH_CHECK(per_weight == 1 || per_weight == 3, "decoder_layers: a weight is 1 (blocked) or 3 (quantized) tensors");
  TORCH_CHECK(widths.size() == 4, "decoder_layers: widths = (qkv, o, gate_up, down) output features");
  const int64_t per_layer = kLayerNorms + 2 + 4 * per_weight, n = static_cast<int64_t>(layers.size()) / per_layer;
  TORCH_CHECK(n >= 1 && n * per_layer == static_cast<int64_t>(layers.size()),
              "decoder_layers: layers must hold 6 norms, the k and v caches and 4 weights of ", per_weight,
              " tensors for each layer");
  TORCH_CHECK(static_cast<int64_t>(local.size()) == n, "decoder_layers: one local flag per layer");
  for (const int64_t k : keep) TORCH_CHECK(0 <= k && k < n, "decoder_layers: keep names layer ", k, " of ", n);
  const size_t P = row0.size();
  TORCH_CHECK(rows.size() == P && lanes.size() == P && starts.size() == P && masks.size() == P &&
                  kv_from.size() == P && local_masks.size() == P && local_kv_from.size() == P && P >= 1,
              "decoder_layers: one row0 / rows / lane / start / mask / kv_from per request");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "decoder_layers: x must be fp32 rows");
  for (size_t p = 0; p < P; ++p)
    TORCH_CHECK(row0[p] >= 0 && rows[p] >= 1 && row0[p] + rows[p] <= x.size(0),
                "decoder_layers: a request's rows are out of range of x's ", x.size(0), " rows");
  std::vector<AttendRows> global_rows, local_rows;
  const bool any_local = std::any_of(local.begin(), local.end(), [](int64_t f) { return f != 0; });
  for (size_t p = 0; p < P; ++p) {
    global_rows.push_back(attend_rows(cos, sin, row0[p], rows[p], lanes[p], starts[p], masks.get(p), kv_from[p]));
    if (any_local)
      local_rows.push_back(attend_rows(local_cos, local_sin, row0[p], rows[p], lanes[p], starts[p],
                                       local_masks.get(p), local_kv_from[p]));
  }
  const auto weights = [&](int64_t i) {
    const at::TensorList l = layers.slice(static_cast<size_t>(i * per_layer), static_cast<size_t>(per_layer));
    const auto w = [&](int64_t j) {
      return l.slice(static_cast<size_t>(kLayerNorms + 2 + j * per_weight), static_cast<size_t>(per_weight));
    };
    return LayerWeights{l[0], l[1], l[2], l[3], l[4], l[5], l[6], l[7], w(0), w(1), w(2), w(3)};
  };
  std::vector<at::Tensor> out(keep.size() + 1);
  LayerWeights L = weights(0);
  at::Tensor h = x.contiguous(), hn = L.ln1.numel() > 0 ? rms_norm(h, L.ln1, eps) : h;
  for (int64_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < keep.size(); ++j)
      if (keep[j] == i) out[j] = h;
    const auto [res, m] = decoder_layer(h, hn, L, eps, widths, gelu, local[i] ? local_rows : global_rows, row0, scale);
    if (i + 1 < n) L = weights(i + 1);
    const bool norm_next = i + 1 < n && L.ln1.numel() > 0;
    std::tie(h, hn) = add_rms_norm(res, m, norm_next ? &L.ln1 : nullptr, eps);
  }
  out.back() = h;
  return out;
}

}  // namespace SPECHEAD_NS
