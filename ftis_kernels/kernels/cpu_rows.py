"""The CPU path's row functions, hand-vectorised in C++.

The fused CPU passes (`logp_lse_cpu.py`) spend most of their time in two exponentials per logit.
torch.compile's C++ code calls a 1-ulp vectorised exp2 for each; this module's loops take a
degree-5 polynomial with an exponent built from bits instead (1.7e-7 relative error, the spacing
of fp32 near 1 is 1.2e-7), and let the compiler vectorise whole rows. Measured against the
torch.compile'd functions on a 2-core AVX-512 machine (bench/README.md, "CPU row passes"): the
forward at 1.3x their speed (fp32) and 1.7-1.8x (bf16), the backward at 1.7-1.9x in bf16 and the
same in fp32, where both run at copy speed. The same arithmetic otherwise, with the same
non-finite semantics:

    fwd_rows: m = max_v max(x_v, lowest) (NaN if a NaN is read), s = sum_v e_v and
              u = sum_v e_v max(x_v - m, lowest), e_v = 2^((x_v - m) scale)
    bwd_rows: out_v = 2^((x_v - m) scale) k, written in out's dtype (out may be x itself)

Sums go by blocks of 2048 logits (the block's exponentials into a buffer, summed with vector
accumulators, the block sums added in turn), so rounding error grows with the block, not the
row. Rows run in parallel with `at::parallel_for`, under torch's thread settings.

Built on first use with torch.utils.cpp_extension (C++ compiler and ninja; tens of seconds once,
cached per source, flags and CPU), for the CPU it runs on (-march=native). Where it cannot be
built, `usable` is False after one warning and the callers take the torch.compile'd functions.
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path
from typing import Optional

import torch

# The logits dtypes each direction takes here (fp16 takes the torch.compile'd functions).
DTYPES = {"fwd": (torch.float32, torch.bfloat16), "bwd": (torch.float32, torch.bfloat16)}
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"]

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

constexpr float kLowest = std::numeric_limits<float>::lowest();
constexpr int64_t kBlock = 2048;

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) {
  uint32_t u = uint32_t(p[i]) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void store(float* p, int64_t i, float g) { p[i] = g; }
inline void store(uint16_t* p, int64_t i, float g) {
  // Round to nearest even, NaN as 0x7FC0: c10::BFloat16's conversion.
  uint32_t u;
  std::memcpy(&u, &g, 4);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  p[i] = g != g ? uint16_t(0x7FC0) : uint16_t(r);
}

// 2^y, for y <= 0 in the row passes (x <= the row max): 2^floor(y) from its exponent bits times a
// degree-5 polynomial in the fraction (fitted in relative error, 1.7e-7); y < -126 gives 0 (no
// subnormals), y = 0 exactly 1, y >= 128 inf, NaN NaN. The clamps keep the float -> int
// conversion defined whatever y is.
inline float exp2_nonpos(float y) {
  y = y < -127.0f ? -127.0f : y;
  y = y > 128.0f ? 128.0f : y;
  const float n = std::floor(y);
  const float f = y - n;
  float p = 0.0018671829020604491f;
  p = p * f + 0.009016687981784344f;
  p = p * f + 0.05580044537782669f;
  p = p * f + 0.2401641607284546f;
  p = p * f + 0.6931513547897339f;
  p = p * f + 1.0f;
  const int32_t bits = (int32_t(n == n ? n : 0.0f) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

template <typename T>
void fwd(const T* x, int64_t R, int64_t V, int64_t rs, float scale, bool with_u, float* m_out,
         float* s_out, float* u_out) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(V, 1));
  at::parallel_for(0, R, grain, [&](int64_t r0, int64_t r1) {
    alignas(64) float eb[kBlock];
    alignas(64) float db[kBlock];
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = x + r * rs;
      float m = kLowest;
      int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
      for (int64_t v = 0; v < V; ++v) {
        const float a = load(row, v);
        m = a > m ? a : m;
        nan |= a != a;
      }
      if (nan) m = std::numeric_limits<float>::quiet_NaN();
      // Per block: the exponentials into a buffer (an element-wise loop), then the sums over it
      // from L1 (a reduction over the exp2 itself ran at 0.6x this speed).
      float s = 0.0f, u = 0.0f;
      for (int64_t b = 0; b < V; b += kBlock) {
        const int64_t n = std::min(V - b, kBlock);
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
          const float d = load(row, b + i) - m;
          db[i] = d < kLowest ? kLowest : d;
          eb[i] = exp2_nonpos(d * scale);
        }
        float sb = 0.0f, ub = 0.0f;
        if (with_u) {
#pragma omp simd reduction(+ : sb, ub)
          for (int64_t i = 0; i < n; ++i) {
            sb += eb[i];
            ub += eb[i] * db[i];
          }
        } else {
#pragma omp simd reduction(+ : sb)
          for (int64_t i = 0; i < n; ++i) sb += eb[i];
        }
        s += sb;
        u += ub;
      }
      m_out[r] = m;
      s_out[r] = s;
      if (with_u) u_out[r] = u;
    }
  });
}

template <typename T>
void bwd(const T* x, T* out, int64_t R, int64_t V, int64_t rs, int64_t os, float scale,
         const float* m, const float* k) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(V, 1));
  at::parallel_for(0, R, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* row = x + r * rs;
      T* orow = out + r * os;
      const float mr = m[r], kr = k[r];
#pragma omp simd
      for (int64_t v = 0; v < V; ++v) store(orow, v, exp2_nonpos((load(row, v) - mr) * scale) * kr);
    }
  });
}

}  // namespace

void fwd_rows(torch::Tensor x, double scale, torch::Tensor m, torch::Tensor s,
              std::optional<torch::Tensor> u) {
  const int64_t R = x.size(0), V = x.size(1), rs = x.stride(0);
  float* up = u.has_value() ? u->data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat) {
    fwd(x.data_ptr<float>(), R, V, rs, float(scale), up != nullptr, m.data_ptr<float>(),
        s.data_ptr<float>(), up);
  } else {
    fwd(reinterpret_cast<const uint16_t*>(x.data_ptr()), R, V, rs, float(scale), up != nullptr,
        m.data_ptr<float>(), s.data_ptr<float>(), up);
  }
}

void bwd_rows(torch::Tensor x, torch::Tensor m, double scale, torch::Tensor k, torch::Tensor out) {
  const int64_t R = x.size(0), V = x.size(1), rs = x.stride(0), os = out.stride(0);
  if (x.scalar_type() == at::kFloat) {
    bwd(x.data_ptr<float>(), out.data_ptr<float>(), R, V, rs, os, float(scale),
        m.data_ptr<float>(), k.data_ptr<float>());
  } else {
    bwd(reinterpret_cast<const uint16_t*>(x.data_ptr()),
        reinterpret_cast<uint16_t*>(out.data_ptr()), R, V, rs, os, float(scale),
        m.data_ptr<float>(), k.data_ptr<float>());
  }
}
"""

