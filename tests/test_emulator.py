"""Every CUDA kernel of csrc/cuda, executed on the CPU by the SIMT emulator (tests/emulator) and
compared with the CPU implementation of the same op; the emulator's own planted-bug tests.

The emulator library is compiled from the unmodified kernel headers and launch sequences
(csrc/cuda/*_launch.cuh), so what runs here is what runs on a GPU, thread by thread, with CUDA's
execution model (see tests/emulator/simt.h). Comparisons: bit-identical for the Philox stream and
for ``round(x * factor)``, to accumulation rounding for norms, factors and the clipping VJP.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import bpclip_fast  # noqa: F401  (loads the CPU ops)

sys.path.insert(0, str(Path(__file__).parent / "emulator"))
import harness  # noqa: E402

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
DT_IDS = ["f32", "f64", "f16", "bf16"]

# Shapes chosen for the kernels' edges: one example and one element; a row shorter than, equal to
# and one past a warp; rows of exactly one reduction chunk / scale tile (4096) and one past it;
# many chunks per row (70000 = 17 chunks + a tail); more rows than a block has warps (8) and
# than a warp has lanes (finalize reads rows warp by warp).
L2_SHAPES = [(1, 1), (1, 5), (3, 31), (2, 32), (4, 33), (5, 4095), (2, 4096), (3, 4097), (2, 9000), (9, 100),
             (33, 7), (1, 70000), (2, 3, 5)]
# l15: channels (groups) above and below a warp, spatial sizes across a chunk boundary.
L15_SHAPES = [(1, 1, 1, 1), (2, 3, 5, 7), (3, 16, 8, 8), (2, 2, 70, 70), (9, 40, 3, 3), (1, 33, 1, 1)]


@pytest.fixture(scope="session")
def sim():
    s = harness.Simt(harness.build_library())
    harness.SESSION.append(s)  # for the run's summary line (tests/conftest.py)
    return s


def _schedule(sim, request):
    # A seeded-random schedule per test: thread and block orders differ from test to test.
    sim.schedule("random", abs(hash(request.node.nodeid)) % (1 << 32))


def _data(shape, dtype, seed, nonfinite=False):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * torch.rand(shape[0], *([1] * (len(shape) - 1)), generator=gen) * 3)
    if nonfinite and shape[0] > 1:
        x.view(shape[0], -1)[1, -1] = float("inf")
        x.view(shape[0], -1)[0, 0] = float("nan")
    return x.to(dtype)


def _bound_between_norms(x, norm):
    """A bound that some rows exceed and some do not, well away from every row's norm."""
    flat = x.double().reshape(x.shape[0], -1)
    if norm == "l15":
        n = x.double().abs().sum(dim=(2, 3)).pow(2).sum(1).sqrt()
    else:
        n = flat.pow(2).sum(1).sqrt()
    n = n[torch.isfinite(n)]
    if n.numel() == 0:
        return 1.0
    bound = float(n.median()) * 0.9 + 1e-3
    assert ((n - bound).abs() > 1e-3 * bound).all(), "test data: a norm sits on the bound"
    return bound


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("norm,shape", [("l2", s) for s in L2_SHAPES] + [("l15", s) for s in L15_SHAPES],
                         ids=str)
@pytest.mark.parametrize("clip_fn", ["clip", "global", "normalize"])
def test_clip_rows(sim, request, norm, shape, dtype, clip_fn):
    _schedule(sim, request)
    x = _data(shape, dtype, seed=len(request.node.nodeid), nonfinite=shape[0] > 2)
    assert harness.compare_clip_rows(sim, x, norm, clip_fn, _bound_between_norms(x, norm)) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("shape", L2_SHAPES, ids=str)
def test_scale_rows(sim, request, shape, dtype):
    # The backward's rebuild of the clipped input: RZ(factor * x) per row, bit for bit with the CPU
    # op; factors above 1 (normalize), below, and 0 (a dropped row: zeros whatever x holds).
    _schedule(sim, request)
    x = _data(shape, dtype, seed=len(request.node.nodeid), nonfinite=shape[0] > 2)
    gen = torch.Generator().manual_seed(len(request.node.nodeid))
    factor = (torch.rand(shape[0], generator=gen, dtype=torch.float64) * 3).to(harness.acc_dtype(dtype))
    if shape[0] > 2:  # rows 0 and 1 hold a NaN and an Inf, scaled as any value; row 2 is dropped
        factor[2] = 0
    assert harness.compare_scale_rows(sim, x, factor) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("shape", L2_SHAPES, ids=str)
@pytest.mark.parametrize("clip_fn", ["clip", "global", "normalize"])
def test_clip_rows_backward(sim, request, shape, dtype, clip_fn):
    _schedule(sim, request)
    x = _data(shape, dtype, seed=len(request.node.nodeid))
    g = _data(shape, dtype, seed=len(request.node.nodeid) + 1)
    assert harness.compare_clip_rows_backward(sim, x, g, clip_fn, _bound_between_norms(x, "l2")) == []


# Lengths for the kernel's paths: under one group (n < 8), one group, a partial last group; one warp
# tile (32 groups, 256 elements) exactly, one past it and a group past it; several tiles plus a tail
# of whole groups (1024 + 8) and of a partial group; many tiles (40001: the grid strides).
NOISE_LENGTHS = [1, 3, 4, 5, 7, 8, 256, 257, 264, 1023, 1025, 1032, 4 * 256 + 1, 40001]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("n", NOISE_LENGTHS)
@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "accumulate"])
def test_philox_noise_matches_cpu_bit_for_bit(sim, request, n, dtype, accumulate):
    _schedule(sim, request)
    assert harness.compare_noise(sim, n, dtype, seed=2**61 + n, offset=(7 << 20) | 6, std=0.9,
                                 accumulate=accumulate) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("misalign", [1, 3])
@pytest.mark.parametrize("n", [6, 300, 2063])
@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "accumulate"])
def test_philox_noise_misaligned_view(sim, request, n, dtype, misalign, accumulate):
    # A view that starts 1 or 3 elements into its storage (t[1:], t[3:]): its pointer is not
    # 16-byte aligned for any dtype, so 16-byte accesses would fault on a GPU; the stream is still
    # indexed from the view's first element, and nothing before or after the view is touched.
    _schedule(sim, request)
    assert harness.compare_noise(sim, n, dtype, seed=5 + n, offset=(3 << 32) | 9, std=1.7, accumulate=accumulate,
                                 misalign=misalign) == []


