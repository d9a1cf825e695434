// sign's block codec on CPU in one pass per direction (ds_ext/comm/compressors.py,
// _SignCodec): a block's scale is its mean magnitude, each entry one bit (set: >= 0),
// the first entry of a byte in its top bit. In torch ops the same work is a pass for
// the scales, two for the packing, two for decoding and two for the residual. With
// target "momentum" the rank's momentum is formed in the encoding's pass (in torch ops
// four more passes and a finiteness check), M read as fp32 or as sign's own codes.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>

namespace {

void check_fp32(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous(),
              "sign_codec: ", what, " must be a contiguous fp32 CPU tensor");
}

// One block: its scale (mean magnitude, summed in double), its packed signs, and with
// `residual` v becomes v - decode (what the encoding held back). The sum runs in 8 lanes
// (entry i into lane i % 8, the lanes added pairwise), independent chains the compiler
// vectorises; a double sum of fp32 magnitudes is exact while they span under 2^21 (8 bits
// of headroom for 256 terms), so the order seldom shows even in the last bit of the scale.
inline void encode_block(float* v, int64_t block_size, float* scale, uint8_t* c, bool residual) {
  double lane[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
  for (int64_t i = 0; i < block_size; i += 8)
    for (int k = 0; k < 8; ++k) lane[k] += static_cast<double>(std::fabs(v[i + k]));
  const double sum = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
  const float s = static_cast<float>(sum / static_cast<double>(block_size));
  *scale = s;
  for (int64_t j = 0; j < block_size / 8; ++j) {
    uint8_t byte = 0;
    for (int bit = 0; bit < 8; ++bit) {
      const float e = v[j * 8 + bit];
      const bool up = e >= 0.0f;
      byte |= static_cast<uint8_t>(up) << (7 - bit);
      if (residual) v[j * 8 + bit] = e - (up ? s : -s);
    }
    c[j] = byte;
  }
}

// byte -> its 8 entries as +-1, so that each byte is 8 multiplies the compiler vectorises
const std::array<std::array<float, 8>, 256>& sign_table() {
  static const auto table = [] {
    std::array<std::array<float, 8>, 256> t{};
    for (int v = 0; v < 256; ++v)
      for (int bit = 0; bit < 8; ++bit) t[v][bit] = ((v >> (7 - bit)) & 1) ? 1.0f : -1.0f;
    return t;
  }();
  return table;
}

void check_codes(const torch::Tensor& codes) {
  TORCH_CHECK(codes.device().is_cpu() && codes.scalar_type() == torch::kUInt8 && codes.is_contiguous(),
              "sign_codec: codes must be a contiguous uint8 CPU tensor");
}

// x: [blocks * block_size]; writes scales [blocks] and codes [blocks * block_size / 8];
// with `residual`, x becomes x - decode(scales, codes) (what the encoding held back).
void encode(torch::Tensor x, torch::Tensor scales, torch::Tensor codes, int64_t block_size, bool residual) {
  check_fp32(x, "x");
  check_fp32(scales, "scales");
  check_codes(codes);
  TORCH_CHECK(block_size > 0 && block_size % 8 == 0, "sign_codec: block_size must be a multiple of 8");
  const int64_t blocks = scales.numel();
  TORCH_CHECK(x.numel() == blocks * block_size && codes.numel() == x.numel() / 8,
              "sign_codec: x, scales and codes disagree in size");
  float* xp = x.data_ptr<float>();
  float* sp = scales.data_ptr<float>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  at::parallel_for(0, blocks, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t k = b0; k < b1; ++k) encode_block(xp + k * block_size, block_size, sp + k, cp + k * (block_size / 8),
                                                   residual);
  });
}

// 1-bit Adam's momentum, formed and encoded in one pass: x[i] = local * g[i] + beta1 * m[i]
// (+ w[i] with a worker residual), each product and sum rounded to fp32 on its own (the
// torch ops of _SignCodec.encode_momentum, bit for bit), 0 past n; then each block
// encoded as `encode` does (a non-finite x makes its block's scale non-finite).
void encode_momentum(torch::Tensor g, torch::Tensor m, torch::Tensor w, torch::Tensor x, torch::Tensor scales,
                     torch::Tensor codes, int64_t block_size, double local, double beta1, bool residual) {
  check_fp32(g, "g");
  check_fp32(m, "m");
  check_fp32(x, "x");
  check_fp32(scales, "scales");
  check_codes(codes);
  const bool has_w = w.numel() > 0;
  if (has_w) check_fp32(w, "w");
  const int64_t n = g.numel(), blocks = scales.numel();
  TORCH_CHECK(block_size > 0 && block_size % 8 == 0, "sign_codec: block_size must be a multiple of 8");
  TORCH_CHECK(m.numel() == n && (!has_w || w.numel() >= n) && x.numel() == blocks * block_size && x.numel() >= n &&
                  codes.numel() == x.numel() / 8,
              "sign_codec: g, m, w, x, scales and codes disagree in size");
  const float* gp = g.data_ptr<float>();
  const float* mp = m.data_ptr<float>();
  const float* wp = has_w ? w.data_ptr<float>() : nullptr;
  float* xp = x.data_ptr<float>();
  float* sp = scales.data_ptr<float>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  const float lf = static_cast<float>(local), bf = static_cast<float>(beta1);
  at::parallel_for(0, blocks, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t k = b0; k < b1; ++k) {
      float* v = xp + k * block_size;
      const int64_t start = k * block_size, stop = std::min(n, start + block_size);
      for (int64_t i = start; i < stop; ++i) {
        const float a = lf * gp[i];
        const float b = bf * mp[i];
        float e = a + b;
        if (has_w) e = e + wp[i];
        v[i - start] = e;
      }
      for (int64_t i = std::max(stop, start); i < start + block_size; ++i) v[i - start] = 0.0f;
      encode_block(v, block_size, sp + k, cp + k * (block_size / 8), residual);
    }
  });
}

