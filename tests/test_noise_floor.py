"""The noise std's range (csrc/common.h, ``noise_std_ok``; bpclip_fast/engine/noise_range.py) and why
its floor is 2^-80: every nonzero float32 draw times a std at the floor is a float32 normal number,
so a CPU in flush-to-zero mode draws the same bits as one without (review 39 F2), and no std a run
can draw leaves the range on some batch sizes only (review 39 F1). And the float64 draw of float64
buffers (philox.h, ``box_muller_f64``): a float32 draw left every released coordinate minus its sum a
float32 number (review 40 F2)."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from bpclip_fast import PrivacyEngine, _ops
from bpclip_fast.rules import StepRefused

from philox_ref import philox4x32_10

sys.path.insert(0, str(Path(__file__).parent / "emulator"))
import harness  # noqa: E402

F = np.float32
FLT_MIN = float(np.finfo(np.float32).tiny)


def _log_pos(x):
    """csrc/include/bpclip_fast/philox.h's log_pos, operation for operation in float32 (the CPU build
    has no FMA contraction: -ffp-contract=off)."""
    bits = x.view(np.uint32)
    e = (((bits >> 23) & 0xFF).astype(np.int32) - 126).astype(F)
    m = ((bits & 0x007FFFFF) | 0x3F000000).astype(np.uint32).view(F)
    small = (m < F(0.70710678118654752)).astype(F)
    e = e - small
    m = (m + m * small) - F(1.0)
    z = m * m
    y = F(7.0376836292e-2)
    for c in (-1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1, -1.6668057665e-1,
              2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1):
        y = y * m + F(c)
    y = y * m * z
    y = y + F(-2.12194440e-4) * e
    y = y + F(-0.5) * z
    return m + y + F(0.693359375) * e


def _sin_cos_2pi(u):
    """philox.h's cos_sin_2pi before the quadrant's swap and signs (which do not change magnitudes)."""
    q = u * F(4.0)
    j = (q + F(0.5)).astype(np.int32).astype(F)
    phi = (q - j) * F(1.57079632679489662)
    p2 = phi * phi
    s = F(-1.9515295891e-4)
    s = s * p2 + F(8.3321608736e-3)
    s = s * p2 - F(1.6666654611e-1)
    s = phi + phi * p2 * s
    c = F(2.443315711809948e-5)
    c = c * p2 - F(1.388731625493765e-3)
    c = c * p2 + F(4.166664568298827e-2)
    c = F(1.0) - F(0.5) * p2 + p2 * p2 * c
    return s, c


def test_no_draw_is_zero_and_the_smallest_times_the_floor_is_a_normal_number():
    """Enumerates the construction: every radius the clamped u1 gives (u1 over every float32 in
    [1/2, 1 - 2^-24]: the smallest radii; below 1/2 they exceed 1.17) and every one of the 2^23
    angle cells' midpoints. No radius and no sine or cosine is 0, so no draw is exactly 0 (review 40
    F1); the smallest |z| times the floor, rounded down by the product's half ulp, clears FLT_MIN
    with a margin of 2^12 (room for the GPU's FMA contraction, a few ulp)."""
    u1 = np.arange(0x3F000000, 0x3F800000, dtype=np.uint32).view(F)  # [1/2, 1): philox.h clamps u1 below 1
    t = F(-2.0) * _log_pos(u1)
    r = np.sqrt(np.where(t > 0, t, F(0)))
    assert (r > 0).all()
    below = np.arange(0x00800000, 0x3F000000, 4099, dtype=np.uint32).view(F)  # normal u1 < 1/2: r > 1.17
    assert np.sqrt(F(-2.0) * _log_pos(below)).min() > r.min()
    angle = ((np.arange(1 << 23) * 2 + 1).astype(np.int32)).astype(F) * F(2.0 ** -24)  # (2k + 1) 2^-24, exact
    s, c = _sin_cos_2pi(angle)
    trig = np.abs(np.concatenate([s, c]))
    assert (trig > 0).all()
    z_min = float(r.min()) * float(trig.min())
    assert 2.0 ** -34 < z_min < 2.0 ** -32  # 1.29e-10 = 2^-32.85, as csrc/common.h says
    assert _ops.MIN_NOISE_STD * z_min * (1 - 2.0 ** -24) >= FLT_MIN * 2.0 ** 12


def test_a_large_draw_has_no_zero():
    """2^24 normals (at the cells' left ends ~2 of them would be exactly 0)."""
    buf = torch.empty(1 << 24)
    _ops.philox_noise_(buf, 11, 5, 1.0)
    assert int((buf == 0).sum()) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_flush_to_zero_draws_the_same_bits_at_the_floor(dtype):
    """At the smallest std the kernels accept, a CPU with flush-to-zero on draws exactly what it draws
    with it off (below the floor, 1e-37, it zeroed ~10% of the coordinates: review 39 F2)."""
    n = 1 << 18
    draws = {}
    for ftz in (False, True):
        if not torch.set_flush_denormal(ftz) and ftz:
            pytest.skip("this CPU has no flush-to-zero mode")
        try:
            buf = torch.zeros(n, dtype=dtype)
            _ops.philox_noise_(buf, 7, 3, _ops.MIN_NOISE_STD)
            draws[ftz] = buf
        finally:
            torch.set_flush_denormal(False)
    assert torch.equal(draws[False], draws[True])
    # and every nonzero draw is normal: no coordinate depends on the flush mode
    nz = draws[False][draws[False] != 0].abs()
    assert float(nz.min()) >= torch.finfo(dtype).tiny


def _private(max_grad_norm, sigma=1.0, n=64, adaptive=None, model=None, loss_reduction="mean", clipping="flat",
             **kwargs):
    torch.manual_seed(0)
    model = model if model is not None else nn.Sequential(nn.Linear(4, 3))
    loader = DataLoader(TensorDataset(torch.randn(n, 4), torch.randint(0, 3, (n,))), batch_size=8)
    if adaptive is not None:
        kwargs["adaptive"] = adaptive
    if clipping == "backprop":
        kwargs.update(input_clip=1.0, grad_clip=max_grad_norm)
    else:
        kwargs.update(clipping=clipping, max_grad_norm=max_grad_norm)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(**({"accountant": kwargs.pop("accountant")} if "accountant" in kwargs else {}))
        return engine.make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                   data_loader=loader, noise_multiplier=sigma, loss_reduction=loss_reduction, **kwargs)


