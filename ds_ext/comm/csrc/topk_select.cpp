// One pass over a gradient chunk for sampled top-k with error feedback on CPU:
// acc = y + x (last step's error-feedback residual plus the gradient), written to `out`, and
// the positions whose |acc| reaches the sampled threshold collected. The same work
// in torch ops takes five passes over the chunk (add, abs, compare, nonzero, and a
// sum for the finiteness check); on a CPU these passes are the cost of compression.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace {

// Positions i with !(|acc[i]| < threshold): NaN always qualifies, so a non-finite
// gradient reaches the payload. Returns (indices int64 ascending, any non-finite).
std::tuple<torch::Tensor, bool> accumulate_select(const torch::Tensor& x, const c10::optional<torch::Tensor>& y,
                                                  const c10::optional<torch::Tensor>& out,
                                                  double threshold) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.dim() == 1,
              "accumulate_select: x must be a contiguous 1-D fp32 CPU tensor");
  const int64_t n = x.numel();
  const float* xp = x.data_ptr<float>();
  const float* yp = nullptr;
  float* op = nullptr;
  if (y.has_value()) {
    TORCH_CHECK(out.has_value(), "accumulate_select: y needs out");
    for (const torch::Tensor* t : {&y.value(), &out.value()}) {
      TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == torch::kFloat32 && t->is_contiguous() &&
                      t->dim() == 1 && t->numel() == n,
                  "accumulate_select: y and out must be contiguous 1-D fp32 CPU tensors the size of x");
    }
    TORCH_CHECK(out->data_ptr() != x.data_ptr() && out->data_ptr() != y->data_ptr(),
                "accumulate_select: out must not alias x or y");
    yp = y->data_ptr<float>();
    op = out->data_ptr<float>();
  }
  TORCH_CHECK(y.has_value() || !out.has_value(), "accumulate_select: out is written only with y");
  const float t = static_cast<float>(threshold);
  const int64_t grain = 1 << 16;
  const int64_t blocks = (n + grain - 1) / grain;
  std::vector<std::vector<int64_t>> found(blocks);
  std::vector<char> bad(blocks, 0);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t lo = b * grain, hi = std::min(n, lo + grain);
      std::vector<int64_t>& hits = found[b];
      bool nonfinite = false;
      if (yp != nullptr) {
        for (int64_t i = lo; i < hi; ++i) {
          const float v = yp[i] + xp[i];
          op[i] = v;
          nonfinite |= !std::isfinite(v);
          if (!(std::fabs(v) < t)) hits.push_back(i);
        }
      } else {
        for (int64_t i = lo; i < hi; ++i) {
          const float v = xp[i];
          nonfinite |= !std::isfinite(v);
          if (!(std::fabs(v) < t)) hits.push_back(i);
        }
      }
      bad[b] = nonfinite;
    }
  });
  int64_t total = 0;
  bool any_bad = false;
  for (int64_t b = 0; b < blocks; ++b) {
    total += static_cast<int64_t>(found[b].size());
    any_bad |= bad[b] != 0;
  }
  auto idx = torch::empty({total}, torch::kInt64);
  int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t b = 0; b < blocks; ++b) {
    std::copy(found[b].begin(), found[b].end(), ip);
    ip += found[b].size();
  }
  return {idx, any_bad};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("accumulate_select", &accumulate_select, "out = y + x; positions where |out| (or |x| without y) is not below threshold",
        py::arg("x"), py::arg("y"), py::arg("out"), py::arg("threshold"));
}