// encode_momentum with M kept as sign itself keeps it after the all-gather: m_scales [blocks]
// and m_codes [blocks * block_size / 8] on x's own block grid (the server's segments laid
// end to end), so M's entry i is +-m_scales[i / block_size], the value decode gives, and
// x is bit for bit what encode_momentum makes of the decoded M. M is read at 1 bit an
// entry instead of 32.
void encode_momentum_packed(torch::Tensor g, torch::Tensor m_scales, torch::Tensor m_codes, torch::Tensor w,
                            torch::Tensor x, torch::Tensor scales, torch::Tensor codes, int64_t block_size,
                            double local, double beta1, bool residual) {
  check_fp32(g, "g");
  check_fp32(m_scales, "m_scales");
  check_codes(m_codes);
  check_fp32(x, "x");
  check_fp32(scales, "scales");
  check_codes(codes);
  const bool has_w = w.numel() > 0;
  if (has_w) check_fp32(w, "w");
  const int64_t n = g.numel(), blocks = scales.numel();
  TORCH_CHECK(block_size > 0 && block_size % 8 == 0, "sign_codec: block_size must be a multiple of 8");
  TORCH_CHECK(m_scales.numel() == blocks && m_codes.numel() == x.numel() / 8 && (!has_w || w.numel() >= n) &&
                  x.numel() == blocks * block_size && x.numel() >= n && codes.numel() == x.numel() / 8,
              "sign_codec: g, m_scales, m_codes, w, x, scales and codes disagree in size");
  const float* gp = g.data_ptr<float>();
  const float* msp = m_scales.data_ptr<float>();
  const uint8_t* mcp = m_codes.data_ptr<uint8_t>();
  const float* wp = has_w ? w.data_ptr<float>() : nullptr;
  float* xp = x.data_ptr<float>();
  float* sp = scales.data_ptr<float>();
  uint8_t* cp = codes.data_ptr<uint8_t>();
  const float lf = static_cast<float>(local), bf = static_cast<float>(beta1);
  const auto& table = sign_table();
  at::parallel_for(0, blocks, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t k = b0; k < b1; ++k) {
      float* v = xp + k * block_size;
      const int64_t start = k * block_size, stop = std::min(n, start + block_size);
      // b1 x (+-s) is +-(b1 x s) exactly: the table's +-1 times b1 x s, 8 entries a byte
      const float up = bf * msp[k];
      const uint8_t* c = mcp + k * (block_size / 8);
      const float* gk = gp + start;
      const float* wk = has_w ? wp + start : nullptr;
      if (stop - start == block_size) {
        for (int64_t j = 0; j < block_size / 8; ++j) {
          const float* t = table[c[j]].data();
          if (has_w) {
            for (int bit = 0; bit < 8; ++bit) v[j * 8 + bit] = (lf * gk[j * 8 + bit] + t[bit] * up) + wk[j * 8 + bit];
          } else {
            for (int bit = 0; bit < 8; ++bit) v[j * 8 + bit] = lf * gk[j * 8 + bit] + t[bit] * up;
          }
        }
      } else {
        for (int64_t i = 0; i < block_size; ++i) {
          if (start + i >= stop) {
            v[i] = 0.0f;
            continue;
          }
          float e = lf * gk[i] + table[c[i >> 3]][i & 7] * up;
          if (has_w) e = e + wk[i];
          v[i] = e;
        }
      }
      encode_block(v, block_size, sp + k, cp + k * (block_size / 8), residual);
    }
  });
}

// out [blocks * block_size] = (accumulate: +=) factor x decode(scales, codes).
void decode(torch::Tensor scales, torch::Tensor codes, torch::Tensor out, int64_t block_size, bool accumulate,
            double factor) {
  check_fp32(scales, "scales");
  check_fp32(out, "out");
  check_codes(codes);
  const int64_t blocks = scales.numel();
  TORCH_CHECK(out.numel() == blocks * block_size && codes.numel() == out.numel() / 8,
              "sign_codec: out, scales and codes disagree in size");
  const float* sp = scales.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const float f = static_cast<float>(factor);
  const auto& table = sign_table();
  at::parallel_for(0, blocks, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t k = b0; k < b1; ++k) {
      const float s = sp[k] * f;
      const uint8_t* c = cp + k * (block_size / 8);
      float* o = op + k * block_size;
      if (accumulate) {
        for (int64_t j = 0; j < block_size / 8; ++j) {
          const float* t = table[c[j]].data();
          for (int bit = 0; bit < 8; ++bit) o[j * 8 + bit] += t[bit] * s;
        }
      } else {
        for (int64_t j = 0; j < block_size / 8; ++j) {
          const float* t = table[c[j]].data();
          for (int bit = 0; bit < 8; ++bit) o[j * 8 + bit] = t[bit] * s;
        }
      }
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("encode", &encode, "sign: block scales, packed signs and (optionally) the residual in place");
  m.def("encode_momentum", &encode_momentum,
        "sign: local x g + beta1 x m (+ the worker residual) formed and encoded in one pass");
  m.def("encode_momentum_packed", &encode_momentum_packed,
        "sign: encode_momentum with M given as sign's own scales and codes");
  m.def("decode", &decode, "sign: decode (or decode and add) scaled signs");
}