# The built module, None once a build failed; absent until the first call.
_MODULE: dict = {}


def _cpu_key() -> str:
    """The CPU's feature flags, so that a -march=native build is never loaded on another CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def _module():
    if "mod" not in _MODULE:
        key = hashlib.sha256("\n".join([_SOURCE, *_FLAGS, _cpu_key()]).encode()).hexdigest()
        try:
            # Imported here: torch.utils.cpp_extension needs setuptools (not a core dependency).
            from torch.utils.cpp_extension import load_inline

            _MODULE["mod"] = load_inline(
                f"ftis_cpu_rows_{key[:16]}",
                cpp_sources=[_SOURCE],
                functions=["fwd_rows", "bwd_rows"],
                extra_cflags=_FLAGS,
                extra_ldflags=["-fopenmp"],
            )
        except Exception as err:  # no setuptools, compiler or ninja, a bad flag: fall back
            _MODULE["mod"] = None
            warnings.warn(
                "ftis_kernels: the C++ CPU row functions could not be built, the torch.compile'd "
                f"ones run instead ({type(err).__name__}: {str(err).splitlines()[0]})",
                RuntimeWarning,
                stacklevel=4,
            )
    return _MODULE["mod"]


def usable(direction: str, *tensors: torch.Tensor) -> bool:
    """Whether these (rows, V) CPU tensors (logits, and out) take the C++ row function of
    direction "fwd" or "bwd": a dtype of DTYPES[direction], unit stride along V, and the module
    builds (built here at the first such call)."""
    ok = all(
        t.device.type == "cpu"
        and t.dtype in DTYPES[direction]
        and t.dim() == 2
        and t.stride(1) == 1
        for t in tensors
    )
    return ok and len({t.dtype for t in tensors}) == 1 and _module() is not None


def fwd_rows(
    x: torch.Tensor, scale: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """`logp_lse_cpu._fwd_rows` in C++: x (rows, V) fp32 | bf16, unit stride along V; returns m, s
    and u (None without the entropy), each (rows, 1) fp32."""
    R = x.shape[0]
    m, s = (torch.empty(R, 1, dtype=torch.float32) for _ in range(2))
    u = torch.empty(R, 1, dtype=torch.float32) if with_entropy else None
    _module().fwd_rows(x, float(scale), m, s, u)
    return m, s, u


def bwd_rows(
    x: torch.Tensor, m: torch.Tensor, scale: float, k: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """`logp_lse_cpu._bwd_rows` in C++: out = 2^((x - m) scale) k in out's dtype; x, out (rows, V),
    the same dtype, unit stride along V, out may be x; m, k (rows, 1) fp32, m >= every x of its
    row (the row max, or a larger one). Returns out."""
    f32 = torch.float32
    _module().bwd_rows(x, m.to(f32).contiguous(), float(scale), k.to(f32).contiguous(), out)
    return out