@pytest.mark.parametrize("blocks,threads", [(1, 32), (3, 64), (2, 256)])
@pytest.mark.parametrize("dtype,misalign", [(torch.float32, 0), (torch.float32, 1), (torch.float16, 0),
                                            (torch.float64, 1)], ids=["f32", "f32-misaligned", "f16", "f64-misaligned"])
@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "accumulate"])
def test_philox_noise_grid_stride_loop(sim, request, blocks, threads, dtype, misalign, accumulate):
    # Grids far smaller than the buffer: every thread strides over several counter blocks.
    _schedule(sim, request)
    assert harness.compare_noise(sim, 10007, dtype, seed=11, offset=1, std=1.0, accumulate=accumulate,
                                 blocks=blocks, threads=threads, misalign=misalign) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "accumulate"])
def test_philox_noise_launcher_grid_on_a_one_sm_device(sim, request, dtype, accumulate):
    # The launcher's own grid is one resident wave (8 blocks per SM): on a 1-SM device that is 64
    # warps for 157 warp tiles, so the grid-stride loop runs 2 or 3 times per warp.
    _schedule(sim, request)
    assert harness.compare_noise(sim, 40001, dtype, seed=2**40 + 3, offset=17, std=0.6, accumulate=accumulate,
                                 sm_count=1) == []


# The scale (the engine's mean-loss d/B̄, applied after the noise in the same launch): bit for bit the
# CPU op without it followed by mul_(scale), for every dtype, both store paths (packed and
# misaligned slots), the tail, and a scale whose product rounds (1/3) and one that subnormalises
# nothing but halves (0.5), and one above 1.
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("n,misalign", [(7, 0), (1025, 0), (2063, 1)])
@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "accumulate"])
@pytest.mark.parametrize("scale", [1 / 3, 0.5, 1.75])
def test_philox_noise_scale_is_a_later_mul(sim, request, n, misalign, dtype, accumulate, scale):
    _schedule(sim, request)
    assert harness.compare_noise(sim, n, dtype, seed=2**59 + n, offset=(5 << 20) | 2, std=0.7, accumulate=accumulate,
                                 misalign=misalign, scale=scale) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("nw,nb", [(5, 3), (1032, 7), (10007, 257)])
@pytest.mark.parametrize("acc_w,acc_b", [(False, True), (True, True)])
def test_philox_noise2_scale_is_a_later_mul(sim, request, nw, nb, dtype, acc_w, acc_b):
    _schedule(sim, request)
    assert harness.compare_noise2(sim, nw, nb, dtype, seed=2**58 + nw, offset=(3 << 20) | 8, std=1.1,
                                  accumulate_w=acc_w, accumulate_b=acc_b, scale=1 / 3) == []


def _noise_launches(sim):
    """{(template arguments of philox_noise_kernel): launches} so far."""
    out = {}
    for name, (launches, _, _) in sim.stats().items():
        if harness.kernel_base_name(name) == "philox_noise_kernel":
            args = name.split("(")[0].split("<", 1)[1].rstrip(">")
            out[args] = launches
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_philox_noise_packs_only_aligned_buffers(sim, dtype):
    # The host tolerates the misaligned 16-byte accesses that would fault on a GPU, so the bit
    # comparisons above cannot see a misaligned buffer sent to the packed variant: check the choice.
    sim.schedule("in_order", 0)
    for misalign, packed in ((0, "true"), (1, "false"), (3, "false")):
        before = _noise_launches(sim)
        assert harness.compare_noise(sim, 300, dtype, seed=1, offset=2, std=1.0, accumulate=False,
                                     misalign=misalign) == []
        after = _noise_launches(sim)
        new = {args for args in after if after[args] != before.get(args, 0)}
        assert len(new) == 1 and next(iter(new)).endswith(", false, " + packed), (misalign, new)