def test_make_private_refuses_a_std_that_some_batch_would_take_out_of_range():
    """Mean loss: σ·C/d must stay in range for every d a run can sample (1 .. N): σC = 2^-74 is in
    range for d up to 64 = N and accepted; 2^-75 would leave it at d = 64 (not at d = 1) and is refused
    before training, whatever the batch; so is a std above 1e30 at d = 1."""
    _private(2.0 ** -74, n=64)
    with pytest.raises(ValueError, match=r"noise std .* outside the kernels' range"):
        _private(2.0 ** -75, n=64)
    with pytest.raises(ValueError, match=r"noise std .* outside the kernels' range"):
        _private(1e31)


def test_fixed_size_batches_bound_d_by_the_batch_size():
    """Without Poisson sampling a backward's rows are at most the loader's batch size (8 here), not
    N (review 41): σC = 2^-77 leaves the range only past d = 8."""
    with pytest.raises(ValueError, match="outside the kernels' range"):
        _private(2.0 ** -77, n=64)
    _private(2.0 ** -77, n=64, poisson_sampling=False, accountant="zcdp")
    with pytest.raises(ValueError, match="outside the kernels' range"):
        _private(2.0 ** -78, n=64, poisson_sampling=False, accountant="zcdp")


def test_under_the_sum_loss_the_std_does_not_shrink_with_the_batch():
    """Sum loss: every backward draws σC itself (and the fallback σC/W), so a norm that the mean loss
    refuses for a large N is accepted (review 40 F5: the check had assumed d up to N rows)."""
    with pytest.raises(ValueError, match="outside the kernels' range"):
        _private(2.0 ** -75, n=64)
    _private(2.0 ** -75, n=64, loss_reduction="sum")
    with pytest.raises(ValueError, match="outside the kernels' range"):
        _private(2.0 ** -81, n=64, loss_reduction="sum")


