"""Builds the SIMT emulator library and runs csrc/cuda's kernels through it (ctypes).

The library is compiled here with the host compiler from tests/emulator/*.cpp and the unmodified
headers of csrc/cuda (or a mutated copy of them, for the planted-bug tests), cached under
build/simt by a hash of every input. ``compare_*`` run one op both through the emulator and
through the CPU op of the extension and return the list of disagreements (empty = agree), so the
parametrised tests and the planted-bug sweep share one definition of "agrees".
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CSRC_CUDA = ROOT / "csrc" / "cuda"
BUILD = ROOT / "build" / "simt"

# -fsanitize=bounds checks indexing of fixed-size (shared) arrays; the library defines the
# handler itself, so the UBSan runtime is not linked. -ffp-contract=off: no FMA contraction, as
# in the CPU kernels, so that the emulated and CPU noise streams can be compared bit for bit.
CXXFLAGS = ["-std=c++20", "-O2", "-g0", "-fPIC", "-fno-extern-tls-init", "-ffp-contract=off",
            "-fsanitize=bounds", "-Wall", "-Wextra", "-Werror"]
ALL_SOURCES = ("simt.cpp", "bpclip_kernels.cpp", "selftest_kernels.cpp", "selftest_shared.cpp")
KERNEL_SOURCES = ("simt.cpp", "bpclip_kernels.cpp")

DTYPES = {torch.float32: 0, torch.float64: 1, torch.float16: 2, torch.bfloat16: 3}
CLIP_FNS = {"clip": 0, "global": 1, "normalize": 2}
POLICIES = {"in_order": 0, "reverse": 1, "random": 2}
H100_SMS = 132  # the launchers' grids are emulated as for this device unless a test says otherwise


SESSION: list = []  # the emulator libraries the test session loaded (the first is summarised)


class SimtError(RuntimeError):
    """A launch error reported by the emulator (bounds, collectives, barriers, deadlock)."""


def _digest(paths, extra=()) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(str(p.name).encode())
        h.update(p.read_bytes())
    for e in extra:
        h.update(str(e).encode())
    return h.hexdigest()[:16]


def build_library(kernel_dir: Path = CSRC_CUDA, sources=ALL_SOURCES) -> Path:
    """Compiles (or reuses) the emulator library over the kernel headers in ``kernel_dir``."""
    cxx = os.environ.get("CXX", "c++")
    includes = [HERE / "include", ROOT / "csrc" / "include", kernel_dir]
    headers = [p for d in (HERE, HERE / "include", ROOT / "csrc" / "include" / "bpclip_fast", kernel_dir)
               for p in d.iterdir() if p.suffix in (".h", ".cuh")]
    flags = CXXFLAGS + [f"-I{d}" for d in includes]
    objdir = BUILD / "obj"
    objdir.mkdir(parents=True, exist_ok=True)

    def compile_one(src: str) -> Path:
        path = HERE / src
        obj = objdir / f"{path.stem}-{_digest([path, *headers], [cxx, *CXXFLAGS])}.o"
        if not obj.exists():
            tmp = obj.with_suffix(f".{os.getpid()}.tmp")
            run = subprocess.run([cxx, *flags, "-c", str(path), "-o", str(tmp)], capture_output=True, text=True)
            if run.returncode != 0:
                raise RuntimeError(f"compiling {src} for the emulator failed:\n{run.stderr[-4000:]}")
            tmp.replace(obj)
        return obj

    with ThreadPoolExecutor(max_workers=max(1, min(len(sources), os.cpu_count() or 1))) as pool:
        objects = list(pool.map(compile_one, sources))
    lib = BUILD / f"libsimt-{_digest(objects)}.so"
    if not lib.exists():
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        # -Bsymbolic: the library's own bounds handler, whatever else is loaded in the process.
        run = subprocess.run([cxx, "-shared", "-o", str(tmp), *map(str, objects), "-ldl", "-Wl,-Bsymbolic"],
                             capture_output=True, text=True)
        if run.returncode != 0:
            raise RuntimeError(f"linking the emulator failed:\n{run.stderr[-4000:]}")
        tmp.replace(lib)
    return lib


def mutated_kernel_dir(dest: Path, file: str, old: str, new: str) -> Path:
    """A copy of csrc/cuda with ``old`` replaced by ``new`` in ``file`` (``old`` must occur once)."""
    text = (CSRC_CUDA / file).read_text()
    count = text.count(old)
    if count != 1:
        raise AssertionError(f"planted bug: {old!r} occurs {count} times in csrc/cuda/{file}, expected once; "
                             "update the mutation to the current kernel code")
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(CSRC_CUDA, dest)
    (dest / file).write_text(text.replace(old, new))
    return dest


def global_kernels() -> set[str]:
    """Names of the ``__global__`` functions defined in csrc/cuda."""
    names = set()
    for p in CSRC_CUDA.iterdir():
        if p.suffix in (".cu", ".cuh"):
            # (__launch_bounds__(...) may stand between the return type and the name)
            names |= set(re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)", p.read_text()))
    return names


def kernel_base_name(demangled: str) -> str:
    """``void bpclip::cuda::scale_rows_kernel<float, float>(...)`` -> ``scale_rows_kernel``."""
    head = demangled.split("(")[0].split("<")[0]
    return head.split()[-1].split("::")[-1]


def _ptr(t: torch.Tensor):
    return ctypes.c_void_p(t.data_ptr())


def _ptr_or_null(t):
    return ctypes.c_void_p(t.data_ptr()) if t is not None else ctypes.c_void_p(None)


def summary(sim: "Simt") -> str:
    """One line: how many of csrc/cuda's kernels, instantiations and launches ``sim`` executed."""
    ours = global_kernels()
    stats = {k: v for k, v in sim.stats().items() if kernel_base_name(k) in ours}
    names = {kernel_base_name(k) for k in stats}
    launches, blocks, threads = (sum(v[i] for v in stats.values()) for i in range(3))
    return (f"SIMT emulator: executed {len(names)} of {len(ours)} CUDA kernels of csrc/cuda "
            f"({len(stats)} instantiations) in {launches} launches, {blocks} blocks, {threads} threads")