# philox_noise2_: a layer's weight and bias in one launch, each bit for bit philox_noise_ (the bias
# at offset + 1): sizes as NOISE_LENGTHS for either buffer, empty ones, every accumulate pairing.
NOISE2_SIZES = [(0, 0), (0, 9), (5, 0), (1, 1), (256, 1), (257, 264), (1032, 7), (40001, 1025)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("nw,nb", NOISE2_SIZES)
@pytest.mark.parametrize("acc_w,acc_b", [(False, False), (False, True), (True, False), (True, True)])
def test_philox_noise2_matches_two_cpu_calls(sim, request, nw, nb, dtype, acc_w, acc_b):
    _schedule(sim, request)
    assert harness.compare_noise2(sim, nw, nb, dtype, seed=2**60 + nw, offset=(9 << 20) | 4, std=0.9,
                                  accumulate_w=acc_w, accumulate_b=acc_b) == []


@pytest.mark.parametrize("blocks,threads", [(1, 32), (3, 64), (2, 256)])
@pytest.mark.parametrize("dtype,misalign", [(torch.float32, 0), (torch.float32, 1), (torch.float16, 0),
                                            (torch.float64, 3)], ids=["f32", "f32-misaligned", "f16", "f64-misaligned"])
def test_philox_noise2_grid_stride_and_misaligned(sim, request, blocks, threads, dtype, misalign):
    # Small grids: warps stride over both buffers' tiles, the bias' numbered on after the weight's.
    _schedule(sim, request)
    assert harness.compare_noise2(sim, 10007, 2063, dtype, seed=11, offset=2**63 - 1, std=1.0, accumulate_w=False,
                                  accumulate_b=True, blocks=blocks, threads=threads, misalign=misalign) == []


# layer_tail_ (tail_kernels.cuh): one launch of three jobs by block range. w and b bit for bit with
# the CPU op (the bias' sum in bpclip_fast/tail.h's slice order: rows fewer than, not a multiple of
# and many times the 8 slices; columns within and past one 32-column block), the VJP as clip_rows_backward's;
# a draw or only a scale; w misaligned (unpacked noise); a one-SM device (warps stride over w's
# tiles); the counter word wrapping between w's key and b's.
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("nw,nb,R,jvp_rows,N,std,scale,misalign,offset,sms", [
    (300, 37, 19, 5, 70, 0.8, 1.0, 0, 5, 132),
    (300, 37, 3, 0, 0, 0.8, 0.5, 0, 5, 132),
    (10007, 70, 200, 2, 4100, 1.1, 0.25, 0, 2**64 - 1, 1),
    (4099, 40, None, 0, 0, 1.3, 0.25, 1, 9, 132),
    (257, 3, 2, 3, 33, 0.0, 2.0, 0, 5, 132),
    (257, 3, None, 3, 33, 0.0, 1.0, 0, 5, 132),
    (600, 0, None, 9, 33, 0.5, 1.5, 0, 7, 132),
    # an empty batch's rows ([0, nb], a null pointer): b becomes zeros (+ noise), never its old
    # values (review 38 F1: the kernel took a null pointer for "no rows" and noised the buffer's garbage)
    (70, 9, 0, 0, 0, 0.0, 1.0, 0, 5, 132),
    (70, 9, 0, 0, 0, 0.7, 0.5, 0, 5, 132),
    (0, 40, 0, 0, 0, 0.9, 1.0, 0, 5, 132),
])
def test_layer_tail_matches_cpu(sim, request, dtype, nw, nb, R, jvp_rows, N, std, scale, misalign, offset, sms):
    _schedule(sim, request)
    assert harness.compare_layer_tail(sim, dtype, nw, nb, R, jvp_rows, N, std, scale, misalign, offset=offset,
                                      sm_count=sms) == []


# banded_row_: one correlated-noise row (band_kernels.cuh) vs the CPU op, ring and outs bit for bit.
# Rows under one group, of one tile exactly, a tile + a partial group, several tiles + a tail; b = 2
# (one slot, read then overwritten), 3 and 16 (several ages, the slot walk wrapping from every
# newest); outs covering all of the row, part of it (gaps, an element at each end uncovered), none.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("P", [5, 256, 263, 2063])
@pytest.mark.parametrize("bands,newest", [(2, 0), (3, 0), (3, 1), (16, 0), (16, 9), (16, 14)])
@pytest.mark.parametrize("covers", ["all", "part", "none"])
def test_banded_row_matches_cpu_bit_for_bit(sim, request, dtype, P, bands, newest, covers):
    _schedule(sim, request)
    cov = {"all": ((0, P - P // 3), (P - P // 3, P // 3)), "part": ((1, P // 2), (P // 2 + 2, P - P // 2 - 3)),
           "none": ()}[covers]
    cov = tuple((s, n) for s, n in cov if n > 0)
    assert harness.compare_banded_row(sim, P, bands, dtype, newest, cov, seed=2**62 + P, offset=(5 << 33) | 3,
                                      std=0.7) == []


@pytest.mark.parametrize("blocks,threads", [(1, 32), (3, 64), (2, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_banded_row_grid_stride_loop(sim, request, blocks, threads, dtype):
    # grids far smaller than the row: every warp strides over several tiles
    _schedule(sim, request)
    assert harness.compare_banded_row(sim, 10007, 4, dtype, 2, ((3, 9000), (9003, 1000)), seed=11, offset=2**63 + 5,
                                      std=1.3, blocks=blocks, threads=threads) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("shape", [(0, 5), (1, 1), (3, 31), (4, 33), (2, 4097), (9, 100)], ids=str)
@pytest.mark.parametrize("mask_y", [False, True])
def test_scale_rows2_matches_scale_rows(sim, request, shape, dtype, mask_y):
    _schedule(sim, request)
    x = _data(shape, dtype, seed=len(request.node.nodeid), nonfinite=shape[0] > 2)
    y = _data(shape[:1] + (4100,), dtype, seed=len(request.node.nodeid) + 1, nonfinite=shape[0] > 2)
    gen = torch.Generator().manual_seed(len(request.node.nodeid))
    fx = (torch.rand(shape[0], generator=gen, dtype=torch.float64) * 3).to(harness.acc_dtype(dtype))
    fy = (torch.rand(shape[0], generator=gen, dtype=torch.float64) * 3).to(harness.acc_dtype(dtype))
    if shape[0] > 2:
        fx[2] = fy[2] = fy[0] = 0
    assert harness.compare_scale_rows2(sim, x, fx, y, fy, mask_y) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("norm,shape", [("l2", (1, 5)), ("l2", (4, 33)), ("l2", (3, 4097)), ("l15", (3, 16, 8, 8))],
                         ids=str)
def test_clip_rows_rescale_matches_clip_rows_and_scale_rows(sim, request, norm, shape, dtype):
    _schedule(sim, request)
    g = _data(shape, dtype, seed=len(request.node.nodeid), nonfinite=shape[0] > 2)
    x = _data(shape[:1] + (70,), dtype, seed=len(request.node.nodeid) + 2)
    gen = torch.Generator().manual_seed(len(request.node.nodeid))
    fx = (torch.rand(shape[0], generator=gen, dtype=torch.float64) * 3).to(harness.acc_dtype(dtype))
    fx[-1] = 0
    assert harness.compare_clip_rows_rescale(sim, g, norm, "clip", _bound_between_norms(g, norm), x, fx) == []


# norm_affine_example_grads. LayerNorm [B, T, D]: T at, one past and well past the 64-row chunk
# (one chunk: no finalize; several: partials and finalize), outputs (B·D·chunks threads) below,
# at and across a 256-thread block, D = 1, and normalized_shape of two dims. GroupNorm [B, C, S]:
# S below, at and past a warp and across the 4096-element chunk, G = 1 and G = C, more
# (example, channel) warps than a block holds (8).
LN_AFFINE_CASES = [((1, 1, 1), 1), ((2, 64, 33), 1), ((2, 65, 33), 1), ((3, 200, 7), 1), ((1, 130, 300), 1),
                   ((4, 3, 64), 1), ((5, 1), 1), ((2, 70, 1), 1), ((2, 9, 4, 5), 2), ((2, 3, 4, 5), 2)]
GN_AFFINE_CASES = [((1, 1, 1), 1), ((2, 6, 31), 3), ((2, 4, 32), 2), ((3, 8, 33), 8), ((2, 3, 4097), 1),
                   ((1, 2, 8193), 2), ((9, 5, 7), 1), ((2, 6, 5, 7), 6), ((3, 12, 3, 3), 4)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("shape,normalized_dims", LN_AFFINE_CASES, ids=str)
def test_norm_affine_layer_norm(sim, request, shape, normalized_dims, dtype):
    _schedule(sim, request)
    g = _data(shape, dtype, seed=len(request.node.nodeid))
    x = _data(shape, dtype, seed=len(request.node.nodeid) + 1) + 0.5
    assert harness.compare_norm_affine(sim, g, x, True, normalized_dims=normalized_dims) == []


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("shape,groups", GN_AFFINE_CASES, ids=str)
def test_norm_affine_group_norm(sim, request, shape, groups, dtype):
    _schedule(sim, request)
    g = _data(shape, dtype, seed=len(request.node.nodeid))
    x = _data(shape, dtype, seed=len(request.node.nodeid) + 1) - 0.25
    assert harness.compare_norm_affine(sim, g, x, False, groups) == []


# examples_bound / examples_release (DenseExamples). B = 0, 1, one part each (8), one past, many;
# rows below, at and past the 256 partial sums (the bias straddling one), tiles of 32 below, at and
# past; weight only, bias only. Bit for bit: both backends follow bpclip_fast/examples.h's orders.
EXAMPLES_CASES = [(0, (5,), (5,)), (1, (1,), None), (8, (32,), (32,)), (9, (33,), (7,)), (19, (200,), (100,)),
                  (3, None, (257,)), (2, (16, 40), (640,)), (40, (3,), (3,))]


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("case", EXAMPLES_CASES, ids=str)
@pytest.mark.parametrize("noise", [(0.0, 1.0), (1.1, 0.3)], ids=["plain", "noised"])
def test_examples_bound_and_release(sim, request, case, dtype, noise):
    _schedule(sim, request)
    B, ws, bs = case
    gen = torch.Generator().manual_seed(len(request.node.nodeid))
    w, b, factor = harness.examples_inputs(dtype, B, ws, bs, gen, nonfinite=True)
    std, scale = noise
    assert harness.compare_examples(sim, w, b, factor, 0xDEADBEEF12, 6, std, scale, count=True) == []


@pytest.mark.parametrize("policy", ["in_order", "reverse", "random"])
def test_results_do_not_depend_on_the_schedule(sim, policy):
    # Our reductions have a fixed order (no float atomics), so every schedule gives the same bits.
    x = _data((5, 9000), torch.float32, seed=3)
    outs = []
    for p in ("in_order", policy):
        sim.schedule(p, 99)
        out, factor, nrm = torch.full_like(x, float("nan")), torch.empty(5), torch.empty(5)
        sim.clip_rows(x, out, factor, nrm, torch.zeros(1, dtype=torch.int64), l15=False, bound=50.0, clip_fn="clip",
                      gamma=0.01)
        outs.append((out, factor, nrm))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_every_global_kernel_is_launched(sim):
    """Fails when csrc/cuda has a __global__ kernel that the emulator tests never launch."""
    kernels = harness.global_kernels()
    assert {"row_partial_kernel", "finalize_rows_kernel", "scale_rows_kernel", "clip_jvp_kernel",
            "philox_noise_kernel", "philox_noise2_kernel", "scale_rows2_kernel", "ln_affine_partial_kernel",
            "gn_affine_partial_kernel", "affine_finalize_kernel", "examples_bound_kernel",
            "examples_release_kernel", "banded_row_kernel", "layer_tail_kernel"} <= kernels, "the __global__ scan of csrc/cuda finds too little"
    sim.schedule("random", 7)
    assert harness.sweep(sim) == []
    launched = {harness.kernel_base_name(name) for name in sim.stats()}
    missing = kernels - launched
    assert not missing, f"kernels in csrc/cuda that no emulator test launches: {sorted(missing)}"


# ---- exact_bound_ and exact_factors (csrc/cuda/bound_kernels.cuh, bpclip_fast/bound.h) --------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T,ghost,per,conv_layout", [(1, False, 1, False), (1, False, 3, True), (7, True, 1, False),
                                                     (33, True, 2, True), (70, False, 1, False),
                                                     (40, False, 3, True), (300, False, 1, True),
                                                     (260, True, 1, False)])  # T > kBoundLanes: every warp
@pytest.mark.parametrize("flags", [3, 1, 2])  # weight and bias, weight only, bias only
def test_exact_bound_matches_cpu_bit_for_bit(sim, request, dtype, T, ghost, per, conv_layout, flags):
    _schedule(sim, request)
    gen = torch.Generator().manual_seed(T * 31 + per + flags)
    rows = 5 * per
    xs, gs, gb, wa, wb = harness.bound_inputs(dtype, rows, T, 6, 45, per, ghost, gen, conv_layout=conv_layout)
    flags |= 4 if ghost else 0
    assert harness.compare_exact_bound(sim, xs, gs, gb, wa, wb, per, flags, harness.bound_consts(gen)) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T,per,conv_layout", [(70, 1, False), (40, 3, True)])
def test_exact_bound_with_the_bias_summed_matches_cpu_bit_for_bit(sim, request, dtype, T, per, conv_layout):
    # Flag 8 (csrc/exact.cpp's kept per-example gradients): gb is the bias itself, [rows, 1, p], one
    # position; a kept bias that overflowed (+Inf) is counted alike.
    _schedule(sim, request)
    gen = torch.Generator().manual_seed(T + per)
    xs, gs, _, wa, wb = harness.bound_inputs(dtype, 5 * per, T, 6, 45, per, False, gen, conv_layout=conv_layout)
    gb = gs.sum(1, keepdim=True)
    gb[2, 0, 3] = float("inf")
    assert harness.compare_exact_bound(sim, xs, gs, gb, wa, wb, per, 1 | 2 | 8, harness.bound_consts(gen)) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T,d,p,conv_layout,ghost", [(1, 4100, 700, False, False),  # x in 256 parts, g in 32
                                                     (1, 47, 33, True, False),  # 2 parts each, odd tails
                                                     (3, 300, 40, True, False),  # 16, 2
                                                     (5, 1000, 20, False, True),  # 32, 1
                                                     (100, 90, 17, True, False),  # 4, 1; positions on adjacent lanes
                                                     (300, 5000, 3, True, False)])  # 256 (one position a block), 1
def test_exact_bound_with_positions_in_parts_matches_cpu_bit_for_bit(sim, request, dtype, T, d, p, conv_layout, ghost):
    # bound.h's position_split: the CPU's row_sums and the CUDA position_sums_kernel sum the parts
    # in different loop orders, each part's additions and the parts' tree alike.
    _schedule(sim, request)
    gen = torch.Generator().manual_seed(T * 7 + d)
    xs, gs, gb, wa, wb = harness.bound_inputs(dtype, 3, T, d, p, 1, ghost, gen, conv_layout=conv_layout)
    xs[1].mul_(1e3)  # parts of very different sizes: the order shows in the bits
    assert harness.compare_exact_bound(sim, xs, gs, gb, wa, wb, 1, 3 | (4 if ghost else 0), harness.bound_consts(gen)) == []


def test_position_split_follows_the_entry_count(sim):
    # The split is a function of the entry count alone; CPU and CUDA both call bound.h's
    # position_split, so this checks the rule the docs state: parts of >= 16 entries, at most 256.
    assert [sim.position_split(n) for n in (1, 31, 32, 63, 64, 288, 4095, 4096, 10 ** 6)] == \
        [1, 1, 2, 2, 4, 16, 128, 256, 256]


def test_exact_bound_counts_nonfinite_as_cpu(sim):
    gen = torch.Generator().manual_seed(4)
    xs, gs, gb, wa, wb = harness.bound_inputs(torch.float32, 6, 1, 5, 4, 1, False, gen)
    xs[1, 0, 2] = float("inf")
    gs[4, 0, 0] = float("nan")
    assert harness.compare_exact_bound(sim, xs, gs, gb, wa, wb, 1, 3, harness.bound_consts(gen)) == []


@pytest.mark.parametrize("fp64", [False, True])
@pytest.mark.parametrize("layers", [1, 4])
@pytest.mark.parametrize("clip_fn", ["clip", "normalize", "global"])
def test_exact_factors_matches_cpu_bit_for_bit(sim, request, fp64, layers, clip_fn):
    _schedule(sim, request)
    gen = torch.Generator().manual_seed(layers)
    bounds = [torch.exp(torch.randn(300, generator=gen, dtype=torch.float64) * 15) for _ in range(layers)]
    f32max = torch.finfo(torch.float32).max
    bounds[0][:6] = torch.tensor([float("nan"), float("inf"), f32max * (1 + 2.0 ** -30), 2.0 ** 61, 0.0, 1e-320],
                                 dtype=torch.float64)
    assert harness.compare_exact_factors(sim, bounds, 0.7, clip_fn, 0.05, fp64) == []


# ---- conv_patches (csrc/cuda/patches_kernels.cuh, bpclip_fast/patches.h) --------------------------

PATCH_GEOMETRIES = [([3, 3], [1, 1], [1, 1], [1, 1]), ([3, 3], [2, 1], [1, 0], [2, 2]),
                    ([2, 3], [1, 2], [0, 2], [1, 1]), ([1, 1], [2, 2], [0, 0], [1, 1])]


@pytest.mark.parametrize("dtype", list(harness.DTYPES))
@pytest.mark.parametrize("geo", PATCH_GEOMETRIES)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "sliced", "expanded"])
def test_conv_patches_matches_cpu_bit_for_bit(sim, request, dtype, geo, layout):
    """Across a tile boundary (2 x 5 x 9 x 64 x T elements), in every layout the norms path reads."""
    _schedule(sim, request)
    gen = torch.Generator().manual_seed(len(layout) + geo[0][1])
    x = torch.randn(2, 5, 13, 11, generator=gen, dtype=torch.float64).to(dtype)
    x[0, 0, 0, 0] = 0.25  # a nonzero first pixel (offset 0)
    x[1, 2, 3, 4] = -0.0
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "sliced":
        x = torch.cat([x, x], 3)[:, 1:, 2:, ::2]
    elif layout == "expanded":
        x = x[:1].expand(2, -1, -1, -1)
    assert harness.compare_conv_patches(sim, x, *geo) == []


# ---- the emulator's conversions -------------------------------------------------------------------

def _floats_around_half_edges():
    """Every half value, the midpoints between neighbours (ties), their float neighbours, the
    subnormal and overflow ranges, and random floats of every exponent."""
    h = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    h = h[torch.isfinite(h)].double().sort().values
    mids = ((h[1:] + h[:-1]) / 2).float()
    f = torch.cat([h.float(), mids, torch.nextafter(mids, torch.tensor(float("inf"))),
                   torch.nextafter(mids, torch.tensor(-float("inf")))])
    bits = torch.randint(-(1 << 31), (1 << 31) - 1, (200000,), generator=torch.Generator().manual_seed(0),
                         dtype=torch.int64).to(torch.int32).view(torch.float32)
    special = torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65520.0, 1e30, -1e30, float("inf"), -float("inf"),
                            2.0 ** -24, 2.0 ** -25, 1.5 * 2.0 ** -25, 2.0 ** -26, 1e-45, 3.4e38])
    return torch.cat([f, bits[torch.isfinite(bits)], special, -f]).contiguous()


