// The row-sparse optimizer formulas of jaxembed/optim/formulas.py, one touched row at a time.
//
// Same float32 arithmetic in the same order as the jnp code (the library is built with
// -ffp-contract=off, so no multiply-add is fused where jnp rounds twice). The hyperparameters
// arrive already rounded to float32 the way jnp rounds a Python float against a float32 array
// (`1.0 - b1` is computed in Python, then rounded); the learning rate and the bias corrections
// come from JAX as float32 scalars, evaluated at `count`.

#ifndef JAXEMBED_KERNELS_NATIVE_FORMULAS_H_
#define JAXEMBED_KERNELS_NATIVE_FORMULAS_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string_view>

#include "common.h"

namespace jaxembed {

// kAdagrad is optax's adagrad (eps inside the root, no step where s = 0); kFbgemmAdagrad is
// FBGEMM's EXACT_ADAGRAD (eps added to √s).
enum class Formula {
  kSgd,
  kAdagrad,
  kFbgemmAdagrad,
  kRowwiseAdagrad,
  kAdam,
  kPartialRowwiseAdam,
  kFtrl
};

inline bool ParseFormula(std::string_view name, Formula* out) {
  static constexpr std::pair<std::string_view, Formula> kNames[] = {
      {"sgd", Formula::kSgd},
      {"adagrad", Formula::kAdagrad},
      {"fbgemm_adagrad", Formula::kFbgemmAdagrad},
      {"rowwise_adagrad", Formula::kRowwiseAdagrad},
      {"adam", Formula::kAdam},
      {"partial_rowwise_adam", Formula::kPartialRowwiseAdam},
      {"ftrl", Formula::kFtrl},
  };
  for (const auto& [n, f] : kNames) {
    if (n == name) {
      *out = f;
      return true;
    }
  }
  return false;
}

// The state slots of each formula: how many, and whether each is one float per row.
inline int NumSlots(Formula f) {
  switch (f) {
    case Formula::kSgd:
      return 0;
    case Formula::kAdagrad:
    case Formula::kFbgemmAdagrad:
    case Formula::kRowwiseAdagrad:
      return 1;
    default:
      return 2;
  }
}
inline bool SlotPerRow(Formula f, int slot) {
  return (f == Formula::kRowwiseAdagrad && slot == 0) ||
         (f == Formula::kPartialRowwiseAdam && slot == 1);
}

struct Hyper {
  // From the scalars buffer, f32[3]: lr(count), 1 - b1^t, 1 - b2^t.
  float lr, bc1, bc2;
  // Attributes.
  float weight_decay;  // sgd, rowwise_adagrad (applied only when has_weight_decay), adam's wd
  bool has_weight_decay, decoupled;
  float eps, b1, one_minus_b1, b2, one_minus_b2;
  float hidden;  // the global H, for row means
  // FTRL: q = -learning_rate_power; power_mode 0: q == 0, 1: q == 0.5, 2: otherwise.
  float q, l1, two_l2, beta;
  int power_mode;
};

// Σ_h x[h]² over one row (the row_sum of the jnp code; XLA may add in another order).
inline float SumSquares(const float* g, int64_t H) {
  float s = 0.0f;
  for (int64_t h = 0; h < H; ++h) s += g[h] * g[h];
  return s;
}

// One touched row: w (f32[H], in place), its summed gradient g (f32[H], clobbered), its state
// s0, s1 (f32[H] or f32[1] per the formula's slots, in place).
template <Formula F>
inline void UpdateRow(float* __restrict w, float* __restrict g, float* __restrict s0,
                      float* __restrict s1, const Hyper& p, int64_t H) {
  const float lr = p.lr;
  if constexpr (F == Formula::kSgd) {
    if (p.has_weight_decay) {
      for (int64_t h = 0; h < H; ++h) g[h] = g[h] + p.weight_decay * w[h];
    }
    for (int64_t h = 0; h < H; ++h) w[h] = w[h] - lr * g[h];
  } else if constexpr (F == Formula::kAdagrad) {
    // optax: r = where(s > 0, rsqrt(s + eps), 0);  w + (-lr)·(r·g).
    for (int64_t h = 0; h < H; ++h) {
      float s = s0[h] + g[h] * g[h];
      s0[h] = s;
      const float r = s > 0.0f ? 1.0f / std::sqrt(s + p.eps) : 0.0f;
      w[h] = w[h] - lr * (r * g[h]);
    }
  } else if constexpr (F == Formula::kFbgemmAdagrad) {
    for (int64_t h = 0; h < H; ++h) {
      float s = s0[h] + g[h] * g[h];
      s0[h] = s;
      w[h] = w[h] - lr * g[h] / (std::sqrt(s) + p.eps);
    }
  } else if constexpr (F == Formula::kRowwiseAdagrad) {
    if (p.has_weight_decay && !p.decoupled) {
      for (int64_t h = 0; h < H; ++h) g[h] = g[h] + p.weight_decay * w[h];
    }
    const float s = s0[0] + SumSquares(g, H) / p.hidden;
    s0[0] = s;
    const float multiplier = lr / (std::sqrt(s) + p.eps);
    if (p.has_weight_decay && p.decoupled) {
      const float c = 1.0f - lr * p.weight_decay;
      for (int64_t h = 0; h < H; ++h) w[h] = c * w[h];
    }
    for (int64_t h = 0; h < H; ++h) w[h] = w[h] - multiplier * g[h];
  } else if constexpr (F == Formula::kAdam) {
    for (int64_t h = 0; h < H; ++h) {
      float m = p.b1 * s0[h] + p.one_minus_b1 * g[h];
      float v = p.b2 * s1[h] + p.one_minus_b2 * (g[h] * g[h]);
      s0[h] = m;
      s1[h] = v;
      float v_root = std::sqrt(v / p.bc2);
      float m_hat = m / p.bc1;
      w[h] = w[h] - lr * (m_hat / (v_root + p.eps) + p.weight_decay * w[h]);
    }
  } else if constexpr (F == Formula::kPartialRowwiseAdam) {
    const float v = p.b2 * s1[0] + p.one_minus_b2 * (SumSquares(g, H) / p.hidden);
    s1[0] = v;
    const float v_root = std::sqrt(v / p.bc2);
    for (int64_t h = 0; h < H; ++h) {
      float m = p.b1 * s0[h] + p.one_minus_b1 * g[h];
      s0[h] = m;
      float m_hat = m / p.bc1;
      w[h] = w[h] - lr * (m_hat / (v_root + p.eps) + p.weight_decay * w[h]);
    }
  } else {  // kFtrl: s0 = n (accumulator), s1 = z (linear)
    for (int64_t h = 0; h < H; ++h) {
      const float n = s0[h];
      const float g2 = g[h] * g[h];
      const float n_new = n + g2;
      float increase;  // n_new^q - n^q
      if (p.power_mode == 0) {
        increase = 0.0f;
      } else if (p.power_mode == 1) {
        increase = n_new > 0.0f ? g2 / (std::sqrt(n_new) + std::sqrt(n)) : 0.0f;
      } else {
        increase = n > 0.0f ? std::pow(n, p.q) * std::expm1(p.q * std::log1p(g2 / n))
                            : std::pow(n_new, p.q);
      }
      const float z = (s1[h] + g[h]) - increase / lr * w[h];
      const float root = p.power_mode == 1 ? std::sqrt(n_new)
                         : p.power_mode == 0 ? 1.0f
                                             : std::pow(n_new, p.q);
      const float quadratic = (root / lr + p.two_l2) + p.beta / lr;
      const float clipped = std::min(std::max(z, -p.l1), p.l1);
      s0[h] = n_new;
      s1[h] = z;
      w[h] = (clipped - z) / quadratic;
    }
  }
}

}  // namespace jaxembed

#endif  // JAXEMBED_KERNELS_NATIVE_FORMULAS_H_