class Simt:
    """ctypes view of one emulator library."""

    def __init__(self, path: Path):
        self.path = path
        lib = ctypes.CDLL(str(path))
        lib.simt_take_error.restype = ctypes.c_char_p
        lib.simt_stats.restype = ctypes.c_char_p
        i64, dbl, vp, i32, u64 = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64
        lib.simt_clip_rows.argtypes = [i32, vp, i64, i64, i64, i64, i32, dbl, i32, dbl, vp, vp, vp, vp]
        lib.simt_clip_rows_backward.argtypes = [i32, vp, vp, vp, vp, i64, i64, dbl, i32, vp]
        lib.simt_scale_rows.argtypes = [i32, vp, vp, i64, i64, vp]
        lib.simt_box_muller_probe.argtypes = [vp, i64, vp]
        lib.simt_box_muller_f64_probe.argtypes = [vp, i64, vp]
        lib.simt_philox_noise.argtypes = [i32, vp, i64, u64, u64, dbl, i32, i64, i32, i32, dbl]
        lib.simt_philox_noise2.argtypes = [i32, vp, i64, vp, i64, u64, u64, dbl, i32, i32, i64, i32, i32,
                                           dbl]
        lib.simt_banded_row.argtypes = [i32, vp, i64, i64, vp, vp, vp, i32, i32, vp, u64, u64, dbl, i64, i32, i32]
        lib.simt_scale_rows2.argtypes = [i32, vp, vp, i64, vp, vp, vp, i64, i32, i64, vp]
        lib.simt_clip_rows_rescale.argtypes = [i32, vp, i64, i64, i64, i64, i32, dbl, i32, dbl, vp, vp, vp, vp, vp, vp,
                                               i64, vp]
        lib.simt_layer_tail.argtypes = [i32, vp, i64, vp, i64, i32, vp, i64, u64, u64, dbl, i32, dbl, vp, vp,
                                        vp, vp, i64, i64, dbl, i32, vp, i32]
        lib.simt_norm_affine.argtypes = [i32, vp, vp, vp, vp, i32, i64, i64, i64, i64, vp, vp]
        lib.simt_exact_bound.argtypes = [i32, vp, vp, vp, vp, vp, vp, i32, vp, vp, vp, vp]
        lib.simt_position_split.argtypes = [i64]
        lib.simt_exact_factors.argtypes = [vp, i64, i64, dbl, dbl, i32, dbl, i32, vp, vp, vp]
        lib.simt_examples_bound.argtypes = [i32, vp, vp, i64, i64, i64, vp, vp]
        lib.simt_examples_factors.argtypes = [i32, vp, vp, i64, i64, i64, vp, vp, i32, vp, dbl, i32, dbl]
        lib.simt_examples_release.argtypes = [i32, vp, vp, vp, i64, i64, i64, u64, u64, dbl, dbl, vp, vp]
        lib.simt_conv_patches.argtypes = [i32, vp, vp, vp]
        lib.simt_word_checksum.argtypes = [vp, i64, vp, i64, i32]
        lib.simt_discrete_gaussian.argtypes = [vp, i64, u64, u64, u64, i64, i32]
        lib.simt_integer_release.argtypes = [i32, vp, i64, u64, u64, u64, dbl, i32, u64, dbl, i64, i32]
        lib.simt_set_schedule.argtypes = [i32, u64]
        for name in ("simt_f32_to_f16", "simt_f32_to_bf16"):
            getattr(lib, name).argtypes = [vp, vp, i64, i32]
        for name in ("simt_f16_to_f32", "simt_bf16_to_f32"):
            getattr(lib, name).argtypes = [vp, vp, i64]
        self.lib = lib

    # -- plumbing --
    def schedule(self, policy: str, seed: int = 0) -> None:
        self.lib.simt_set_schedule(POLICIES[policy], seed)

    def check(self, rc: int) -> None:
        err = self.lib.simt_take_error().decode()
        if rc or err:
            raise SimtError(err or f"emulator call failed (code {rc})")

    def stats(self) -> dict:
        return json.loads(self.lib.simt_stats().decode())

    def call(self, name: str, *args) -> None:
        self.check(getattr(self.lib, name)(*args))

    # -- the ops, over caller-owned CPU tensors (outputs poisoned by the caller) --
    def clip_rows(self, x, out, factor, norm, nonfinite, *, l15, bound, clip_fn, gamma):
        B = x.shape[0]
        N = x[0].numel() if B else 0
        G, S = (x.shape[1], x.shape[2] * x.shape[3]) if l15 else (1, N)
        self.call("simt_clip_rows", DTYPES[x.dtype], _ptr(x), B, N, G, S, int(l15), bound, CLIP_FNS[clip_fn], gamma,
                  _ptr(out), _ptr(factor), _ptr(norm), _ptr(nonfinite))

    def scale_rows(self, x, factor, out):
        B = x.shape[0]
        N = x[0].numel() if B else 0
        self.call("simt_scale_rows", DTYPES[x.dtype], _ptr(x), _ptr(factor), B, N, _ptr(out))

    def clip_rows_backward(self, g, xc, factor, norm, out, *, bound, clip_fn):
        B = g.shape[0]
        N = g[0].numel() if B else 0
        self.call("simt_clip_rows_backward", DTYPES[g.dtype], _ptr(g), _ptr(xc), _ptr(factor), _ptr(norm), B, N,
                  bound, CLIP_FNS[clip_fn], _ptr(out))

    def examples_bound(self, dtype, w, b, B, Nw, Nb, out, nonfinite):
        """w, b: flat buffers (or None); out float64 [B]; nonfinite int64 [1] or None."""
        self.call("simt_examples_bound", DTYPES[dtype], _ptr_or_null(w), _ptr_or_null(b), B, Nw, Nb, _ptr(out),
                  _ptr_or_null(nonfinite))

    def examples_factors(self, dtype, w, b, B, Nw, Nb, out, nonfinite, factor, fp64, max_norm, clip_fn, gamma):
        """examples_bound's ``out`` and, in the same launch, exact_factors' ``factor`` of each bound."""
        self.call("simt_examples_factors", DTYPES[dtype], _ptr_or_null(w), _ptr_or_null(b), B, Nw, Nb, _ptr(out),
                  _ptr(nonfinite), int(fp64), _ptr(factor), _bound_eff(max_norm), CLIP_FNS[clip_fn], gamma)

    def examples_release(self, dtype, w, b, factor, B, Nw, Nb, seed, offset, std, scale, out_w, out_b):
        self.call("simt_examples_release", DTYPES[dtype], _ptr_or_null(w), _ptr_or_null(b), _ptr(factor), B, Nw, Nb,
                  seed, offset, std, scale, _ptr_or_null(out_w), _ptr_or_null(out_b))
    def scale_rows2(self, x, fx, ox, y, fy, oy, mask_y):
        B = x.shape[0]
        Nx, Ny = (x[0].numel(), y[0].numel()) if B else (0, 0)
        self.call("simt_scale_rows2", DTYPES[x.dtype], _ptr(x), _ptr(fx), Nx, _ptr(ox), _ptr(y), _ptr(fy), Ny,
                  int(mask_y), B, _ptr(oy))

    def clip_rows_rescale(self, g, out, factor, norm, nonfinite, x, x_factor, x_out, *, l15, bound, clip_fn, gamma):
        B = g.shape[0]
        N = g[0].numel() if B else 0
        G, S = (g.shape[1], g.shape[2] * g.shape[3]) if l15 else (1, N)
        Nx = x[0].numel() if B else 0
        self.call("simt_clip_rows_rescale", DTYPES[g.dtype], _ptr(g), B, N, G, S, int(l15), bound, CLIP_FNS[clip_fn],
                  gamma, _ptr(out), _ptr(factor), _ptr(norm), _ptr(nonfinite), _ptr(x), _ptr(x_factor), Nx, _ptr(x_out))

    def norm_affine(self, g, x, mean, rstd, gw, gb, *, layer_norm, B, R, D, G):
        """mean/rstd flat in the accumulation dtype; gw, gb [B, D] buffers of that dtype."""
        self.call("simt_norm_affine", DTYPES[x.dtype], _ptr(g), _ptr(x), _ptr(mean), _ptr(rstd), int(layer_norm), B,
                  R, D, G, _ptr(gw), _ptr(gb))

    def position_split(self, n: int) -> int:
        return int(self.lib.simt_position_split(n))

    def exact_bound(self, x, g, gb, wa, wb, per, flags, consts, sq, bound, nonfinite):
        """x, g, gb: 3-D views (any strides) of fp32/fp64 storage; wa, wb: contiguous [rows, L] or empty."""
        L = wa.shape[-1] if wa.numel() else 0
        geo = torch.tensor([x.shape[0] // per, per, x.shape[1], x.shape[2], g.shape[2], gb.shape[2], L,
                            *x.stride(), *g.stride(), *gb.stride()], dtype=torch.int64)
        c = torch.tensor(consts, dtype=torch.float64)
        self.call("simt_exact_bound", DTYPES[x.dtype], _ptr(x), _ptr(g), _ptr(gb), _ptr(wa), _ptr(wb), _ptr(geo),
                  flags, _ptr(c), _ptr(sq), _ptr(bound), _ptr(nonfinite))

    def conv_patches(self, x, k, stride, padding, dilation, out):
        """x: a 4-D view (any strides) of its storage; out: [n, c kh kw, ho wo] of the accumulation dtype."""
        n, c, h, w = x.shape
        ho = (h + 2 * padding[0] - dilation[0] * (k[0] - 1) - 1) // stride[0] + 1
        wo = (w + 2 * padding[1] - dilation[1] * (k[1] - 1) - 1) // stride[1] + 1
        geo = torch.tensor([n, c, h, w, *k, *stride, *padding, *dilation, ho, wo, *x.stride()], dtype=torch.int64)
        self.call("simt_conv_patches", DTYPES[x.dtype], _ptr(x), _ptr(geo), _ptr(out))

    def exact_factors(self, stacked, inflate, bound_eff, clip_fn, gamma, fp64, factor, total, nonfinite):
        self.call("simt_exact_factors", _ptr(stacked), stacked.shape[0], stacked.shape[1], inflate, bound_eff,
                  CLIP_FNS[clip_fn], gamma, int(fp64), _ptr(factor), _ptr(total), _ptr(nonfinite))

    def box_muller(self, words: torch.Tensor) -> torch.Tensor:
        """philox.h's box_muller run as emulated device code on [pairs, 3] uint32 words (as int64)."""
        w = words.to(torch.int64).to(torch.int32).contiguous()  # the bit patterns, 32 bits each
        out = torch.full((w.shape[0], 2), float("nan"))
        self.call("simt_box_muller_probe", _ptr(w), w.shape[0], _ptr(out))
        return out

    def box_muller_f64(self, words: torch.Tensor) -> torch.Tensor:
        """philox.h's box_muller_f64 as emulated device code on [pairs, 4] uint32 words (as int64)."""
        w = words.to(torch.int64).to(torch.int32).contiguous()
        out = torch.full((w.shape[0], 2), float("nan"), dtype=torch.float64)
        self.call("simt_box_muller_f64_probe", _ptr(w), w.shape[0], _ptr(out))
        return out

    def word_checksum(self, words, blocks=0, sm_count=H100_SMS):
        """word_checksum of int64 ``words`` as emulated device code (an int64 scalar); blocks=0: the
        launcher's grid for a device of ``sm_count`` SMs, else that grid."""
        w = words.contiguous()
        out = torch.zeros((), dtype=torch.int64)
        self.call("simt_word_checksum", _ptr(w), w.numel(), _ptr(out), blocks, sm_count)
        return out

    def discrete_gaussian(self, n, seed, offset, sigma, blocks=0, sm_count=H100_SMS):
        """discrete_gaussian_ of ``n`` elements as emulated device code (int64); blocks=0: the
        launcher's grid for a device of ``sm_count`` SMs, else that grid."""
        out = torch.full((n,), -(1 << 63), dtype=torch.int64)
        self.call("simt_discrete_gaussian", _ptr(out), n, seed % (1 << 64), offset % (1 << 64), sigma, blocks,
                  sm_count)
        return out

    def integer_release(self, buf, seed, offset, first, multiplier, grid_exp, sigma, scale, blocks=0,
                        sm_count=H100_SMS):
        """integer_release_ of a float32/float64 ``buf`` as emulated device code, on a copy (returned)."""
        out = buf.contiguous().clone()
        self.call("simt_integer_release", DTYPES[out.dtype], _ptr(out), out.numel(), seed % (1 << 64),
                  offset % (1 << 64), first, multiplier, grid_exp, sigma, scale, blocks, sm_count)
        return out

    def philox_noise(self, buf, n, seed, offset, std, accumulate, blocks=0, threads=256, sm_count=H100_SMS,
                     scale=1.0):
        """blocks=0: the launcher's grid for a device of ``sm_count`` SMs; else that grid."""
        self.call("simt_philox_noise", DTYPES[buf.dtype], _ptr(buf), n, seed, offset, std, int(accumulate), blocks,
                  threads, sm_count, scale)