def test_adaptive_thresholds_are_checked_over_their_whole_clamp():
    """Adaptive thresholds move within 10^6 of their start (and a factor 2 for a checkpoint at the
    clamp's edge), so the std's range is checked over all of it."""
    from bpclip_fast import Adaptive

    _private(2.0 ** -60, n=64)  # σC/N = 2^-66
    with pytest.raises(ValueError, match="the adaptive thresholds' clamp"):
        _private(2.0 ** -60, n=64, adaptive=Adaptive())  # down to 2^-67/10^6 < 2^-80


@pytest.mark.parametrize("clipping", ["flat", "per_layer", "backprop"])
def test_a_refused_make_private_is_not_retried_on_its_converted_model(clipping):
    """The range is checked once Δ is fixed, after the conversion and before the layers are armed. A
    retry on the converted model is refused by name (review 41: per_layer and backprop took the
    refused call's bounds for layers the user built and reported the new ones), and a fresh model
    with other settings is made private."""
    model = nn.Sequential(nn.Linear(4, 3))
    with pytest.raises(ValueError, match="build the model afresh"):
        _private(1e-40, model=model, clipping=clipping)
    with pytest.raises(ValueError, match="a make_private that was refused converted or configured this layer"):
        _private(1.0, model=model, clipping=clipping)
    _private(1.0, model=nn.Sequential(nn.Linear(4, 3)), clipping=clipping)


