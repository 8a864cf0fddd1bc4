"""Random initial weights drawn by a counter-based hash, so that any shard draws its own values.

A seeded generator (`torch.Generator.normal_`, what `build_model` draws with) is one serial
stream: an FSDP run had rank 0 draw the whole model on its host and hand each rank its shard
(a full copy beside the sharded one), on one core (~37 s for 8B parameters, see
bench/reports/2026-12-07-host-setup-cpu.md). Here value i of a parameter is a function of
(seed, parameter name, i) alone:

    h  = mix32(i_low ^ mix32(i_high ^ key))       key: a hash of (seed, name)
    u1 = ((mix32(h ^ A) >> 8) + 0.5) / 2**24       in (0, 1)
    u2 =  (mix32(h ^ B) >> 8) / 2**24              in [0, 1)
    z  = std * sqrt(-2 ln u1) * cos(2 pi u2)       Box-Muller: N(0, std), |z| <= 5.9 std

(`optim.mix32`, the hash of the stochastic-rounding draws). Every rank fills its own shard with
the values of its global indices, in its final dtype, with no full-size temporary: the same
weights for any number of ranks and for one process. On CPU one C++ kernel (OpenMP over all
cores, at::vec's log and cos) writes the values in place; elsewhere, or where the kernel cannot
be built, torch ops draw chunk by chunk (the same distribution; not bit for bit the kernel's
last bits of log and cos).
"""

from __future__ import annotations

import math
import warnings
import zlib
from collections.abc import Callable

import torch
from torch import Tensor, nn

from compiletune import torch_internals
from compiletune.ops import cpu_kernels
from compiletune.optim import mix32

# The two streams drawn from each value's hash: the golden-ratio and another odd constant.
_A, _B = 0x9E3779B9, 0x7F4A7C15
_CHUNK = 1 << 20  # values per torch-op chunk (the fallback's temporaries: ~40 MiB)
_TYPES = {torch.float32: "float", torch.bfloat16: "at::BFloat16", torch.float16: "at::Half"}

_SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <algorithm>
#include <cstdint>

typedef PARAM_T P;
using Vec = at::vec::Vectorized<float>;
using IVec = at::vec::Vectorized<int32_t>;  // uint32 arithmetic: the same bits, wrapping
constexpr int64_t L = Vec::size();
constexpr int64_t CHUNK = 1024;
const float TO_UNIT = 5.9604644775390625e-08f;  // 2**-24

static inline uint32_t mix32(uint32_t x) {  // optim.mix32
  x = ((x >> 16) ^ x) * 0x45d9f3bu;
  x = ((x >> 16) ^ x) * 0x45d9f3bu;
  return (x >> 16) ^ x;
}

// mix32 on L lanes (Inductor builds with -fno-tree-loop-vectorize: the scalar loop would stay
// scalar). IVec's >> is arithmetic, so the bits shifted in are masked off.
static inline IVec mix32v(IVec x) {
  const IVec low16(0xffff), m(0x45d9f3b), s16(16);
  x = (((x >> s16) & low16) ^ x) * m;
  x = (((x >> s16) & low16) ^ x) * m;
  return ((x >> s16) & low16) ^ x;
}

static inline void store_normals(P* dst, const Vec& u1, const Vec& u2, float std, int64_t k) {
  const Vec r = (Vec(-2.0f) * u1.log()).sqrt();
  const Vec z = r * (Vec(6.2831853071795865f) * u2).cos() * Vec(std);
  at::vec::convert<P>(z).store(dst, std::min(k, L));
}

extern "C" void kernel(P* out, int64_t n, int64_t start, int64_t key, float std) {
  const int64_t chunks = (n + CHUNK - 1) / CHUNK;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t base = c * CHUNK;
    const int64_t count = std::min(CHUNK, n - base);
    const uint64_t first = static_cast<uint64_t>(start + base);
    const uint64_t last = first + CHUNK - 1;
    if ((first >> 32) == (last >> 32)) {  // the chunk's indices share their high 32 bits
      const IVec k(static_cast<int32_t>(mix32(static_cast<uint32_t>(first >> 32) ^
                                              static_cast<uint32_t>(key))));
      const IVec lanes = IVec::arange(0, 1), a(static_cast<int32_t>(0x9e3779b9u)),
                 b(0x7f4a7c15), low24(0xffffff), s8(8);
      for (int64_t j = 0; j < count; j += L) {
        const IVec index = IVec(static_cast<int32_t>(static_cast<uint32_t>(first) +
                                                     static_cast<uint32_t>(j))) + lanes;
        const IVec h = mix32v(index ^ k);
        const Vec u1 = (at::vec::convert<float>((mix32v(h ^ a) >> s8) & low24) + Vec(0.5f)) *
                       Vec(TO_UNIT);
        const Vec u2 = at::vec::convert<float>((mix32v(h ^ b) >> s8) & low24) * Vec(TO_UNIT);
        store_normals(out + base + j, u1, u2, std, count - j);
      }
      continue;
    }
    // It straddles a multiple of 2**32: the same uniforms drawn value by value.
    alignas(64) float u1[CHUNK];
    alignas(64) float u2[CHUNK];
    for (int64_t j = 0; j < CHUNK; ++j) {
      const uint64_t i = first + j;
      const uint32_t k = mix32(static_cast<uint32_t>(i >> 32) ^ static_cast<uint32_t>(key));
      const uint32_t h = mix32(static_cast<uint32_t>(i) ^ k);
      u1[j] = (static_cast<float>(mix32(h ^ 0x9e3779b9u) >> 8) + 0.5f) * TO_UNIT;
      u2[j] = static_cast<float>(mix32(h ^ 0x7f4a7c15u) >> 8) * TO_UNIT;
    }
    for (int64_t j = 0; j < count; j += L) {
      store_normals(out + base + j, Vec::loadu(u1 + j), Vec::loadu(u2 + j), std, count - j);
    }
  }
}
"""

_kernels: dict[torch.dtype, Callable[..., None] | None] = {}


def _kernel(dtype: torch.dtype) -> Callable[..., None] | None:
    """The C++ kernel for `dtype`, built on first use (cached on disk); None if it cannot be."""
    if dtype not in _kernels:
        kernel = None
        if dtype in _TYPES and cpu_kernels.enabled():
            ctype = _TYPES[dtype]
            argtypes = [f"{ctype}*", "int64_t", "int64_t", "int64_t", "float"]
            try:
                kernel = torch_internals.load_cpp_kernel(
                    argtypes, _SOURCE.replace("PARAM_T", ctype)
                )
            except Exception as e:  # no compiler, an older torch's headers...
                warnings.warn(
                    f"compiletune: building the C++ init kernel failed ({type(e).__name__}: "
                    f"{str(e)[:300]}); drawing initial weights with torch ops",
                    stacklevel=3,
                )
        _kernels[dtype] = kernel
    return _kernels[dtype]


def param_key(seed: int, name: str) -> int:
    """The 32-bit key of a parameter's draws: a hash of (seed, its name)."""
    mixed = (int(seed) % (1 << 62) * 1_000_003 + zlib.crc32(name.encode())) * 1_000_003
    return int(mix32((mixed ^ (mixed >> 32)) & 0xFFFFFFFF))