# ---- comparisons with the CPU ops --------------------------------------------------------------
# Elements after every buffer: a kernel that writes past an output's end changes them (and does not
# corrupt the heap: more than a whole scale tile), one that reads past an input's end reads NaN.
GUARD = 4096 + 37


def acc_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def guarded(n: int, dtype, fill=float("nan")):
    """(flat buffer of n + GUARD elements filled with ``fill``, a view of its first n)."""
    buf = torch.full((n + GUARD,), fill, dtype=dtype)
    return buf, buf[:n]


def guarded_copy(x: torch.Tensor) -> torch.Tensor:
    """``x`` in a buffer followed by GUARD NaNs (or 0x7f.. for integers)."""
    buf, view = guarded(x.numel(), x.dtype)
    view.copy_(x.reshape(-1))
    return view.view(x.shape)


def _guard_intact(buf, n, fill) -> bool:
    tail = buf[n:]
    return bool(torch.isnan(tail).all()) if fill != fill else bool((tail == fill).all())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


_INT_OF = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def rz_scale_reference(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``RZ(factor[b] * x[b])`` in x's dtype (zeros where factor is 0), written independently of the
    kernels (bpclip_fast/clip.h) from torch's round-to-nearest conversion: for fp32/fp16/bf16 data
    the product is exact in fp64, and any rounding of it to x's dtype lands on one of the two
    neighbours around it, so stepping one ulp back toward zero where it landed farther from zero
    gives rounding toward zero (a decrement of the sign-magnitude bit pattern)."""
    assert x.dtype != torch.float64, "the fp64 product is not exact in fp64"
    f = factor.double().reshape((-1,) + (1,) * (x.dim() - 1))
    q = x.double() * f
    r = q.to(x.dtype)
    bits = r.view(_INT_OF[r.element_size()])
    bits = torch.where(r.double().abs() > q.abs(), bits - 1, bits)
    out = bits.view(x.dtype)
    return torch.where(f == 0, torch.zeros((), dtype=x.dtype), out)


def _rtol(dtype):
    # Reductions accumulate in fp64 in a different order than the CPU kernel; the norm is stored
    # rounded to fp32 (fp64 for fp64 data).
    return 1e-12 if dtype == torch.float64 else 2e-6


def _storage_tol(dtype):
    # One rounding of the output to its dtype, from accumulators that agree to _rtol.
    return {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]


def _close(a, b, rtol, atol=0.0):
    return bool(torch.allclose(a.double(), b.double(), rtol=rtol, atol=atol, equal_nan=True))


def compare_clip_rows(sim: Simt, x: torch.Tensor, norm: str, clip_fn: str, bound: float, gamma: float = 0.01):
    """Emulated clip_rows vs the CPU op on ``x``; returns a list of problems."""
    l15 = norm == "l15"
    acc = acc_dtype(x.dtype)
    B = x.shape[0]
    obuf, out = guarded(x.numel(), x.dtype)
    fbuf, factor = guarded(B, acc)
    nbuf, nrm = guarded(B, acc)
    count = torch.zeros(1, dtype=torch.int64)
    sim.clip_rows(guarded_copy(x), out, factor, nrm, count, l15=l15, bound=bound, clip_fn=clip_fn, gamma=gamma)
    ref_count = torch.zeros(1, dtype=torch.int64)
    ref_out, ref_factor, ref_norm = torch.ops.bpclip_fast.clip_rows(x, ref_count, bound, norm, clip_fn, gamma)
    problems = []
    for name, buf, n in (("out", obuf, x.numel()), ("factor", fbuf, B), ("norm", nbuf, B)):
        if not _guard_intact(buf, n, float("nan")):
            problems.append(f"{name}: written past its end")
    if not _close(nrm, ref_norm, _rtol(x.dtype)):
        rows = (~torch.isclose(nrm.double(), ref_norm.double(), rtol=_rtol(x.dtype), equal_nan=True)).sum().item()
        problems.append(f"norm differs in {rows} of {B} rows")
    if not _close(factor, ref_factor, _rtol(x.dtype) * 4):
        problems.append("factor differs")
    if int(count) != int(ref_count):
        problems.append(f"non-finite count {int(count)} != {int(ref_count)}")
    # The scaling itself is exact given the kernel's own factor: out = RZ(x * factor), 0 where factor = 0.
    if x.dtype == torch.float64:
        expect = torch.ops.bpclip_fast.scale_rows(x, factor.clone())
    else:
        expect = rz_scale_reference(x, factor)
    if not torch.equal(_bits(out.reshape(x.shape)), _bits(expect)):
        bad = (_bits(out.reshape(x.shape)) != _bits(expect)).sum().item()
        problems.append(f"out != RZ(x * factor) at {bad} elements")
    if not _close(out.reshape(x.shape), ref_out, _storage_tol(x.dtype), _storage_tol(x.dtype) * 1e-3):
        problems.append("out differs from the CPU op")
    return problems


def compare_scale_rows(sim: Simt, x: torch.Tensor, factor: torch.Tensor):
    """Emulated scale_rows vs the CPU op: bit-identical, and nothing written past the end."""
    obuf, out = guarded(x.numel(), x.dtype)
    sim.scale_rows(guarded_copy(x), guarded_copy(factor), out)
    ref = torch.ops.bpclip_fast.scale_rows(x, factor)
    problems = []
    if not _guard_intact(obuf, x.numel(), float("nan")):
        problems.append("out: written past its end")
    if not torch.equal(_bits(out.reshape(x.shape)), _bits(ref)):
        problems.append(f"scale_rows differs at {(_bits(out.reshape(x.shape)) != _bits(ref)).sum().item()} elements")
    return problems


def compare_clip_rows_backward(sim: Simt, x: torch.Tensor, g: torch.Tensor, clip_fn: str, bound: float,
                               gamma: float = 0.01):
    """Emulated clip_rows_backward vs the CPU op, at the CPU forward of ``x``; returns problems."""
    cnt = torch.zeros(1, dtype=torch.int64)
    xc, factor, nrm = torch.ops.bpclip_fast.clip_rows(x, cnt, bound, "l2", clip_fn, gamma)
    obuf, out = guarded(g.numel(), g.dtype)
    sim.clip_rows_backward(guarded_copy(g), guarded_copy(xc), guarded_copy(factor), guarded_copy(nrm), out, bound=bound, clip_fn=clip_fn)
    ref = torch.ops.bpclip_fast.clip_rows_backward(g, xc, factor, nrm, bound, clip_fn)
    problems = []
    if not _guard_intact(obuf, g.numel(), float("nan")):
        problems.append("out: written past its end")
    scale = ref.abs().max().item() if ref.numel() else 0.0
    if not _close(out.reshape(g.shape), ref, _storage_tol(g.dtype), _storage_tol(g.dtype) * 1e-2 * scale):
        problems.append(f"grad differs: max abs {(out.reshape(g.shape).double() - ref.double()).abs().max():.3g}")
    return problems


def compare_noise(sim: Simt, n: int, dtype, seed: int, offset: int, std: float, accumulate: bool, blocks: int = 0,
                  threads: int = 256, misalign: int = 0, sm_count: int = H100_SMS, scale: float = 1.0):
    """Emulated philox_noise_ vs the CPU op: bit-identical, and nothing written outside the n
    elements. ``misalign``: the view starts that many elements into its buffer (a slice, as
    ``t[k:]`` gives), so its pointer is not 16-byte aligned unless misalign * itemsize is. ``scale``:
    the reference is the CPU op without it, then ``mul_(scale)`` (the scale's definition)."""
    start = torch.linspace(-3, 3, n, dtype=torch.float32).to(dtype) if accumulate else None
    fill = 7.0
    buf = torch.full((misalign + n + GUARD,), fill, dtype=dtype)
    view = buf[misalign:misalign + n]
    if accumulate:
        view.copy_(start)
    sim.philox_noise(view, n, seed, offset, std, accumulate, blocks, threads, sm_count, scale)
    ref = start.clone() if accumulate else torch.empty(n, dtype=dtype)
    torch.ops.bpclip_fast.philox_noise_(ref, seed, offset, std, accumulate)
    if scale != 1.0:
        ref.mul_(scale)
    problems = []
    if not bool((buf[:misalign] == fill).all()):
        problems.append("noise written before the start of the buffer")
    if not _guard_intact(buf[misalign:], n, fill):
        problems.append("noise written past the end of the buffer")
    if not torch.equal(_bits(view), _bits(ref)):
        problems.append(f"noise differs at {(view != ref).sum().item()} of {n} elements")
    return problems


def compare_noise2(sim: Simt, nw: int, nb: int, dtype, seed: int, offset: int, std: float, accumulate_w: bool,
                   accumulate_b: bool, blocks: int = 0, threads: int = 256, misalign: int = 0,
                   sm_count: int = H100_SMS, scale: float = 1.0):
    """Emulated philox_noise2_ vs two CPU philox_noise_ calls (w at offset, b at offset + 1), each then
    ``mul_(scale)``: bit-identical, and nothing written outside either buffer. ``misalign`` offsets
    both views into their buffers."""
    fill = 7.0
    views, bufs, refs = [], [], []
    for n, off, acc, base in ((nw, offset, accumulate_w, -3.0), (nb, offset + 1, accumulate_b, 2.0)):
        buf = torch.full((misalign + n + GUARD,), fill, dtype=dtype)
        view = buf[misalign:misalign + n]
        start = torch.linspace(base, base + 4, n, dtype=torch.float32).to(dtype)
        if acc:
            view.copy_(start)
        ref = start.clone() if acc else torch.empty(n, dtype=dtype)
        torch.ops.bpclip_fast.philox_noise_(ref, seed, off - 2 ** 64 if off >= 2 ** 63 else off, std, acc)
        if scale != 1.0:
            ref.mul_(scale)
        views.append(view)
        bufs.append(buf)
        refs.append(ref)
    sim.call("simt_philox_noise2", DTYPES[dtype], _ptr(views[0]), nw, _ptr(views[1]), nb, seed, offset, std,
             int(accumulate_w), int(accumulate_b), blocks, threads, sm_count, scale)
    problems = []
    for name, buf, view, ref, n in (("w", bufs[0], views[0], refs[0], nw), ("b", bufs[1], views[1], refs[1], nb)):
        if not bool((buf[:misalign] == fill).all()):
            problems.append(f"{name}: noise written before the start of the buffer")
        if not _guard_intact(buf[misalign:], n, fill):
            problems.append(f"{name}: noise written past the end of the buffer")
        if not torch.equal(_bits(view), _bits(ref)):
            problems.append(f"{name}: noise differs at {(view != ref).sum().item()} of {n} elements")
    return problems


def compare_layer_tail(sim: Simt, dtype, nw: int, nb: int, R: int, jvp_rows: int, N: int, std: float,
                       scale: float, misalign: int = 0, seed: int = 11, offset: int = 5,
                       sm_count: int = H100_SMS):
    """Emulated layer_tail_ vs the CPU op: w and b bit-identical (the same noise streams and the bias'
    sum in bpclip_fast/tail.h's order), the input gradient within storage tolerance (as
    compare_clip_rows_backward), nothing written outside any buffer. ``R`` not None: b from the column
    sums of a [R, nb] matrix (R = 0: an empty one, whose pointer is null: b becomes zeros, never its old
    values); ``jvp_rows`` > 0: the VJP of a [jvp_rows, N] input clipping; ``misalign`` offsets w's view
    (the unpacked noise path)."""
    acc = acc_dtype(dtype)
    gen = torch.Generator().manual_seed(nw + 7 * nb + 13 * (R or 0) + jvp_rows)
    w0 = torch.randn(nw, generator=gen, dtype=torch.float64).to(acc)
    b0 = torch.randn(nb, generator=gen, dtype=torch.float64).to(acc)
    rows = torch.randn(R, nb, generator=gen, dtype=torch.float64).to(acc) if R is not None else None
    g = xc = factor = nrm = None
    bound = 0.5 * N ** 0.5 if N else 1.0
    if jvp_rows:
        x = torch.randn(jvp_rows, N, generator=gen).to(dtype)
        cnt = torch.zeros(1, dtype=torch.int64)
        xc, factor, nrm = torch.ops.bpclip_fast.clip_rows(x, cnt, bound, "l2", "clip", 0.01)
        g = torch.randn(jvp_rows, N, generator=gen).to(dtype)
    wr, br = w0.clone(), b0.clone()
    signed = offset - 2 ** 64 if offset >= 2 ** 63 else offset
    ref_gx = torch.ops.bpclip_fast.layer_tail_(wr, br, rows, g, xc, factor, nrm, bound, "clip", seed, signed, std,
                                               scale)
    fill = 7.0
    wbuf = torch.full((misalign + nw + GUARD,), fill, dtype=acc)
    wv = wbuf[misalign:misalign + nw]
    wv.copy_(w0)
    bbuf = torch.full((nb + GUARD,), fill, dtype=acc)
    bv = bbuf[:nb]
    bv.copy_(b0)
    obuf, out = guarded(g.numel(), dtype) if jvp_rows else (None, None)
    g_in, xc_in = (guarded_copy(g), guarded_copy(xc)) if jvp_rows else (None, None)  # held through the call
    sim.call("simt_layer_tail", DTYPES[dtype], _ptr(wv), nw, _ptr(bv), nb, int(rows is not None),
             _ptr_or_null(rows if rows is not None and rows.numel() else None), R or 0, seed, offset, std,
             int(std > 0), scale, _ptr_or_null(g_in), _ptr_or_null(xc_in), _ptr_or_null(factor), _ptr_or_null(nrm),
             jvp_rows, N if jvp_rows else 0, bound, CLIP_FNS["clip"], _ptr_or_null(out), sm_count)
    problems = []
    for name, buf, view, ref, n, lead in (("w", wbuf, wv, wr, nw, misalign), ("b", bbuf, bv, br, nb, 0)):
        if not bool((buf[:lead] == fill).all()):
            problems.append(f"{name}: written before the start of the buffer")
        if not _guard_intact(buf[lead:], n, fill):
            problems.append(f"{name}: written past the end of the buffer")
        if not torch.equal(_bits(view), _bits(ref)):
            problems.append(f"{name}: differs at {(view != ref).sum().item()} of {n} elements")
    if jvp_rows:
        if not _guard_intact(obuf, g.numel(), float("nan")):
            problems.append("grad: written past its end")
        ref_scale = ref_gx.abs().max().item()
        if not _close(out.reshape(g.shape), ref_gx, _storage_tol(dtype), _storage_tol(dtype) * 1e-2 * ref_scale):
            problems.append(f"grad differs: max abs {(out.reshape(g.shape).double() - ref_gx.double()).abs().max():.3g}")
    return problems


def compare_banded_row(sim: Simt, P: int, bands: int, dtype, newest: int, covers, seed: int, offset: int,
                       std: float, blocks: int = 0, threads: int = 256, sm_count: int = H100_SMS):
    """Emulated banded_row_ vs the CPU op on the same ring and outs: the whole ring (the written slot
    and the untouched ones) and every out bit for bit, nothing written past any buffer. ``covers``:
    (start, length) of each out within the row."""
    gen = torch.Generator().manual_seed(P * 131 + bands)
    slots = bands - 1
    ring0 = (torch.randn(slots, P, generator=gen, dtype=torch.float64) * 2).to(dtype)
    # -c_a/c_0 of a BSR-like strategy: decreasing, of both signs here so that a lost sign shows
    weights = [(-1) ** a * 0.9 / (a + 1) for a in range(1, bands)]
    outs0 = [torch.randn(n, generator=gen, dtype=torch.float64).to(dtype) for _, n in covers]
    starts = [s for s, _ in covers]
    ring_buf, ring = guarded(slots * P, dtype, fill=7.0)
    ring.copy_(ring0.reshape(-1))
    out_bufs, outs = zip(*[guarded(o.numel(), dtype, fill=7.0) for o in outs0]) if covers else ((), ())
    for o, o0 in zip(outs, outs0):
        o.copy_(o0)
    ptrs = (ctypes.c_void_p * max(1, len(covers)))(*[o.data_ptr() for o in outs])
    st = (ctypes.c_int64 * max(1, len(covers)))(*starts)
    ln = (ctypes.c_int64 * max(1, len(covers)))(*[n for _, n in covers])
    wt = (ctypes.c_double * slots)(*weights)
    sim.call("simt_banded_row", DTYPES[dtype], _ptr(ring), slots, P, ptrs, st, ln, len(covers), newest, wt, seed,
             offset, std, blocks, threads, sm_count)
    ref_ring = ring0.clone()
    ref_outs = [o.clone() for o in outs0]
    torch.ops.bpclip_fast.banded_row_(ref_ring, ref_outs, starts, newest, weights, seed,
                                      offset - 2 ** 64 if offset >= 2 ** 63 else offset, std)
    problems = []
    if not _guard_intact(ring_buf, slots * P, 7.0):
        problems.append("banded_row: written past the end of the ring")
    if not torch.equal(_bits(ring), _bits(ref_ring.reshape(-1))):
        bad = (ring.view(slots, P) != ref_ring).sum(1).tolist()
        problems.append(f"banded_row: ring differs (elements per slot {bad}, slot {(newest + 1) % slots} written)")
    for k, (buf, o, ref) in enumerate(zip(out_bufs, outs, ref_outs)):
        if not _guard_intact(buf, ref.numel(), 7.0):
            problems.append(f"banded_row: written past the end of out {k}")
        if not torch.equal(_bits(o), _bits(ref)):
            problems.append(f"banded_row: out {k} differs at {(o != ref).sum().item()} of {ref.numel()} elements")
    return problems


def compare_scale_rows2(sim: Simt, x, fx, y, fy, mask_y: bool):
    """Emulated scale_rows2 vs scale_rows on each tensor (y by sign(fy) with the mask): bit-identical."""
    obx, ox = guarded(x.numel(), x.dtype)
    oby, oy = guarded(y.numel(), y.dtype)
    sim.scale_rows2(guarded_copy(x), guarded_copy(fx), ox, guarded_copy(y), guarded_copy(fy), oy, mask_y)
    refs = (torch.ops.bpclip_fast.scale_rows(x, fx),
            torch.ops.bpclip_fast.scale_rows(y, torch.sign(fy) if mask_y else fy))
    problems = []
    for name, buf, out, ref, t in (("x", obx, ox, refs[0], x), ("y", oby, oy, refs[1], y)):
        if not _guard_intact(buf, t.numel(), float("nan")):
            problems.append(f"{name}: written past its end")
        if not torch.equal(_bits(out.reshape(t.shape)), _bits(ref)):
            problems.append(f"scale_rows2 {name} differs at {(_bits(out.reshape(t.shape)) != _bits(ref)).sum().item()}"
                            " elements")
    return problems


def compare_clip_rows_rescale(sim: Simt, g, norm: str, clip_fn: str, bound: float, x, x_factor, gamma: float = 0.01):
    """Emulated clip_rows_rescale: g's part as compare_clip_rows asks of clip_rows (the scaling bit-exact
    for the kernel's own factor), x's bit for bit the CPU scale_rows."""
    l15 = norm == "l15"
    acc = acc_dtype(g.dtype)
    B = g.shape[0]
    obuf, out = guarded(g.numel(), g.dtype)
    fbuf, factor = guarded(B, acc)
    nbuf, nrm = guarded(B, acc)
    xbuf, x_out = guarded(x.numel(), x.dtype)
    count = torch.zeros(1, dtype=torch.int64)
    sim.clip_rows_rescale(guarded_copy(g), out, factor, nrm, count, guarded_copy(x), guarded_copy(x_factor), x_out,
                          l15=l15, bound=bound, clip_fn=clip_fn, gamma=gamma)
    ref_count = torch.zeros(1, dtype=torch.int64)
    _, ref_factor, ref_norm = torch.ops.bpclip_fast.clip_rows(g, ref_count, bound, norm, clip_fn, gamma)
    problems = []
    for name, buf, n in (("out", obuf, g.numel()), ("factor", fbuf, B), ("norm", nbuf, B), ("x_out", xbuf, x.numel())):
        if not _guard_intact(buf, n, float("nan")):
            problems.append(f"{name}: written past its end")
    if not _close(nrm, ref_norm, _rtol(g.dtype)) or not _close(factor, ref_factor, _rtol(g.dtype) * 4):
        problems.append("norm or factor differs from clip_rows")
    if int(count) != int(ref_count):
        problems.append(f"non-finite count {int(count)} != {int(ref_count)}")
    expect = torch.ops.bpclip_fast.scale_rows(g, factor.clone())
    if not torch.equal(_bits(out.reshape(g.shape)), _bits(expect)):
        problems.append("out != scale_rows(g, factor)")
    if not torch.equal(_bits(x_out.reshape(x.shape)), _bits(torch.ops.bpclip_fast.scale_rows(x, x_factor))):
        problems.append("x_out != scale_rows(x, x_factor)")
    return problems


def norm_stats(x: torch.Tensor, layer_norm: bool, groups: int = 1, normalized_dims: int = 1):
    """(mean, rstd) as ATen's CPU forward returns them for ``x`` (eps 1e-5)."""
    if layer_norm:
        _, mean, rstd = torch.ops.aten.native_layer_norm(x, list(x.shape[x.dim() - normalized_dims:]), None, None,
                                                         1e-5)
    else:
        n, c = x.shape[:2]
        _, mean, rstd = torch.ops.aten.native_group_norm(x, None, None, n, c, x[0, 0].numel() if n and c else 0,
                                                         groups, 1e-5)
    return mean, rstd


def norm_affine_terms(g, x, mean, rstd, layer_norm, groups, batch):
    """The float64 terms g·(x − mean)·rstd and g, shaped [B, D, R] (the sums run over the last dim)."""
    g64, x64, m64, r64 = g.double(), x.double(), mean.double().reshape(-1), rstd.double().reshape(-1)
    if layer_norm:
        d = x.numel() // max(mean.numel(), 1)
        g64, x64 = g64.reshape(batch, -1, d), x64.reshape(batch, -1, d)
        m64, r64 = m64.reshape(batch, -1, 1), r64.reshape(batch, -1, 1)
        return (g64 * (x64 - m64) * r64).transpose(1, 2), g64.transpose(1, 2)
    c = x.shape[1]
    g64, x64 = g64.reshape(batch, c, -1), x64.reshape(batch, c, -1)
    m64 = m64.reshape(batch, groups, 1).repeat_interleave(c // groups, 1)
    r64 = r64.reshape(batch, groups, 1).repeat_interleave(c // groups, 1)
    return g64 * (x64 - m64) * r64, g64


def accumulation_bound(terms: torch.Tensor, acc) -> torch.Tensor:
    """An upper bound on the error of summing ``terms`` [.., n] (each computed from exact inputs
    with at most three roundings) in ``acc`` in any order: (n + 3)·u·Σ|term|, u = 2^-24 (2^-53)."""
    u = 2.0 ** -53 if acc == torch.float64 else 2.0 ** -24
    n = terms.shape[-1]
    return (n + 3) * u * terms.abs().sum(-1) * 1.01


def compare_norm_affine(sim: Simt, g, x, layer_norm: bool, groups: int = 1, normalized_dims: int = 1):
    """Emulated norm_affine_example_grads vs the CPU op on the same inputs and ATen statistics; the
    two may differ by their summation orders: each within accumulation_bound of the exact sums."""
    batch = x.shape[0]
    mean, rstd = norm_stats(x, layer_norm, groups, normalized_dims)
    acc = acc_dtype(x.dtype)
    if layer_norm:
        D = x.numel() // mean.numel() if mean.numel() else x[0].numel()
        R = mean.numel() // batch if batch else 0
    else:
        D = x.shape[1]
        R = x[0, 0].numel() if batch and D else 0
    wbuf, gw = guarded(batch * D, acc)
    bbuf, gb = guarded(batch * D, acc)
    sim.norm_affine(guarded_copy(g.contiguous()), guarded_copy(x.contiguous()),
                    guarded_copy(mean.reshape(-1).to(acc)), guarded_copy(rstd.reshape(-1).to(acc)), gw, gb,
                    layer_norm=layer_norm, B=batch, R=R, D=D, G=groups)
    ref_w, ref_b = torch.ops.bpclip_fast.norm_affine_example_grads(g, x, mean, rstd, batch, groups, layer_norm)
    problems = []
    for name, buf in (("gw", wbuf), ("gb", bbuf)):
        if not _guard_intact(buf, batch * D, float("nan")):
            problems.append(f"{name}: written past its end")
    tw, tb = norm_affine_terms(g, x, mean, rstd, layer_norm, groups, batch)
    for name, out, ref, terms in (("gw", gw, ref_w, tw), ("gb", gb, ref_b, tb)):
        out = out.reshape(batch, D)
        if out.dtype != ref.dtype or ref.shape != out.shape:
            problems.append(f"{name}: the CPU op gave {ref.dtype} {tuple(ref.shape)}")
            continue
        diff = (out.double() - ref.double()).abs()
        bad = ~(diff <= 2 * accumulation_bound(terms, acc))  # NaN (unwritten) counts as bad
        if bad.any():
            problems.append(f"{name} differs at {int(bad.sum())} of {out.numel()} outputs, max {float(diff.max()):.3g}")
    return problems


def compare_examples(sim: Simt, w, b, factor, seed=0, offset=0, std=0.0, scale=1.0, count=False):
    """Emulated examples_bound and examples_release vs the CPU ops: bit-identical (the same fixed
    orders: bpclip_fast/examples.h; the noise with FMA contraction off, as the emulator builds),
    the counter alike, and nothing written past the ends. w or b may be None."""
    like = w if w is not None else b
    dtype, B = like.dtype, like.shape[0]
    Nw = w[0].numel() if w is not None and B else (math.prod(w.shape[1:]) if w is not None else 0)
    Nb = b[0].numel() if b is not None and B else (math.prod(b.shape[1:]) if b is not None else 0)
    problems = []
    bbuf, bound = guarded(B, torch.float64)
    counter = torch.zeros(1, dtype=torch.int64) if count else None
    gw_in = guarded_copy(w.contiguous()) if w is not None else None
    gb_in = guarded_copy(b.contiguous()) if b is not None else None
    sim.examples_bound(dtype, gw_in, gb_in, B, Nw, Nb, bound, counter)
    ref_counter = torch.zeros(1, dtype=torch.int64) if count else None
    ref = torch.ops.bpclip_fast.examples_bound(w, b, ref_counter)
    if not _guard_intact(bbuf, B, float("nan")):
        problems.append("bound: written past its end")
    if not torch.equal(_bits(bound), _bits(ref)):
        problems.append(f"bound differs at {int((_bits(bound) != _bits(ref)).sum())} of {B} examples")
    if count and not torch.equal(counter, ref_counter):
        problems.append(f"nonfinite count {int(counter)} vs the CPU's {int(ref_counter)}")
    for fp64 in (False, True):  # examples_factors: the same bound, and exact_factors' factor and count of it
        fbuf, fac = guarded(B, torch.float64 if fp64 else torch.float32)
        bbuf2, bound2 = guarded(B, torch.float64)
        counter2, ref_counter2 = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
        sim.examples_factors(dtype, gw_in, gb_in, B, Nw, Nb, bound2, counter2, fac, fp64, 0.7, "clip", 0.05)
        ref_fac, ref_bound2 = torch.ops.bpclip_fast.examples_factors(w, b, ref_counter2, 0.7, "clip", 0.05, fp64)
        want_fac, _ = torch.ops.bpclip_fast.exact_factors([ref], torch.zeros(1, dtype=torch.int64), 0.7, "clip", 0.05,
                                                           fp64)
        for name, buf, out, r in (("factors' bound", bbuf2, bound2, ref_bound2), ("factor", fbuf, fac, ref_fac)):
            if not _guard_intact(buf, B, float("nan")):
                problems.append(f"{name} (fp64={fp64}): written past its end")
            if not torch.equal(_bits(out), _bits(r)):
                problems.append(f"{name} (fp64={fp64}) differs at {int((_bits(out) != _bits(r)).sum())} of {B}")
        if not torch.equal(_bits(ref_fac), _bits(want_fac)) or not torch.equal(_bits(ref_bound2), _bits(ref)):
            problems.append(f"the CPU examples_factors (fp64={fp64}) is not examples_bound then exact_factors")
        if not torch.equal(counter2, ref_counter2):
            problems.append(f"factors' nonfinite count {int(counter2)} vs the CPU's {int(ref_counter2)}")
    wbuf, ow = guarded(Nw, dtype) if w is not None else (None, None)
    obuf, ob = guarded(Nb, dtype) if b is not None else (None, None)
    sim.examples_release(dtype, gw_in, gb_in, guarded_copy(factor), B, Nw, Nb, seed, offset, std, scale, ow, ob)
    rw, rb = torch.ops.bpclip_fast.examples_release(w, b, factor, [seed, offset], std, scale)
    for name, buf, out, r, n in (("weight", wbuf, ow, rw, Nw), ("bias", obuf, ob, rb, Nb)):
        if out is None:
            continue
        if not _guard_intact(buf, n, float("nan")):
            problems.append(f"release {name}: written past its end")
        if not torch.equal(_bits(out), _bits(r.reshape(-1))):
            problems.append(f"release {name} differs at {int((_bits(out) != _bits(r.reshape(-1))).sum())} of {n}")
    return problems


def examples_inputs(dtype, B, wshape, bshape, gen, nonfinite=False):
    """Per-example values and factors for compare_examples; with nonfinite, example 1 holds NaN and
    Inf with factor 0 (and its bound is not finite)."""
    w = torch.randn(B, *wshape, generator=gen, dtype=torch.float64).to(dtype) if wshape is not None else None
    b = torch.randn(B, *bshape, generator=gen, dtype=torch.float64).to(dtype) if bshape is not None else None
    factor = torch.rand(B, generator=gen, dtype=torch.float64).to(acc_dtype(dtype))
    if nonfinite and B > 1:
        factor[1] = 0
        for t in (w, b):
            if t is not None:
                t.view(B, -1)[1, 0] = float("nan")
                t.view(B, -1)[1, -1] = float("inf")
    return w, b, factor


BOUND_CONSTS = 18  # kBoundConsts of bpclip_fast/bound.h


def bound_inputs(dtype, rows, T, d, p, per, ghost, gen, conv_layout=False):
    """Inputs of exact_bound_ as csrc/exact.cpp builds them: positions x and g (whose squares the
    kernel sums), the upstream gradient for the bias, and the weight's terms. conv_layout: x and g
    as the Conv2d path reads them, [rows, d, T] (the patches) and [rows, p, T] transposed."""
    if conv_layout:
        x = torch.randn(rows, d, T, generator=gen, dtype=torch.float64).to(dtype).transpose(1, 2)
        g = torch.randn(rows, p, T, generator=gen, dtype=torch.float64).to(dtype).transpose(1, 2)
    else:
        x = torch.randn(rows, T, d, generator=gen, dtype=torch.float64).to(dtype)
        g = torch.randn(rows, T, p, generator=gen, dtype=torch.float64).to(dtype)
    if T == 1:
        wa = wb = x.new_empty(0)
    elif ghost:
        wa = torch.bmm(x, x.transpose(1, 2)).reshape(rows, -1)
        wb = torch.bmm(g, g.transpose(1, 2)).reshape(rows, -1)
    else:
        wa = wb = torch.bmm(g.transpose(1, 2), x).reshape(rows, -1)
    return x, g, g, wa.contiguous(), wb.contiguous()


def bound_consts(gen):
    """Constants of the shape the file comment gives them (grow factors just above 1, small error
    coefficients), random so that every term moves the result."""
    c = torch.rand(BOUND_CONSTS, generator=gen, dtype=torch.float64) * 1e-3
    for k in (0, 2, 4, 10, 14):  # kGrowX, kGrowG, kSlack, kOutSlack, kGrow
        c[k] += 1.0
    return c.tolist()


def compare_exact_bound(sim: Simt, xs, gs, gb, wa, wb, per, flags, consts, nonfinite_rows=()):
    """Emulated exact_bound_ vs the CPU op: the same arithmetic in the same order (bound.h), so the
    same bits; and nothing written outside the examples' slots."""
    rows = xs.shape[0]
    B = rows // per
    problems = []
    sq, bound = torch.full((B + 3,), 7.0, dtype=torch.float64), torch.full((B + 3,), 7.0, dtype=torch.float64)
    count = torch.zeros(1, dtype=torch.int64)
    sim.exact_bound(xs, gs, gb, wa, wb, per, flags, consts, sq[1:], bound[1:], count)
    ref_sq, ref_bound = torch.full_like(sq, 7.0), torch.full_like(bound, 7.0)
    ref_count = torch.zeros(1, dtype=torch.int64)
    torch.ops.bpclip_fast.exact_bound_(ref_sq, ref_bound, xs, gs, gb, wa, wb, 1, per, flags, consts, ref_count)
    if not (sq[0] == 7.0 and (sq[B + 1:] == 7.0).all() and bound[0] == 7.0 and (bound[B + 1:] == 7.0).all()):
        problems.append("written outside the examples' slots")
    for name, a, b in (("sq", sq, ref_sq), ("bound", bound, ref_bound)):
        if not torch.equal(a.view(torch.int64), b.view(torch.int64)):
            diff = ((a - b).abs() / b.abs()).nan_to_num(0).max().item()
            problems.append(f"{name} differs from the CPU op (max rel {diff:.3g})")
    if int(count) != int(ref_count):
        problems.append(f"non-finite count {int(count)} != {int(ref_count)}")
    return problems


def compare_conv_patches(sim: Simt, x, k, stride, padding, dilation):
    """Emulated conv_patches vs the CPU op, bit for bit (copies and zeros), the output in a
    NaN-poisoned buffer (an element never written shows) with nothing written past its end."""
    ref = torch.ops.bpclip_fast.conv_patches(x, k, stride, padding, dilation)
    buf, out = guarded(ref.numel(), ref.dtype)
    sim.conv_patches(x, k, stride, padding, dilation, out)
    problems = []
    if not _guard_intact(buf, ref.numel(), float("nan")):
        problems.append("written past its end")
    if not torch.equal(_bits(out), _bits(ref.reshape(-1))):
        bad = int((_bits(out) != _bits(ref.reshape(-1))).sum())
        problems.append(f"differs from the CPU op at {bad} of {ref.numel()} elements")
    return problems


def _bound_eff(max_norm):
    """clip.h's effective_bound(max_norm, 1): max_norm (1 - bound_shrink(1))."""
    eta = 2.0 ** -53
    while eta < 5 * 2.0 ** -53:
        eta *= 2.0
    return max_norm * (1.0 - eta)


def compare_exact_factors(sim: Simt, bounds, max_norm, clip_fn, gamma, fp64):
    """Emulated exact_factors vs the CPU op, bit for bit (factor, total, count)."""
    L = len(bounds)
    stacked = torch.stack(bounds).contiguous()
    B = stacked.shape[1]
    k = L + 3
    inflate = 1.0 + 2.0 * (k * 2.0 ** -53 / (1.0 - k * 2.0 ** -53))
    eta = 2.0 ** -53
    while eta < 5 * 2.0 ** -53:  # clip.h's bound_shrink(1)
        eta *= 2.0
    factor = torch.full((B,), float("nan"), dtype=torch.float64 if fp64 else torch.float32)
    total = torch.full((B,), float("nan"), dtype=torch.float64)
    count = torch.zeros(1, dtype=torch.int64)
    sim.exact_factors(stacked, inflate, max_norm * (1.0 - eta), clip_fn, gamma, fp64, factor, total, count)
    ref_count = torch.zeros(1, dtype=torch.int64)
    ref_factor, ref_total = torch.ops.bpclip_fast.exact_factors(bounds, ref_count, max_norm, clip_fn, gamma, fp64)
    problems = []
    for name, a, b in (("factor", factor, ref_factor), ("total", total, ref_total)):
        if not torch.equal(_bits(a), _bits(b)):
            problems.append(f"{name} differs from the CPU op")
    if int(count) != int(ref_count):
        problems.append(f"non-finite count {int(count)} != {int(ref_count)}")
    return problems


def checksum_truth(words: torch.Tensor) -> int:
    """bpclip_fast/checksum.h's sum in Python's exact integers: Σ w + (w >> 33) (floor shift, as
    C++20's arithmetic one) modulo 2^64, as a signed 64-bit value."""
    total = sum(w + (w >> 33) for w in words.reshape(-1).tolist()) % (1 << 64)
    return total - (1 << 64) if total >= 1 << 63 else total


def compare_word_checksum(sim: Simt, words: torch.Tensor, blocks: int = 0) -> list[str]:
    """The emulated kernel and the CPU op against the exact sum: equal, to the bit."""
    want = checksum_truth(words)
    problems = []
    got = int(sim.word_checksum(words, blocks))
    if got != want:
        problems.append(f"emulated {got} != exact {want} (n={words.numel()}, blocks={blocks})")
    cpu = int(torch.ops.bpclip_fast.word_checksum(words))
    if cpu != want:
        problems.append(f"CPU {cpu} != exact {want} (n={words.numel()})")
    return problems


def compare_discrete_gaussian(sim: Simt, n: int, seed: int, offset: int, sigma: int, blocks: int = 0) -> list[str]:
    """The emulated kernel against the CPU op: the same integers, element for element."""
    got = sim.discrete_gaussian(n, seed, offset, sigma, blocks)
    cpu = torch.empty(n, dtype=torch.int64)
    torch.ops.bpclip_fast.discrete_gaussian_(cpu, seed, offset, sigma)
    bad = (got != cpu).nonzero().reshape(-1)
    if bad.numel():
        i = int(bad[0])
        return [f"element {i} of {bad.numel()} differing: emulated {int(got[i])} != CPU {int(cpu[i])} "
                f"(n={n}, sigma={sigma}, blocks={blocks})"]
    return []


def compare_integer_release(sim: Simt, buf: torch.Tensor, seed: int, offset: int, first: int, multiplier: float,
                            grid_exp: int, sigma: int, scale: float, blocks: int = 0) -> list[str]:
    """The emulated kernel against the CPU op: the same bits, element for element."""
    got = sim.integer_release(buf, seed, offset, first, multiplier, grid_exp, sigma, scale, blocks)
    cpu = buf.contiguous().clone()
    torch.ops.bpclip_fast.integer_release_(cpu, seed, offset, first, multiplier, grid_exp, sigma, scale)
    bad = (got.view(-1) != cpu.view(-1)).nonzero().reshape(-1)
    if bad.numel():
        i = int(bad[0])
        return [f"element {i} of {bad.numel()} differing: emulated {got.view(-1)[i].item()!r} != CPU "
                f"{cpu.view(-1)[i].item()!r} ({buf.dtype}, grid_exp={grid_exp}, sigma={sigma}, blocks={blocks})"]
    return []


def sweep(sim: Simt) -> list[str]:
    """A small run of every op, dtype and kernel path; the problems it finds, labelled."""
    problems = []
    gen = torch.Generator().manual_seed(5)
    words = torch.randint(-(1 << 63), (1 << 63) - 1, (1000,), generator=gen, dtype=torch.int64)
    problems += [f"word_checksum: {p}" for p in compare_word_checksum(sim, words)]
    problems += [f"discrete_gaussian: {p}" for p in compare_discrete_gaussian(sim, 300, 3, 4, 1 << 27)]
    for dtype in (torch.float32, torch.float64):
        buf = torch.randn(200, generator=gen, dtype=dtype)
        problems += [f"integer_release {dtype}: {p}" for p in compare_integer_release(sim, buf, 5, 6, 70, 2.5, -26,
                                                                                      1 << 27, 0.4)]
    for dtype in (torch.float32, torch.float64):
        for T, ghost, per, conv in ((1, False, 1, False), (5, True, 2, True), (40, False, 1, True), (40, True, 1, False)):
            xs, gs, gb, wa, wb = bound_inputs(dtype, 6, T, 7, 3, per, ghost, gen, conv_layout=conv)
            flags = 1 | 2 | (4 if ghost else 0)
            problems += [f"exact_bound {dtype} T={T}: {p}"
                         for p in compare_exact_bound(sim, xs, gs, gb, wa, wb, per, flags, bound_consts(gen))]
            if T > 1 and not ghost:  # the kept bias (flag 8): gb [rows, 1, p]
                problems += [f"exact_bound {dtype} T={T} bias summed: {p}"
                             for p in compare_exact_bound(sim, xs, gs, gs.sum(1, keepdim=True), wa, wb, per,
                                                          flags | 8, bound_consts(gen))]
        # Positions summed in parts (bound.h's position_split): a Linear's long rows (T = 1: x in 32
        # parts, g in 2), and a few positions of a conv's patches (T = 3: x in 8, g in 2).
        for T, d, p, conv in ((1, 600, 40, False), (3, 150, 40, True)):
            xs, gs, gb, wa, wb = bound_inputs(dtype, 5, T, d, p, 1, False, gen, conv_layout=conv)
            problems += [f"exact_bound {dtype} T={T} d={d}: {p}"
                         for p in compare_exact_bound(sim, xs, gs, gb, wa, wb, 1, 3, bound_consts(gen))]
        # conv_patches: padding, stride, dilation, a channels_last and a sliced (offset) input.
        x = torch.randn(2, 3, 9, 8, generator=gen, dtype=torch.float64).to(dtype)
        for xv, geo in ((x, ([3, 3], [1, 1], [1, 1], [1, 1])),
                        (x.contiguous(memory_format=torch.channels_last), ([2, 3], [2, 1], [0, 2], [1, 2])),
                        (x[:, 1:, 1:, ::2], ([3, 2], [1, 2], [2, 1], [2, 1]))):
            problems += [f"conv_patches {dtype} {list(xv.stride())}: {p}"
                         for p in compare_conv_patches(sim, xv, *geo)]
        bounds = [torch.rand(37, generator=gen, dtype=torch.float64) * 3 for _ in range(3)]
        problems += [f"exact_factors {dtype}: {p}"
                     for p in compare_exact_factors(sim, bounds, 1.0, "clip", 0.01, dtype == torch.float64)]
    for dtype in DTYPES:
        for shape in ((9, 100), (3, 4097), (1, 70000)):
            x = torch.randn(shape, generator=gen).to(dtype)
            x[0, 0] = float("nan") if shape[0] > 1 else x[0, 0]
            bound = 0.5 * shape[1] ** 0.5
            problems += [f"clip_rows l2 {dtype} {shape}: {p}" for p in compare_clip_rows(sim, x, "l2", "clip", bound)]
            factor = torch.rand(shape[0], generator=gen, dtype=acc_dtype(dtype)) * 2
            factor[-1] = 0
            problems += [f"scale_rows {dtype} {shape}: {p}" for p in compare_scale_rows(sim, x, factor)]
            g = torch.randn(shape, generator=gen).to(dtype)
            xg = torch.randn(shape, generator=gen).to(dtype)
            problems += [f"backward {dtype} {shape}: {p}" for p in compare_clip_rows_backward(sim, xg, g, "clip", bound)]
        x = torch.randn((3, 40, 9, 13), generator=gen).to(dtype)
        problems += [f"clip_rows l15 {dtype}: {p}" for p in compare_clip_rows(sim, x, "l15", "clip", 30.0)]
        for n, blocks, mis in ((1001, 0, 0), (4099, 1, 0), (2063, 0, 1)):  # 4099 on 1 block: 2 tiles a warp
            label = f"{dtype} n={n} misalign={mis}"
            problems += [f"noise {label}: {p}"
                         for p in compare_noise(sim, n, dtype, 123, 5 << 20, 0.7, False, blocks, misalign=mis)]
            problems += [f"noise+ {label}: {p}"
                         for p in compare_noise(sim, n, dtype, 9, 3, 1.3, True, blocks, misalign=mis)]
            problems += [f"noise2 {label}: {p}"
                         for p in compare_noise2(sim, n, 37, dtype, 9, 3, 1.3, False, True, blocks, misalign=mis)]
            problems += [f"noise2+ {label}: {p}"
                         for p in compare_noise2(sim, 300, n, dtype, 4, 8, 0.7, True, False, blocks, misalign=mis)]
        # layer_tail_: with and without the VJP, the bias' sum (rows not a multiple of the 8 slices,
        # columns past one block) or its own values, a draw or only a scale, w misaligned.
        for nw, nb, R, jvp_rows, N, std, scale, mis in ((300, 37, 19, 5, 70, 0.8, 1.0, 0),
                                                         (4099, 40, None, 0, 0, 1.3, 0.25, 1),
                                                         (257, 3, 2, 3, 4100, 0.0, 2.0, 0),
                                                         (600, 0, None, 9, 33, 0.5, 1.5, 0),
                                                         (70, 9, 0, 0, 0, 0.0, 1.0, 0),
                                                         (70, 9, 0, 0, 0, 0.7, 0.5, 0)):
            problems += [f"layer_tail {dtype} nw={nw} nb={nb} R={R}: {p}"
                         for p in compare_layer_tail(sim, dtype, nw, nb, R, jvp_rows, N, std, scale, mis)]
        if dtype in (torch.float32, torch.float64):
            # a row of 2 tiles + a partial group, outs covering part of it; b = 2, 3, 16; a grid far
            # smaller than the row (the tile stride)
            for P, bands, newest, covers, blocks in ((533, 2, 0, ((0, 500), (500, 30)), 0),
                                                     (533, 3, 0, ((10, 300),), 0),
                                                     (4099, 16, 6, ((0, 4000), (4003, 96)), 1)):
                problems += [f"banded_row {dtype} P={P} b={bands}: {p}"
                             for p in compare_banded_row(sim, P, bands, dtype, newest, covers, 77, 1 << 40, 0.6,
                                                         blocks, 64 if blocks else 256)]
        for B, ws, bs in ((9, (40,), (40,)), (3, (13, 21), None), (2, None, (300,))):
            w, b, factor = examples_inputs(dtype, B, ws, bs, gen, nonfinite=True)
            problems += [f"examples {dtype} B={B}: {p}"
                         for p in compare_examples(sim, w, b, factor, 31, 4, 0.9, 0.25, count=True)]
        x2 = torch.randn((9, 300), generator=gen).to(dtype)
        y2 = torch.randn((9, 4100), generator=gen).to(dtype)
        f2 = torch.rand(9, generator=gen, dtype=acc_dtype(dtype)) * 2
        f2[3] = 0
        problems += [f"scale_rows2 {dtype}: {p}" for p in compare_scale_rows2(sim, x2, f2, y2, f2, True)]
        problems += [f"clip_rows_rescale {dtype}: {p}"
                     for p in compare_clip_rows_rescale(sim, y2, "l2", "clip", 30.0, x2, f2)]
        for shape, ln, groups in (((3, 70, 33), True, 1), ((2, 5, 9), True, 1), ((2, 6, 4097), False, 3),
                                  ((9, 4, 5), False, 2)):
            g = torch.randn(shape, generator=gen).to(dtype)
            x = torch.randn(shape, generator=gen).to(dtype)
            problems += [f"norm_affine {'ln' if ln else 'gn'} {dtype} {shape}: {p}"
                         for p in compare_norm_affine(sim, g, x, ln, groups)]
    return problems