class _Tokens(nn.Module):
    """A biased Linear over [B, 2, 4]: its backprop Δ depends on the 2 positions."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x.view(len(x), 2, 2).repeat(1, 1, 2)).mean(1)


def test_a_retry_after_any_refusal_past_the_conversion_is_refused_by_name():
    """Any refusal after the conversion (here: a shape-dependent Δ with no max_input_shape) marks the
    layers, so that a retry on the same model cannot take the refused call's bounds for the user's
    own (review 42 F1: it trained at them while the engine reported the new ones)."""
    model = _Tokens()
    with pytest.raises(ValueError, match="max_input_shape"):
        _private(0.5, model=model, clipping="backprop")
    with pytest.raises(ValueError, match="a make_private that was refused converted or configured this layer"):
        _private(2.0, model=model, clipping="backprop", max_input_shape=(4,))
    _private(2.0, model=_Tokens(), clipping="backprop", max_input_shape=(4,))


def test_set_max_input_shape_after_make_private_never_lowers_delta():
    """A smaller max_input_shape lowers a shape-dependent Δ (a biased Linear over [B, T, in]) below the
    one make_private checked the noise range for: refused, before anything changes (review 40 F3:
    accepted, the backward then refused exactly the batches above some size; review 41: a re-check
    at moved adaptive thresholds misjudged it). A larger shape is accepted, with its high end checked."""
    model = _Tokens()
    _private(1.0, model=model, clipping="backprop", max_input_shape=(4,))
    layer = model.fc
    fixed = layer.max_input_shape
    assert fixed == (2, 4) == layer._bp_step.checked_shape
    with pytest.raises(ValueError, match=r"would lower Δ below"):
        layer.set_max_input_shape((1, 4))
    with pytest.raises(ValueError, match=r"would lower Δ below"):  # smaller in one dimension is enough
        layer.set_max_input_shape((1, 4, 4))
    assert layer.max_input_shape == fixed  # unchanged
    layer.set_max_input_shape((16, 4))  # a larger Δ, in range
    assert layer.max_input_shape == (16, 4)
    sigma, (divisor, factor) = layer._bp_step.std_span
    layer._bp_step.std_span = (sigma, (divisor, 1e30 / (sigma * layer.sensitivity_for((1, 32, 4)))))
    with pytest.raises(ValueError, match=r"set_max_input_shape\(32, 4\): .*outside the kernels' range"):
        layer.set_max_input_shape((32, 4))  # its high end past 1e30
    assert layer.max_input_shape == (16, 4)


def test_a_backward_whose_std_left_the_range_is_refused_charged_and_names_no_value():
    """The backstop: a std set out of range after make_private (here by writing the layer's noise
    multiplier past its guard) is refused in the backward before anything is drawn, charged, and its
    message does not carry the std (σΔ/d would tell the batch's size)."""
    model, opt, loader = _private(1.0)
    layer = next(m for m in model.modules() if getattr(m, "_bp_step", None) is not None)
    layer.__dict__["_bp_noise_multiplier"] = 1e-30  # past __setattr__'s guard: the backstop's own case
    engine = opt.engine
    assert engine.get_epsilon(1e-5) == 0
    x, y = next(iter(loader))
    opt.zero_grad(set_to_none=True)
    with pytest.raises(StepRefused) as info:
        nn.functional.cross_entropy(model(x), y).backward()
    assert info.value.charged and engine.get_epsilon(1e-5) > 0
    d = max(len(x), 1)
    assert f"{1e-30 / d:g}" not in str(info.value) and "e-3" not in str(info.value)
    assert all(p.grad is None for p in model.parameters())


def test_a_backward_over_more_rows_than_the_batch_is_the_rows_rule_whatever_the_std():
    """The backstop names the rows rule for a backward over more rows than the batch drawn, so the
    rule named does not tell whether σΔ/d left the range (review 42)."""
    model, opt, loader = _private(1.0)
    layer = next(m for m in model.modules() if getattr(m, "_bp_step", None) is not None)
    layer.__dict__["_bp_noise_multiplier"] = 1e-30  # past __setattr__'s guard
    x, y = next(iter(loader))
    opt.zero_grad(set_to_none=True)
    with pytest.raises(StepRefused) as info:
        nn.functional.cross_entropy(model(torch.cat([x, x])), torch.cat([y, y])).backward()
    assert info.value.rule == "rows" and info.value.charged


def test_set_max_input_shape_refuses_empty_dimensions():
    """Δ's formulas assume a shape a layer can run on (review 43: an empty dimension gave a Δ that
    fell with a larger shape)."""
    model = _Tokens()
    _private(1.0, model=model, clipping="backprop", max_input_shape=(4,))
    with pytest.raises(ValueError, match="every dimension must be at least 1"):
        model.fc.set_max_input_shape((0, 4))



# ---------------------------------------------------------------- the float64 draw

D = np.float64
DBL_MIN = float(np.finfo(np.float64).tiny)


def _log_pos_f64(x):
    """philox.h's log_pos_f64, operation for operation in float64 numpy (no FMA, as the CPU build)."""
    bits = x.view(np.uint64)
    e = (((bits >> np.uint64(52)) & np.uint64(0x7FF)).astype(np.int64) - 1022).astype(D)
    m = ((bits & np.uint64(0x000FFFFFFFFFFFFF)) | np.uint64(0x3FE0000000000000)).view(D)
    small = (m < D(0.70710678118654752440)).astype(D)
    e = e - small
    m = m + m * small
    s = (m - D(1.0)) / (m + D(1.0))
    s2 = s * s
    p = np.full_like(s, D(1.0) / D(21.0))
    for k in (19, 17, 15, 13, 11, 9, 7, 5, 3):
        p = p * s2 + D(1.0) / D(k)
    log_m = D(2.0) * s + D(2.0) * s * (s2 * p)
    return e * D(0.693145751953125) + (log_m + e * D(1.42860682030941723212e-6))


def _cos_sin_2pi_f64(u):
    """philox.h's cos_sin_2pi_f64 in float64 numpy."""
    q = u * D(4.0)
    j = (q + D(0.5)).astype(np.int64)
    phi = (q - j.astype(D)) * D(1.5707963267948966192)
    p2 = phi * phi
    fact = [float(math.factorial(k)) for k in range(18)]
    s = np.full_like(phi, D(-1.0) / D(fact[17]))
    for k, sign in ((15, 1), (13, -1), (11, 1), (9, -1), (7, 1), (5, -1), (3, 1)):
        s = s * p2 + D(sign) * (D(1.0) / D(fact[k]))
    s = phi - phi * p2 * s
    c = np.full_like(phi, D(1.0) / D(fact[16]))
    for k, sign in ((14, -1), (12, 1), (10, -1), (8, 1), (6, -1), (4, 1)):
        c = c * p2 + D(sign) * (D(1.0) / D(fact[k]))
    c = D(1.0) - D(0.5) * p2 + p2 * p2 * c
    quadrant = j & 3
    swap = (quadrant & 1) == 1
    cq, sq = np.where(swap, s, c), np.where(swap, c, s)
    cq = np.where(((quadrant + 1) & 2) != 0, -cq, cq)
    sq = np.where((quadrant & 2) != 0, -sq, sq)
    return cq, sq


def _box_muller_f64(hi, lo, angle, angle_lo):
    """philox.h's box_muller_f64 on uint32 word arrays, in float64 numpy."""
    hi, lo, angle, angle_lo = (np.asarray(w, dtype=np.uint64) for w in (hi, lo, angle, angle_lo))
    u1 = hi.astype(D) * D(2.0 ** -32) + (lo.astype(D) * D(2.0 ** -64) + D(2.0 ** -65))
    k = ((angle >> np.uint64(9)) << np.uint64(29)) | (angle_lo >> np.uint64(3))
    u2 = ((k << np.uint64(1)) | np.uint64(1)).astype(np.int64).astype(D) * D(2.0 ** -53)
    t = D(-2.0) * _log_pos_f64(np.where(u1 < 1.0, u1, D(1.0) - D(2.0 ** -53)))
    r = np.sqrt(np.where(t > 0, t, D(0.0)))
    c, s = _cos_sin_2pi_f64(u2)
    return r * c, r * s, r


def _group_words(seed, offset, groups):
    """Words [4 blocks, 4 words, groups] of groups 0..groups-1 (block j of group g: g + j 2^62)."""
    mask = 0xFFFFFFFF
    out = np.zeros((4, 4, groups), dtype=np.uint64)
    for g in range(groups):
        for j in range(4):
            blk = g + (j << 62)
            out[j, :, g] = philox4x32_10([blk & mask, blk >> 32, offset & mask, offset >> 32],
                                         [seed & mask, seed >> 32])
    return out


def _f64_normals(seed, offset, groups):
    """Element 8g + q of a float64 buffer's draw (philox.h, normals_of_group's double overload)."""
    w = _group_words(seed, offset, groups)
    b0, b1, b2, b3 = w
    pairs = [(b0[0], b0[1], b2[0], b3[0]), (b0[2], b0[3], b2[1], b3[1]),
             (b1[0], b1[1], b2[2], b3[2]), (b1[2], b1[3], b2[3], b3[3])]
    z = np.zeros((groups, 8))
    for q, words in enumerate(pairs):
        z0, z1, _ = _box_muller_f64(*words)
        z[:, 2 * q], z[:, 2 * q + 1] = z0, z1
    return z.reshape(-1)


def test_a_float64_buffer_draws_the_float64_construction_bit_for_bit():
    """philox_noise_ on a float64 buffer is philox.h's float64 construction (two full vectorised
    batches of 16 groups and a ragged tail), bit for bit against its float64 replica, and within a
    few double ulp of the exact radius and angle (u1 from the integer word, libm's log, sin, cos)."""
    seed, offset, groups = 0x0123456789ABCDEF, (5 << 20) | (3 << 1), 37
    n = groups * 8 - 5
    buf = torch.zeros(n, dtype=torch.float64)
    _ops.philox_noise_(buf, seed, offset, 1.0, False)
    replica = _f64_normals(seed, offset, groups)[:n]
    assert np.array_equal(buf.numpy(), replica)
    w = _group_words(seed, offset, groups)
    b0, b1, b2, b3 = w
    exact = []
    for g in range(groups):
        for hi, lo, a, al in ((b0[0], b0[1], b2[0], b3[0]), (b0[2], b0[3], b2[1], b3[1]),
                              (b1[0], b1[1], b2[2], b3[2]), (b1[2], b1[3], b2[3], b3[3])):
            K = (int(hi[g]) << 32) | int(lo[g])
            u1 = (2 * K + 1) / 2.0 ** 65  # one rounding (Python's true division of ints is correctly rounded)
            r = math.sqrt(-2.0 * math.log(min(u1, 1.0 - 2.0 ** -53)))
            turn = 2 * math.pi * ((((int(a[g]) >> 9) << 29 | (int(al[g]) >> 3)) * 2 + 1) / 2.0 ** 53)
            exact += [(r * math.cos(turn), r), (r * math.sin(turn), r)]
    for got, (z, r) in zip(buf.tolist(), exact[:n]):
        # log, sqrt, the angle's product by 2 pi and sin/cos: each a few ulp of r at most
        assert abs(got - z) <= 16 * 2.0 ** -53 * r


def test_float64_parameters_no_longer_warn_and_the_warning_still_imports():
    """make_private issues no Float64NoiseWarning (float64 parameters draw float64 normals); the class
    stays importable for code that filters it (review 44 F2)."""
    from bpclip_fast import Float64NoiseWarning

    model = nn.Sequential(nn.Linear(4, 3)).double()
    loader = DataLoader(TensorDataset(torch.randn(16, 4, dtype=torch.float64), torch.randint(0, 3, (16,))),
                        batch_size=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0, clipping="flat")
    assert not [w for w in caught if issubclass(w.category, Float64NoiseWarning)]


def test_a_float64_release_minus_its_sum_is_not_a_float32_number():
    """Review 40 F2's attack: with float32 normals every coordinate of out − sum was a float32 number,
    and 5.58M of 16.8M coordinates of a neighbouring data set's were not. With float64 normals neither
    hypothesis is on the float32 grid (a double is a float32 with chance ~2^-29), and the draw refines
    the float32 one: the same radius word and angle cell (tests/cpp/test_philox.cpp derives the bound)."""
    torch.manual_seed(0)
    n = 1 << 16
    sum_d = torch.randn(n, dtype=torch.float64) * 3
    sum_neighbour = sum_d + torch.randn(n, dtype=torch.float64) * 0.1
    out = sum_d.clone()
    _ops.philox_noise_(out, 5, 11, 1.0, True)
    for hypothesis in (sum_d, sum_neighbour):
        r = out - hypothesis
        assert int((r.float().double() == r).sum()) == 0
    z64 = torch.zeros(n, dtype=torch.float64)
    _ops.philox_noise_(z64, 5, 11, 1.0, False)
    z32 = torch.zeros(n)
    _ops.philox_noise_(z32, 5, 11, 1.0, False)
    r = torch.hypot(z64[0::2], z64[1::2]).repeat_interleave(2)
    # the half angle cell and float rounding, plus the float radius' error: its u1 carries up to three
    # roundings and its log one (δr² ≤ 2^-21), and r32 ≥ 3.45e-4 (its clamp): |r64 − r32| ≤ 2^-21/max(r, 3.4e-4)
    bound = r * (math.pi * 2.0 ** -23 + 2.0 ** -21) + 2.0 ** -21 / r.clamp(min=3.4e-4)
    assert bool(((z64 - z32.double()).abs() <= bound).all())


def test_every_float64_noise_op_draws_float64_normals():
    """philox_noise2_, layer_tail_, examples_release and banded_row_ on float64 buffers add exactly
    philox_noise_'s float64 draw (zero sums, std 1: the outputs are the draws)."""
    n, seed, offset = 1000, 9, 40
    z = torch.zeros(n, dtype=torch.float64)
    _ops.philox_noise_(z, seed, offset, 1.0, False)
    zb = torch.zeros(7, dtype=torch.float64)
    _ops.philox_noise_(zb, seed, offset + 1, 1.0, False)
    assert int((z.float().double() == z).sum()) == 0
    w, b = torch.zeros(n, dtype=torch.float64), torch.zeros(7, dtype=torch.float64)
    _ops.philox_noise2_(w, b, seed, offset, 1.0)
    assert torch.equal(w, z) and torch.equal(b, zb)
    w, b = torch.zeros(n, dtype=torch.float64), torch.zeros(7, dtype=torch.float64)
    torch.ops.bpclip_fast.layer_tail_(w, b, None, None, None, None, None, 1.0, "clip", seed, offset, 1.0)
    assert torch.equal(w, z) and torch.equal(b, zb)
    gw, gb = _ops.examples_release(torch.ones(3, n, dtype=torch.float64), torch.ones(3, 7, dtype=torch.float64),
                                   torch.zeros(3, dtype=torch.float64), seed, offset, 1.0)
    assert torch.equal(gw, z) and torch.equal(gb, zb)
    ring = torch.zeros(1, n, dtype=torch.float64)
    row = _ops.banded_row_(ring, [], [], 0, [0.5], seed, offset, 1.0)
    assert torch.equal(row, z)


def test_the_float64_draw_has_no_zero_and_its_smallest_clears_the_floor():
    """The extremes of the float64 construction: the largest radius (word 0: u1 = 2^-65, the same tail
    as the float draw), the smallest (the top words, clamped to 1 − 2^-53: r = 2^-26), and the angle
    cells next to each axis (4 u2 at 2^-51 from an integer, the nearest any midpoint comes): no sine
    or cosine is 0, and the smallest |z| times the std floor is far inside float64's normals. The same
    words through the emulated device build give the same bits."""
    top = 0xFFFFFFFF
    hi = np.array([0, top, top, 0x7FFFFFFF], dtype=np.uint64)
    lo = np.array([0, top, top - 7, top], dtype=np.uint64)
    _, _, r = _box_muller_f64(hi, lo, np.zeros(4), np.zeros(4))
    assert r[0] == pytest.approx(math.sqrt(130 * math.log(2)), rel=1e-15)
    assert r[1] == r[2] == pytest.approx(2.0 ** -26, rel=1e-12)  # clamped: never r = 0
    k_axis = [0, (1 << 52) - 1] + [(q << 50) + d for q in (1, 2, 3) for d in (-1, 0)]  # cells beside an axis
    angle = np.array([(k >> 29) << 9 for k in k_axis], dtype=np.uint64)
    angle_lo = np.array([(k & ((1 << 29) - 1)) << 3 for k in k_axis], dtype=np.uint64)
    ones = np.full(len(k_axis), top, dtype=np.uint64)
    z0, z1, _ = _box_muller_f64(ones, ones, angle, angle_lo)
    smallest = float(np.abs(np.concatenate([z0, z1])).min())
    assert smallest > 0
    assert smallest == pytest.approx(2.0 ** -26 * math.sin(math.pi / 2 * 2.0 ** -51), rel=1e-12)
    assert smallest > 2.0 ** -77
    assert _ops.MIN_NOISE_STD * smallest > DBL_MIN * 2.0 ** 800
    sim = harness.Simt(harness.build_library())
    words = np.stack([np.concatenate([hi, ones]), np.concatenate([lo, ones]),
                      np.concatenate([np.zeros(4, dtype=np.uint64), angle]),
                      np.concatenate([np.zeros(4, dtype=np.uint64), angle_lo])], axis=1)
    device = sim.box_muller_f64(torch.from_numpy(words.astype(np.int64)))
    host = _box_muller_f64(*words.T)
    assert np.array_equal(device[:, 0].numpy(), host[0]) and np.array_equal(device[:, 1].numpy(), host[1])



# ---------------------------------------------------------------- the pair-lattice attack (open)


def _pair_consistent(y, s, std, u_window=12, k_window=6):
    """The adversary of review 44 F1: is the float64 release pair ``y`` (coordinates 2i, 2i+1) exactly
    what some draw of the construction, a double u1 and a 52-bit angle cell near the ones that invert
    (y − s)/std, gives from the sums ``s`` (philox_noise_ accumulating: fl(s + fl(std·z)))? Sound
    (a "yes" is a real draw) everywhere, complete only at sums near 0 and std 1 away from the tail
    (r < 5.8): elsewhere the fixed windows can miss the draw (review 45 F2)."""
    L = np.longdouble
    zc = (y.astype(L) - s.astype(L)) / L(std)
    z0, z1 = zc[0::2], zc[1::2]
    u1c = np.exp(-(z0 * z0 + z1 * z1) / 2).astype(D)
    turn = np.arctan2(z1, z0) / (2 * np.pi)
    kc = np.floor(np.where(turn < 0, turn + 1, turn) * L(2.0 ** 52)).astype(np.int64)
    ok = np.zeros(len(z0), bool)
    candidates, up, down = [u1c], u1c.copy(), u1c.copy()
    for _ in range(u_window):
        up, down = np.nextafter(up, 2.0), np.nextafter(down, 0.0)
        candidates += [up, down]
    for u1 in candidates:
        t = D(-2.0) * _log_pos_f64(np.minimum(u1, D(1.0) - D(2.0 ** -53)))
        r = np.sqrt(np.where(t > 0, t, D(0.0)))
        for dk in range(-k_window, k_window + 1):
            k = np.mod(kc + dk, 1 << 52).astype(np.uint64)
            u2 = (k >> np.uint64(29)).astype(D) * D(2.0 ** -23) + \
                (((k & np.uint64((1 << 29) - 1)) << np.uint64(1)) | np.uint64(1)).astype(D) * D(2.0 ** -53)
            c, sn = _cos_sin_2pi_f64(u2)
            ok |= (s[0::2] + std * (r * c) == y[0::2]) & (s[1::2] + std * (r * sn) == y[1::2])
    return ok


def _lattice_release(pairs=2000, shift=1e-9):
    sums = np.zeros(2 * pairs)
    y = torch.from_numpy(sums.copy())
    _ops.philox_noise_(y, 21, 8, 1.0, True)
    return y.numpy(), sums, sums + shift


def test_the_pair_lattice_adversary_accepts_the_true_sums_on_every_pair():
    """The adversary's test of review 44 F1 is exact: it finds the draw behind every release pair
    under the true sums (the check of the next test's harness)."""
    y, truth, _ = _lattice_release()
    assert _pair_consistent(y, truth, 1.0).all()


@pytest.mark.xfail(strict=True, raises=AssertionError, reason="open (review 44 F1): Box–Muller pairs lie on a sparse lattice of doubles, so "
                   "a neighbour's sums are ruled out on ~97% of pairs; the fix is a snapped or discrete release "
                   "(docs/design.md, 'Open, HIGH: floating-point noise'); this test models today's mechanism and goes with the fix")
def test_a_neighbours_sums_are_consistent_with_almost_every_release_pair():
    """What a release must give an adversary who knows the sums but one example's share: every pair
    of the release is as consistent with the neighbouring sums (here every coordinate shifted by 1e-9,
    a billionth of the noise) as with the true ones. Fails today: ~3% of pairs are."""
    y, _, neighbour = _lattice_release()
    assert _pair_consistent(y, neighbour, 1.0).mean() >= 0.99


@pytest.mark.skipif(__import__("platform").machine() not in ("x86_64", "AMD64"), reason="x87 is an x86 option")
def test_x87_arithmetic_is_refused_at_compile_time(tmp_path):
    """The draws are specified bit for bit only where each operation rounds to its own type; x87
    (FLT_EVAL_METHOD 2) keeps 80-bit intermediates, so philox.h refuses to compile there (review 45 F8)."""
    import shutil
    import subprocess

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    src = tmp_path / "x87.cpp"
    src.write_text('#include "bpclip_fast/philox.h"\nint main() { return 0; }\n')
    include = str(Path(__file__).resolve().parents[1] / "csrc" / "include")
    ok = subprocess.run([cxx, "-std=c++20", "-I", include, "-c", str(src), "-o", str(tmp_path / "a.o")],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr[-2000:]
    x87 = subprocess.run([cxx, "-std=c++20", "-mfpmath=387", "-I", include, "-c", str(src), "-o",
                          str(tmp_path / "b.o")], capture_output=True, text=True)
    assert x87.returncode != 0 and "FLT_EVAL_METHOD == 0" in x87.stderr