def test_half_conversions_match_torch(sim):
    x = _floats_around_half_edges()
    out = torch.empty(x.numel(), dtype=torch.int16)
    sim.lib.simt_f32_to_f16(harness._ptr(x), harness._ptr(out), x.numel(), 0)
    assert torch.equal(out, x.to(torch.float16).view(torch.int16))
    back = torch.empty(x.numel(), dtype=torch.float32)
    allh = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    back = torch.empty(allh.numel(), dtype=torch.float32)
    sim.lib.simt_f16_to_f32(harness._ptr(allh), harness._ptr(back), allh.numel())
    ref = allh.view(torch.float16).float()
    finite = torch.isfinite(ref) | torch.isinf(ref)
    assert torch.equal(back[finite], ref[finite]) and torch.isnan(back[~finite]).all()
    # toward zero never increases the magnitude and stays within one half ulp
    rz = torch.empty(x.numel(), dtype=torch.int16)
    sim.lib.simt_f32_to_f16(harness._ptr(x), harness._ptr(rz), x.numel(), 1)
    rzf = rz.view(torch.float16).float()
    ok = torch.isfinite(x)
    assert (rzf[ok].abs() <= x[ok].abs()).all()


def test_bfloat16_conversions_match_torch(sim):
    x = _floats_around_half_edges()
    mids = (x.view(torch.int32) & ~0xFFFF) | 0x8000  # exact ties between two bf16 values
    x = torch.cat([x, mids.view(torch.float32)])
    x = x[~torch.isnan(x)].contiguous()
    out = torch.empty(x.numel(), dtype=torch.int16)
    sim.lib.simt_f32_to_bf16(harness._ptr(x), harness._ptr(out), x.numel(), 0)
    assert torch.equal(out, x.to(torch.bfloat16).view(torch.int16))
    allb = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    back = torch.empty(allb.numel(), dtype=torch.float32)
    sim.lib.simt_bf16_to_f32(harness._ptr(allb), harness._ptr(back), allb.numel())
    ref = allb.view(torch.bfloat16).float()
    nan = torch.isnan(ref)
    assert torch.equal(back[~nan], ref[~nan]) and torch.isnan(back[nan]).all()


