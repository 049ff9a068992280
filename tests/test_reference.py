"""Pin the reference oracle to hand-derived maths, never to its own output."""

import math

import pytest
import torch
from torch import nn

from bpclip_fast import reference as ref

NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def _float64_default():
    """Hand-derived values are compared in float64; restored so no other test module sees it."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def hand_clip_rows(x, bound):
    """min(1, C/||row||) per example, by explicit Python loop."""
    rows = []
    for r in x:
        n = math.sqrt(float((r.double() ** 2).sum()))
        rows.append(r * (bound / n if n > bound else 1.0))
    return torch.stack(rows)


# ---------------------------------------------------------------- clip factors and norms

NORMS = torch.tensor([0.0, 0.5, 1.0, 2.0, 4.0, INF, NAN])


@pytest.mark.parametrize("fn,expected", [
    ("clip", [1, 1, 1, 0.5, 0.25, 0, 0]),
    ("global", [1, 1, 1, 0, 0, 0, 0]),
    ("normalize", [1 / 0.01, 1 / 0.51, 1 / 1.01, 1 / 2.01, 1 / 4.01, 0, 0]),
])
def test_clip_factor_hand_values(fn, expected):
    s = ref.clip_factor(NORMS, 1.0, fn, gamma=0.01)
    torch.testing.assert_close(s, torch.tensor(expected, dtype=s.dtype))


def test_clip_factor_bound_scaling():
    s = ref.clip_factor(torch.tensor([3.0, 6.0, 12.0]), 6.0, "clip")
    torch.testing.assert_close(s, torch.tensor([1.0, 1.0, 0.5]))


def test_clip_factor_validation():
    with pytest.raises(ValueError, match="clip_fn"):
        ref.clip_factor(NORMS, 1.0, "abadi")
    with pytest.raises(ValueError, match="bound"):
        ref.clip_factor(NORMS, 0.0, "clip")
    with pytest.raises(ValueError, match="gamma"):
        ref.clip_factor(NORMS, 1.0, "normalize", gamma=0.0)
    with pytest.raises(ValueError, match="norm"):
        ref.clip_upstream(torch.ones(2, 3), 1.0, norm="l1")


def test_l2_norm_hand():
    x = torch.tensor([[[3.0, 4.0]], [[0.0, 0.0]], [[1.0, 2.0]]])  # [3, 1, 2]
    torch.testing.assert_close(ref.l2_norm(x), torch.tensor([5.0, 0.0, math.sqrt(5)]))


def test_l2_norm_half_accumulates_in_float32():
    x = torch.full((2, 4), 300.0, dtype=torch.float16)  # 300^2 * 4 overflows fp16
    n = ref.l2_norm(x)
    assert n.dtype == torch.float32
    torch.testing.assert_close(n, torch.full((2,), 600.0, dtype=torch.float32))


def test_l15_norm_hand():
    g = torch.zeros(2, 2, 2, 2)
    g[0, 0] = torch.tensor([[1.0, -2.0], [3.0, 0.0]])  # sum |.| = 6
    g[0, 1] = torch.tensor([[0.0, 0.0], [0.0, -8.0]])  # sum |.| = 8
    g[1, 1] = torch.tensor([[0.5, 0.5], [-0.5, 0.5]])  # channel 0 empty; sum = 2
    torch.testing.assert_close(ref.l15_norm(g), torch.tensor([10.0, 2.0]))
    with pytest.raises(ValueError):
        ref.l15_norm(torch.ones(2, 3))


def test_clip_upstream_l15_and_l2():
    g = torch.zeros(2, 2, 1, 2)
    g[0, 0, 0] = torch.tensor([3.0, -3.0])  # l15 = sqrt(6^2 + 8^2) = 10
    g[0, 1, 0] = torch.tensor([4.0, 4.0])   # l2 = sqrt(18 + 32) = sqrt(50)
    g[1, 0, 0] = torch.tensor([0.1, 0.0])
    out = ref.clip_upstream(g, 5.0, norm="l15")
    torch.testing.assert_close(out[0], g[0] / 2)
    torch.testing.assert_close(out[1], g[1])
    out = ref.clip_upstream(g, 5.0, norm="l2")
    torch.testing.assert_close(out[0], g[0] * 5 / math.sqrt(50))
    torch.testing.assert_close(ref.l2_norm(out)[0], torch.tensor(5.0))


# ---------------------------------------------------------------- the clipping Jacobian

def explicit_clip(x, bound, fn, gamma):
    """The clipping map per row, written as the textbook formula with Python branches."""
    rows = []
    for r in x:
        n = torch.sqrt((r * r).sum())
        if fn == "clip":
            rows.append(r * (bound / n) if float(n.detach()) > bound else r)
        elif fn == "global":
            rows.append(r if float(n.detach()) <= bound else r * 0)
        else:
            rows.append(r * (bound / (n + gamma)))
    return torch.stack(rows)


@pytest.mark.parametrize("fn", ["clip", "global", "normalize"])
def test_clip_input_jacobian_matches_explicit_formula(fn):
    torch.manual_seed(0)
    x = torch.randn(4, 2, 3)
    x[1] *= 0.05  # under the bound
    x[3] *= 5.0   # far over
    C, gamma = 1.5, 0.01
    J = torch.autograd.functional.jacobian(lambda t: ref.clip_input(t, C, fn, gamma), x)
    J_ref = torch.autograd.functional.jacobian(lambda t: explicit_clip(t, C, fn, gamma), x)
    torch.testing.assert_close(J, J_ref)
    torch.testing.assert_close(ref.clip_input(x, C, fn, gamma), explicit_clip(x, C, fn, gamma))


def test_clip_input_jacobian_closed_form():
    """Clipped: d(Cx/n)/dx = C/n (I - x x^T / n^2); unclipped: I; examples do not interact."""
    torch.manual_seed(1)
    x = torch.randn(3, 5)
    x[0] *= 10.0
    x[1] *= 0.01
    x[2] *= 10.0
    C = 2.0
    J = torch.autograd.functional.jacobian(lambda t: ref.clip_input(t, C), x)  # [3,5,3,5]
    for i in range(3):
        xi = x[i]
        n = xi.norm()
        if n > C:
            expected = C / n * (torch.eye(5) - torch.outer(xi, xi) / n**2)
        else:
            expected = torch.eye(5)
        torch.testing.assert_close(J[i, :, i, :], expected)
        for j in range(3):
            if j != i:
                assert torch.count_nonzero(J[i, :, j, :]) == 0


def test_clip_input_normalize_closed_form():
    """s = C/(n+g): J = s I - C x x^T / (n (n+g)^2)."""
    x = torch.tensor([[3.0, 4.0]])
    C, g = 1.0, 0.5
    J = torch.autograd.functional.jacobian(lambda t: ref.clip_input(t, C, "normalize", g), x)[0, :, 0, :]
    xi = x[0]
    expected = C / 5.5 * torch.eye(2) - C * torch.outer(xi, xi) / (5 * 5.5**2)
    torch.testing.assert_close(J, expected)


def test_clip_input_half_dtype():
    x = torch.full((2, 4), 300.0, dtype=torch.float16)
    out = ref.clip_input(x, 6.0)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out, torch.full((2, 4), 3.0, dtype=torch.float16))


# ---------------------------------------------------------------- non-finite examples

@pytest.mark.parametrize("fn", ["clip", "global", "normalize"])
def test_nonfinite_example_is_zeroed_without_nan(fn):
    x = torch.tensor([[3.0, 4.0], [NAN, 1.0], [INF, 0.0], [0.3, 0.4]], requires_grad=True)
    out = ref.clip_input(x, 1.0, fn)
    assert torch.isfinite(out).all()
    assert torch.equal(out[1:3], torch.zeros(2, 2))
    out.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert torch.equal(x.grad[1:3], torch.zeros(2, 2))
    assert torch.count_nonzero(x.grad[0]) > 0 or fn == "global"

    g = x.detach().clone()
    gc = ref.clip_upstream(g, 1.0, "l2", fn)
    assert torch.isfinite(gc).all() and torch.equal(gc[1:3], torch.zeros(2, 2))
    g4 = g.reshape(4, 1, 1, 2)
    gc4 = ref.clip_upstream(g4, 1.0, "l15", fn)
    assert torch.isfinite(gc4).all() and torch.equal(gc4[1:3], torch.zeros(2, 1, 1, 2))


def test_overflowing_norm_counts_as_nonfinite():
    x = torch.tensor([[1e30, 1e30], [3.0, 4.0]], dtype=torch.float32)
    assert not torch.isfinite(ref.l2_norm(x)[0])
    out = ref.clip_input(x, 1.0)
    torch.testing.assert_close(out, torch.tensor([[0.0, 0.0], [0.6, 0.8]], dtype=torch.float32))


# ---------------------------------------------------------------- the hooks

def test_hooks_clip_linear_weight_and_input_gradients():
    torch.manual_seed(2)
    Cx, Cg = 1.0, 0.5
    layer = nn.Linear(4, 3)
    x = torch.randn(5, 4)
    x[0] *= 10
    x[3] *= 0.01
    x.requires_grad_(True)
    R = torch.randn(5, 3)
    R[1] *= 10
    R[4] *= 0.01
    handles = ref.attach(layer, input_clip=Cx, grad_clip=Cg)
    (layer(x) * R).sum().backward()
    for h in handles:
        h.remove()

    xt = hand_clip_rows(x.detach(), Cx)
    gt = hand_clip_rows(R, Cg)
    torch.testing.assert_close(layer.weight.grad, gt.T @ xt)
    torch.testing.assert_close(layer.bias.grad, gt.sum(0))
    # Input gradient: the clipped g through W, then the clipping Jacobian (closed form).
    up = gt @ layer.weight.detach()
    expected = []
    for xi, ui in zip(x.detach(), up):
        n = xi.norm()
        J = Cx / n * (torch.eye(4) - torch.outer(xi, xi) / n**2) if n > Cx else torch.eye(4)
        expected.append(J.T @ ui)
    torch.testing.assert_close(x.grad, torch.stack(expected))


def test_hooks_clip_even_when_input_needs_no_grad():
    layer = nn.Linear(2, 1, bias=False)
    x = torch.tensor([[3.0, 4.0]])
    ref.attach(layer, input_clip=1.0, grad_clip=0.25)
    (layer(x) * 8.0).sum().backward()
    torch.testing.assert_close(layer.weight.grad, torch.tensor([[0.25 * 0.6, 0.25 * 0.8]]))


def test_clipped_gradient_flows_down_the_network():
    torch.manual_seed(3)
    Cx, Cg = 0.7, 0.3
    l1, l2 = nn.Linear(4, 6), nn.Linear(6, 3)
    with torch.no_grad():  # large enough that h and its gradient are clipped too
        l1.weight.mul_(10)
        l2.weight.mul_(10)
    model = nn.Sequential(l1, l2)
    x = torch.randn(5, 4) * 3
    R = torch.randn(5, 3) * 3
    ref.attach(model, input_clip=Cx, grad_clip=Cg)
    (model(x) * R).sum().backward()

    xt = hand_clip_rows(x, Cx)
    h = (xt @ l1.weight.T + l1.bias).detach().requires_grad_(True)
    ht = explicit_clip(h, Cx, "clip", 0.0)
    g2 = hand_clip_rows(R, Cg)
    (grad_h,) = torch.autograd.grad((ht * (g2 @ l2.weight.detach())).sum(), h)  # J_clip(h)^T (g2 W2)
    g1 = hand_clip_rows(grad_h, Cg)
    assert (h.detach().norm(dim=1) > Cx).all() and (grad_h.norm(dim=1) > Cg).any()
    torch.testing.assert_close(l2.weight.grad, g2.T @ ht.detach())
    torch.testing.assert_close(l1.weight.grad, g1.T @ xt)
    torch.testing.assert_close(l1.bias.grad, g1.sum(0))


def test_linear_3d_input_norm_over_all_non_batch_dims():
    torch.manual_seed(4)
    Cx, Cg = 1.0, 0.5
    layer = nn.Linear(4, 2)
    x = torch.randn(3, 5, 4) * 2
    R = torch.randn(3, 5, 2) * 2
    ref.attach(layer, input_clip=Cx, grad_clip=Cg)
    (layer(x) * R).sum().backward()
    xt = hand_clip_rows(x.reshape(3, -1), Cx).reshape(3, 5, 4)
    gt = hand_clip_rows(R.reshape(3, -1), Cg).reshape(3, 5, 2)
    torch.testing.assert_close(layer.weight.grad, torch.einsum("bto,bti->oi", gt, xt))
    torch.testing.assert_close(layer.bias.grad, gt.sum((0, 1)))


@pytest.mark.parametrize("norm", ["l15", "l2"])
def test_hooks_clip_conv2d(norm):
    torch.manual_seed(5)
    Cx, Cg = 2.0, 0.4
    conv = nn.Conv2d(2, 3, 3, stride=2, padding=1)
    x = torch.randn(4, 2, 6, 6)
    x[2] *= 0.01
    R = torch.randn(4, 3, 3, 3)
    ref.attach(conv, input_clip=Cx, grad_clip=Cg, norm=norm)
    (conv(x) * R).sum().backward()
    xt = hand_clip_rows(x, Cx)
    if norm == "l15":
        n = torch.tensor([math.sqrt(sum(float(R[b, c].abs().sum()) ** 2 for c in range(3)))
                          for b in range(4)])
    else:
        n = R.reshape(4, -1).norm(dim=1)
    gt = R * torch.clamp(Cg / n, max=1.0).reshape(4, 1, 1, 1)
    expected = torch.nn.grad.conv2d_weight(xt, conv.weight.shape, gt, stride=2, padding=1)
    torch.testing.assert_close(conv.weight.grad, expected)
    torch.testing.assert_close(conv.bias.grad, gt.sum((0, 2, 3)))


def test_attach_rejects_non_zero_padding():
    conv = nn.Conv2d(1, 1, 3, padding=1, padding_mode="reflect")
    with pytest.raises(ValueError, match="padding_mode"):
        ref.attach(conv, input_clip=1.0, grad_clip=1.0)


# ---------------------------------------------------------------- sensitivity

def test_sensitivity_linear():
    Cx, Cg = 2.0, 3.0
    s = lambda layer, shape: ref.layer_sensitivity(layer, shape, input_clip=Cx, grad_clip=Cg)
    assert s(nn.Linear(4, 3, bias=False), (8, 4)) == pytest.approx(6.0)
    assert s(nn.Linear(4, 3), (8, 4)) == pytest.approx(3 * math.sqrt(5))
    assert s(nn.Linear(4, 3, bias=False), (8, 3, 4)) == pytest.approx(6.0)
    assert s(nn.Linear(4, 3), (8, 3, 4)) == pytest.approx(3 * math.sqrt(7))
    assert s(nn.Linear(4, 3), (8, 2, 3, 4)) == pytest.approx(3 * math.sqrt(10))


def test_sensitivity_conv_l15():
    kw = dict(input_clip=2.0, grad_clip=3.0, norm="l15")
    assert ref.layer_sensitivity(nn.Conv2d(2, 3, 3), (1, 2, 9, 9), **kw) == pytest.approx(3 * math.sqrt(5))
    conv = nn.Conv2d(2, 4, 5, stride=2, padding=2, dilation=2, groups=2, bias=False)
    assert ref.layer_sensitivity(conv, (1, 2, 9, 9), **kw) == pytest.approx(6.0)


@pytest.mark.parametrize("conv,shape,m,hw", [
    # 5x5, k3, s1, p0: out 3x3; the centre is read by all 3 offsets per dim.
    (nn.Conv2d(1, 1, 3), (1, 1, 5, 5), 9, 9),
    # H: 6, k3, s2, p1 -> windows [-1..1], [1..3], [3..5]: indices 1 and 3 read twice; out 3.
    # W: 7, k3, d2, s1, p0 -> windows {0,2,4}, {1,3,5}, {2,4,6}: indices 2 and 4 twice; out 3.
    (nn.Conv2d(2, 3, 3, stride=(2, 1), padding=(1, 0), dilation=(1, 2)), (1, 2, 6, 7), 4, 9),
    # k2, s2: non-overlapping windows, every entry read once; out 4x4.
    (nn.Conv2d(1, 1, 2, stride=2), (1, 1, 8, 8), 1, 16),
    # 4x4, k3, p1, s1: interior indices 1 and 2 are read 3 times per dim; out 4x4.
    (nn.Conv2d(1, 1, 3, padding=1), (1, 1, 4, 4), 9, 16),
    # 7x7, k5, s3, p0: out (7-5)//3+1 = 1, a single window [0..4]: m 1.
    (nn.Conv2d(1, 1, 5, stride=3), (1, 1, 7, 7), 1, 1),
])
def test_sensitivity_conv_l2_hand_counted(conv, shape, m, hw):
    assert ref.conv_patch_multiplicity(conv, shape) == (m, hw)
    Cx, Cg = 2.0, 3.0
    expected = Cg * math.sqrt(m * Cx**2 + (hw if conv.bias is not None else 0))
    got = ref.layer_sensitivity(conv, shape, input_clip=Cx, grad_clip=Cg, norm="l2")
    assert got == pytest.approx(expected)


def test_sensitivity_conv_same_padding():
    # 'same' with k4 on H=6: total pad 3 (left 1, right 2), out 6; output o reads o-1+k, so
    # index 2 is read by (o, k) = (3,0), (2,1), (1,2), (0,3): 4. W: k1, out 3, m 1.
    conv = nn.Conv2d(1, 1, (4, 1), padding="same")
    m, hw = ref.conv_patch_multiplicity(conv, (1, 1, 6, 3))
    assert (m, hw) == (4, 18)


@pytest.mark.parametrize("norm", ["l15", "l2"])
def test_sensitivity_bounds_exact_per_example_gradients(norm):
    """Adversarial-ish inputs at the clip bounds never exceed Delta (loop of batch-1 backwards)."""
    torch.manual_seed(6)
    Cx, Cg = 1.3, 0.7
    conv = nn.Conv2d(2, 3, 3, stride=1, padding=1)
    delta = ref.layer_sensitivity(conv, (1, 2, 5, 5), input_clip=Cx, grad_clip=Cg, norm=norm)
    ref.attach(conv, input_clip=Cx, grad_clip=Cg, norm=norm)
    worst = 0.0
    for trial in range(50):
        x = torch.randn(1, 2, 5, 5) if trial % 2 else torch.ones(1, 2, 5, 5)
        R = torch.randn(1, 3, 5, 5) if trial % 3 else torch.ones(1, 3, 5, 5)
        x, R = x * 100, R * 100  # always clipped, so both sit at their bounds
        conv.zero_grad()
        (conv(x) * R).sum().backward()
        g = torch.cat([conv.weight.grad.flatten(), conv.bias.grad.flatten()])
        worst = max(worst, float(g.norm()))
    assert 0 < worst <= delta * (1 + 1e-9)


def test_sensitivity_rejects_other_layers():
    with pytest.raises(TypeError):
        ref.layer_sensitivity(nn.ReLU(), (1, 2), input_clip=1.0, grad_clip=1.0)


# ---------------------------------------------------------------- baseline noise

def test_add_noise_std_and_unused_layers():
    Cx, Cg, sigma = 1.0, 2.0, 0.5
    model = nn.Sequential(nn.Linear(300, 200), nn.Linear(200, 2, bias=False))
    shapes, handles = ref.record_input_shapes(model)
    model(torch.zeros(4, 300))
    for h in handles:
        h.remove()
    assert shapes[model[0]] == (4, 300) and shapes[model[1]] == (4, 200)
    model[0].weight.grad = torch.zeros_like(model[0].weight)
    gen = torch.Generator().manual_seed(0)
    ref.add_noise(model, sigma, input_clip=Cx, grad_clip=Cg, input_shapes=shapes, generator=gen)
    expected_std = sigma * Cg * math.sqrt(Cx**2 + 1)
    assert float(model[0].weight.grad.std()) == pytest.approx(expected_std, rel=0.02)
    assert model[1].weight.grad is not None  # noised even though backward never reached it
    assert model[0].bias.grad is not None
    with pytest.raises(KeyError):
        ref.add_noise(nn.Linear(2, 2), sigma, input_clip=Cx, grad_clip=Cg, input_shapes={})