def _torch_draws(n: int, start: int, key: int, std: float, device: torch.device) -> Tensor:
    """fp32 [n]: the kernel's formula in torch ops (int64 arithmetic never overflows here)."""
    i = torch.arange(start, start + n, dtype=torch.int64, device=device)
    h = mix32((i & 0xFFFFFFFF) ^ mix32((i >> 32) ^ key))
    u1 = ((mix32(h ^ _A) >> 8).float() + 0.5) * 2.0**-24
    u2 = (mix32(h ^ _B) >> 8).float() * 2.0**-24
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2 * math.pi) * u2) * std


def hashed_normal_(t: Tensor, std: float, key: int, start: int = 0) -> None:
    """Fill `t` (any shape, seen flat) with N(0, std) draws of indices start..start+t.numel()
    of the values keyed by `key` (`param_key`): in place, in t's dtype. A contiguous CPU tensor
    is written by the C++ kernel; any other draws chunks of `_CHUNK` values and copies them."""
    n = t.numel()
    kernel = _kernel(t.dtype) if t.device.type == "cpu" and t.is_contiguous() else None
    if kernel is not None and type(t) is Tensor:
        kernel(t, n, start, key, float(std))
        torch.autograd.graph.increment_version(t)  # written through a pointer
        return
    # A strided tensor (none of the models' parameters is one) draws into a contiguous copy.
    flat = t.view(-1) if t.is_contiguous() else torch.empty(n, dtype=t.dtype, device=t.device)
    for a in range(0, n, _CHUNK):
        b = min(n, a + _CHUNK)
        flat[a:b].copy_(_torch_draws(b - a, start + a, key, std, t.device))
    if not t.is_contiguous():
        t.copy_(flat.view(t.shape))


def shard_offset(p: Tensor) -> int:
    """Flat index, in the whole parameter, of the first value of this rank's shard: 0 for a
    plain tensor; for a DTensor sharded on dim 0 (FSDP2's layout, possibly replicated over
    another mesh dimension) the rows before this rank's, as torch.chunk splits them."""
    placements = getattr(p, "placements", None)
    if placements is None:  # whole, or --ep's slice of the experts (expert_parallel.py)
        return getattr(p, "first_row", 0) * (p.numel() // max(p.shape[0], 1))
    row = 0
    coordinate = p.device_mesh.get_coordinate()
    for mesh_dim, placement in enumerate(placements):
        if placement.is_replicate():
            continue
        if not placement.is_shard(0):
            raise ValueError(f"hashed init: unsupported placement {placement} (dim 0 only)")
        parts = p.device_mesh.size(mesh_dim)
        rows = -(-p.shape[0] // parts)
        row = min(p.shape[0], coordinate[mesh_dim] * rows)
    return row * (p.numel() // max(p.shape[0], 1))


def init_hashed(model: nn.Module, seed: int, std: float = 0.02) -> nn.Module:
    """`model.init_weights` with every normal draw hashed: each parameter's values (each
    rank's shard of them under FSDP2) are those of `param_key(seed, name)`, whatever the
    number of ranks. Other initial values (zeros, ones, per-family constants) are
    init_weights' own. Returns the model."""
    names = {id(p): n for n, p in model.named_parameters()}  # a tied weight: its first name

    def draw(p: Tensor, std: float) -> None:
        local = p.to_local() if hasattr(p, "to_local") else p
        hashed_normal_(local.detach(), std, param_key(seed, names[id(p)]), shard_offset(p))

    with torch.no_grad():
        model.init_weights(std, fill_normal=draw)
    return model