# ---- the emulator itself: features, and the planted bugs it must expose -------------------------

def _f32(t):
    return harness._ptr(t)


@pytest.mark.parametrize("policy", ["in_order", "reverse", "random"])
def test_selftest_collectives(sim, policy):
    sim.schedule(policy, 3)
    blocks, threads = 2, 96
    x = torch.randint(-10, 11, (blocks * threads,), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    out = torch.full((blocks * threads, 8), -999, dtype=torch.int64)
    sim.call("simt_selftest_collectives", _f32(x), blocks, threads, _f32(out))
    v = x.view(blocks, threads // 32, 32).long()
    lane = torch.arange(32)
    ballot = ((v > 0).long() << lane).sum(-1, keepdim=True).expand_as(v)
    anyv = (v > 5).any(-1, keepdim=True).long().expand_as(v)
    allv = (v > -100).all(-1, keepdim=True).long().expand_as(v)
    up = torch.where(lane >= 3, v.roll(3, -1), v)
    idx = v.flip(-1)
    seg = v.view(blocks, threads // 32, 4, 8)
    down = torch.where(torch.arange(8) + 5 < 8, seg.roll(-5, -1), seg).view_as(v)
    count = (x.view(blocks, threads) > 0).sum(-1, keepdim=True).expand(blocks, threads).reshape_as(v)
    orv = (x.view(blocks, threads) == 7).any(-1, keepdim=True).long().expand(blocks, threads).reshape_as(v)
    expect = torch.stack([ballot, anyv, allv, up, idx, down, count, orv], -1).reshape(-1, 8)
    assert torch.equal(out, expect)


def test_selftest_atomics_and_3d_ids(sim):
    sim.schedule("random", 5)
    n = 1000
    x = torch.arange(n, dtype=torch.float32) / 8  # exact in fp32 whatever the order
    bins = (torch.arange(n, dtype=torch.int32) * 7) % 13
    s = torch.zeros(1)
    hist = torch.zeros(13, dtype=torch.int32)
    mx = torch.full((1,), -1, dtype=torch.int32)
    sim.call("simt_selftest_atomics", _f32(x), _f32(bins), n, _f32(s), _f32(hist), _f32(mx))
    assert s.item() == x.sum().item()
    assert torch.equal(hist, torch.bincount(bins, minlength=13).int()) and mx.item() == 12
    grid, block = (3, 2, 2), (4, 3, 2)
    g = torch.tensor(grid, dtype=torch.int32)
    b = torch.tensor(block, dtype=torch.int32)
    out = torch.full((12 * 24, 6), -1, dtype=torch.int32)
    sim.call("simt_selftest_ids", _f32(g), _f32(b), _f32(out))
    bz, by, bx, tz, ty, tx = torch.meshgrid(*[torch.arange(d) for d in (2, 2, 3, 2, 3, 4)], indexing="ij")
    expect = torch.stack([tx, ty, tz, bx, by, bz], -1).reshape(-1, 6).int()
    assert torch.equal(out, expect)


@pytest.mark.parametrize("which,message", [(0, "divergent barrier"), (1, "exited"),
                                           (2, "does not name the calling lane"),
                                           (3, "different collectives")])
def test_selftest_misuse_is_reported(sim, which, message):
    sim.schedule("in_order", 0)
    with pytest.raises(harness.SimtError, match=message):
        sim.call("simt_selftest_misuse", which)
    # The error was taken: the next launch runs.
    test_selftest_collectives(sim, "in_order")


# Planted bugs in the self-test kernels (tests/emulator/selftest_kernels.cpp): (bug id, runner).
def _block_sum(sim, bug):
    n = 1000
    x = torch.randn(n, generator=torch.Generator().manual_seed(2))
    out = torch.full((4,), 12345.0)
    sim.call("simt_selftest_block_sum", _f32(x), n, _f32(out), bug)
    return torch.allclose(out, torch.nn.functional.pad(x, (0, 24)).view(4, 256).sum(1), rtol=1e-5, atol=1e-5)


def _half_warp_sum(sim, bug):
    x = torch.randn(256, generator=torch.Generator().manual_seed(3))
    out = torch.zeros(256)
    sim.call("simt_selftest_half_warp_sum", _f32(x), 256, _f32(out), bug)
    return torch.allclose(out, x.view(16, 16).sum(1, keepdim=True).expand(16, 16).reshape(-1), rtol=1e-5, atol=1e-5)


def _reverse_block(sim, bug):
    x = torch.randn(3 * 128, generator=torch.Generator().manual_seed(4))
    out = torch.zeros(3 * 128)
    sim.call("simt_selftest_reverse_block", _f32(x), 3, 128, _f32(out), bug)
    return torch.equal(out, x.view(3, 128).flip(1).reshape(-1))


PLANTED = {
    "missing_syncthreads": (1, _block_sum),
    "shared_index_out_of_range": (2, _block_sum),
    "wrong_shuffle_lane": (3, _half_warp_sum),
    "missing_syncthreads_dynamic_shared": (4, _reverse_block),
}


@pytest.mark.parametrize("planted", [True, False], ids=["bug_in", "bug_out"])
@pytest.mark.parametrize("bug", list(PLANTED))
@pytest.mark.parametrize("policy,seed", [("in_order", 0), ("random", 1), ("random", 2), ("random", 3)])
def test_planted_bug_in_emulator_kernels(sim, bug, planted, policy, seed):
    """With the bug, the emulator reports an error or the result is wrong; without it, correct."""
    bug_id, runner = PLANTED[bug]
    sim.schedule(policy, seed)
    if planted:
        try:
            correct = runner(sim, bug_id)
        except harness.SimtError:
            correct = False
        assert not correct, f"planted bug {bug} went unnoticed under the {policy} schedule"
    else:
        assert runner(sim, 0)


def test_reverse_schedule_alone_would_miss_a_missing_barrier(sim):
    # Why the tests use seeded-random schedules: running threads last-to-first happens to order
    # this tree reduction's loads correctly even without the barrier.
    sim.schedule("reverse", 0)
    assert _block_sum(sim, PLANTED["missing_syncthreads"][0])


def test_out_of_range_shared_index_names_the_place(sim):
    sim.schedule("in_order", 0)
    with pytest.raises(harness.SimtError, match=r"out-of-bounds index 256 into 'float \[256\]' at selftest_kernels"):
        _block_sum(sim, PLANTED["shared_index_out_of_range"][0])


# Planted bugs in the real kernels: each is a one-line change to a copy of csrc/cuda, compiled into
# its own emulator library; the comparison sweep must catch it.
MUTANTS = {
    "warp_sum_skips_upper_lanes": ("clip_kernels.cuh", "for (int off = kWarpSize / 2; off > 0; off >>= 1)",
                                   "for (int off = kWarpSize / 4; off > 0; off >>= 1)"),
    "reduction_forgets_chunk_tail": ("clip_kernels.cuh", "for (int64_t j = lane; j < len; j += kWarpSize)",
                                     "for (int64_t j = lane; j < len - 1; j += kWarpSize)"),
    "scale_tile_runs_into_next_row": ("clip_kernels.cuh",
                                      "const int64_t hi = min64(lo + kScaleTile, (b + 1) * N);\n  const fac_t f",
                                      "const int64_t hi = lo + kScaleTile;\n  const fac_t f"),
    "half_rounds_toward_zero": ("dtypes.cuh", "return __float2half_rn(v);", "return __float2half_rz(v);"),
    "noise_writes_past_the_end": ("noise_kernels.cuh", "if (base + l >= n) break;", "if (base + l > n) break;"),
    # The warp's regrouping of a tile through shared memory, without each of its three __syncwarp.
    "noise_stage_read_before_all_lanes_wrote": ("noise_kernels.cuh",
                                                "__syncwarp();  // every lane's group staged before", "//"),
    "noise_stage_overwritten_before_read": ("noise_kernels.cuh", "__syncwarp();  // every slot read before", "//"),
    "noise_old_values_read_before_staged": ("noise_kernels.cuh", "__syncwarp();  // the old values of", "//"),
    "noise_last_partial_tile_packed": ("noise_kernels.cuh", "const int64_t tiles = n / kNoiseTile;",
                                       "const int64_t tiles = (n + kNoiseTile - 1) / kNoiseTile;"),
    # philox_noise2_: the bias drawn from the weight's stream; the bias' accumulate flag lost; the
    # mask of scale_rows2 ignored (the input's dropped rows kept).
    "noise2_bias_draws_the_weight_stream": ("noise_launch.cuh", "const uint64_t offset_b = offset + 1u;",
                                            "const uint64_t offset_b = offset;"),
    "noise2_bias_accumulate_flag_lost": ("noise_launch.cuh", "  if (accumulate_b) {\n    launch(philox_noise2_kernel",
                                         "  if (accumulate_b == kAccW) {\n    launch(philox_noise2_kernel"),
    "noise2_bias_tiles_on_the_weight_length": ("noise_kernels.cuh",
                                               "philox_noise_tiles<T, kAccB, false>(b, nb,",
                                               "philox_noise_tiles<T, kAccB, false>(b, nb < nw ? nb : nw,"),
    # banded_row_: the ages walked toward newer slots (wrong slot for every age past 1 once b > 2);
    # the row stored over the newest slot instead of the oldest; an age's sign lost.
    "band_ages_walk_the_wrong_way": ("band_kernels.cuh", "s = s == 0 ? a.slots - 1 : s - 1;",
                                     "s = s + 1 == a.slots ? 0 : s + 1;"),
    "band_row_stored_over_the_newest": ("band_kernels.cuh", "ring + static_cast<int64_t>((a.newest + 1) % a.slots) * P",
                                        "ring + static_cast<int64_t>(a.newest % a.slots) * P"),
    "band_age_sign_lost": ("band_kernels.cuh", "v = v + a.weights[k] * ring", "v = v - a.weights[k] * ring"),
    "scale_rows2_mask_ignored": ("clip_kernels.cuh", "scale_tile(y, fy, Ny, tiles_y, t - x_blocks, mask_y != 0, oy);",
                                 "scale_tile(y, fy, Ny, tiles_y, t - x_blocks, mask_y < 0, oy);"),
    "affine_finalize_skips_last_chunk": ("norm_affine_kernels.cuh", "for (int64_t k = 0; k < K; ++k) s += p[k * O];",
                                         "for (int64_t k = 0; k + 1 < K; ++k) s += p[k * O];"),
    "gn_affine_wrong_group": ("norm_affine_kernels.cuh", "(o % D) / (D / G)", "(o % D) % G"),
    "examples_bound_tree_skips_half": ("examples_kernels.cuh",
                                       "for (int half = kBoundParts / 2; half > 0; half >>= 1) {",
                                       "for (int half = kBoundParts / 4; half > 0; half >>= 1) {"),
    # examples_factors: the factor not rounded to fp32 for fp32 factors; its count taken from the
    # double bound (examples_bound's) instead of the rounded one that exact_factors counts.
    "examples_factors_not_rounded_to_fp32": ("examples_kernels.cuh",
                                             "example_factor(bound, sizeof(fac_t) == 8,",
                                             "example_factor(bound, true,"),
    "examples_factors_skip_their_count": ("examples_kernels.cuh", "if (odd) atomicAdd(nonfinite, 1ull);\n}\n\n// Block k",
                                          "\n}\n\n// Block k"),
    "examples_release_skips_last_example": ("examples_kernels.cuh",
                                            "for (int64_t b = p; b < B; b += kReleaseParts) {",
                                            "for (int64_t b = p; b + 1 < B; b += kReleaseParts) {"),
    "examples_release_bias_shares_weight_noise": ("examples_kernels.cuh", "const uint64_t off = is_w ? offset : offset + 1;",
                                                  "const uint64_t off = offset;"),
    "examples_release_scales_a_zero_factor_row": ("examples_kernels.cuh",
                                                  "if (f != acc_t(0)) s += to_acc(scale_store(f, x[b * N + o]));",
                                                  "s += to_acc(scale_store(f, x[b * N + o]));"),
    "finalize_grid_rounds_down": ("clip_launch.cuh", "launch(finalize_rows_kernel<fac_t>, warp_blocks(r.B),",
                                  "launch(finalize_rows_kernel<fac_t>, r.B / kWarpsPerBlock,"),
    "bound_reduction_skips_upper_lanes": ("bound_kernels.cuh",
                                          "for (int off = kBoundLanes / 2; off >= 32; off >>= 1) {",
                                          "for (int off = kBoundLanes / 4; off >= 32; off >>= 1) {"),
    "bound_reduction_skips_a_barrier": ("bound_kernels.cuh", "    __syncthreads();\n  }\n  if (lane < 32) {",
                                        "  }\n  if (lane < 32) {"),
    "bound_reduction_skips_warp_level": ("bound_kernels.cuh", "for (int off = 16; off > 0; off >>= 1) add_lane",
                                         "for (int off = 8; off > 0; off >>= 1) add_lane"),
    "bound_grid_skips_last_example": ("bound_launch.cuh", "launch(exact_bound_kernel<T>, s.examples,",
                                      "launch(exact_bound_kernel<T>, s.examples - 1,"),
    # The kernels' own position sums (every entry of a position, in the layout's strides; their parts'
    # tree; every block of them launched).
    "bound_positions_skip_last_entry": ("bound_kernels.cuh", "position_part(x + r * s.sx0 + t * s.sx1, s.dx, s.sx2, S, q)",
                                        "position_part(x + r * s.sx0 + t * s.sx1, s.dx - 1, s.sx2, S, q)"),
    "bound_position_parts_skip_a_level": ("bound_kernels.cuh", "for (int off = S / 2; off > 0; off >>= 1) {",
                                          "for (int off = S / 4; off > 0; off >>= 1) {"),
    "bound_position_tree_skips_a_barrier": ("bound_kernels.cuh",
                                            "if (q < off) parts[lane] += parts[lane + off * stride];\n      __syncthreads();",
                                            "if (q < off) parts[lane] += parts[lane + off * stride];"),
    "bound_position_parts_on_the_wrong_lanes": ("bound_kernels.cuh",
                                                "const int stride = by_position ? P : 1;",
                                                "const int stride = 1;"),
    "bound_position_grid_rounds_down": ("bound_launch.cuh",
                                        "(positions * split_g + kBoundLanes - 1) / kBoundLanes",
                                        "positions * split_g / kBoundLanes"),
    "patches_first_pixel_read_as_padding": ("patches_kernels.cuh", "out[e] = src < 0 ?", "out[e] = src <= 0 ?"),
    "patches_grid_rounds_down": ("patches_launch.cuh", "(total + kPatchTile - 1) / kPatchTile",
                                 "total / kPatchTile"),
    # layer_tail_: the bias' slices read before every warp wrote its own; the bias drawn from the
    # weight's stream; the weight's noise blocks numbered from the grid's first block (the VJP's and
    # the bias' blocks counted as noise warps: tiles skipped); the VJP's last tile not launched.
    "tail_bias_slices_read_before_written": ("tail_kernels.cuh", "    slices[slice][lane] = acc;\n    __syncthreads();",
                                             "    slices[slice][lane] = acc;"),
    "tail_bias_draws_the_weight_stream": ("tail_launch.cuh", "const uint64_t offset_b = offset + 1u;",
                                          "const uint64_t offset_b = offset;"),
    "tail_weight_blocks_numbered_from_the_grid": ("tail_kernels.cuh",
                                                  "const int64_t warp = (block - first) * per_block + in_block;",
                                                  "const int64_t warp = block * per_block + in_block;"),
    "tail_bias_rows_taken_from_the_pointer": ("tail_kernels.cuh", "  if (sum_rows) {\n    double acc = 0.0;",
                                              "  if (rows != nullptr) {\n    double acc = 0.0;"),
    "tail_jvp_grid_skips_last_tile": ("tail_launch.cuh", "jvp_blocks = r.B * tiles;", "jvp_blocks = r.B * tiles - 1;"),
    "factors_kernel_reads_wrong_layer_stride": ("bound_kernels.cuh", "layers_total(bounds + i, L, B, inflate)",
                                                "layers_total(bounds + i, L, 1, inflate)"),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_planted_bug_in_real_kernels_is_caught(sim, mutant, tmp_path):
    file, old, new = MUTANTS[mutant]
    kernel_dir = harness.mutated_kernel_dir(tmp_path / "cuda", file, old, new)
    bad = harness.Simt(harness.build_library(kernel_dir, harness.KERNEL_SOURCES))
    bad.schedule("random", 11)
    try:
        problems = harness.sweep(bad)
    except harness.SimtError as e:
        problems = [str(e)]
    assert problems, f"the emulator sweep did not notice the planted bug {mutant}"
    # Taken out again (the real kernels), the same sweep is clean.
    sim.schedule("random", 11)
    assert harness.sweep(sim) == []



# ---- word_checksum (csrc/cuda/checksum_kernels.cuh, bpclip_fast/checksum.h) ----------------------------

EXTREME_WORDS = [0, -1, 1, -(1 << 63), (1 << 63) - 1, -(1 << 33), (1 << 33) - 1, -(1 << 32)]


@pytest.mark.parametrize("n", [0, 1, 31, 32, 33, 255, 256, 257, 4097, 70000])
@pytest.mark.parametrize("blocks", [0, 1, 3])
def test_word_checksum_matches_the_exact_sum(sim, request, n, blocks):
    """Every lane, warp and block share of the grid-stride loop, the atomics in a random order, and
    the words whose arithmetic shift sign-extends: the exact sum modulo 2^64, to the bit."""
    _schedule(sim, request)
    gen = torch.Generator().manual_seed(n)
    words = torch.randint(-(1 << 63), (1 << 63) - 1, (n,), generator=gen, dtype=torch.int64)
    words[: min(n, len(EXTREME_WORDS))] = torch.tensor(EXTREME_WORDS[: min(n, len(EXTREME_WORDS))])
    assert harness.compare_word_checksum(sim, words, blocks) == []


def test_word_checksum_sees_two_sign_flips_in_the_high_halves(sim):
    """abs_ of two negative fp32 in the words' high halves moves each word by -2^63: the words' own
    sum cancels, the shifted part does not (emulated kernel and CPU op alike)."""
    words = torch.tensor([-(1 << 63) + 5, -(1 << 63) + 7, 11], dtype=torch.int64)
    flipped = words.clone()
    flipped[:2] += 1 << 63  # the sign bit of each word's high half cleared
    assert int(words.sum()) == int(flipped.sum())  # the plain word sum is blind to it
    assert int(sim.word_checksum(words)) != int(sim.word_checksum(flipped))
    assert int(torch.ops.bpclip_fast.word_checksum(words)) != int(torch.ops.bpclip_fast.word_checksum(flipped))
