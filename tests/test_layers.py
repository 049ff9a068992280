"""Our Linear/Conv2d against bpclip_fast.reference (plain PyTorch hooks), noise placement, errors."""

import copy
import math

import pytest
import torch
from torch import nn

import bpclip_fast
from bpclip_fast import _ops, models, reference
from bpclip_fast import nn as bnn

CLIP_FNS = ["clip", "global", "normalize"]


@pytest.fixture(autouse=True)
def _no_tf32():
    """These tests hold fp32 gradients to the float64 truth within fp32's rounding (fp32_tolerance).
    On a GPU, cuDNN's default runs fp32 convolutions in TF32 (10-bit operands), which errs by far
    more: seen on an H100 (the mnist and cifar10 nets). The bounds that must
    hold under TF32 are tested with it on (tests/test_sensitivity.py, test_guarantee_numerics.py)."""
    with torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled, allow_tf32=False):
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old


def paired(model, *, input_clip, grad_clip, norm="l15", clip_fn="clip"):
    """(ours, oracle): the same weights, ours converted, the oracle with the paper's hooks."""
    ours = bnn.convert_model(copy.deepcopy(model), input_clip=input_clip, grad_clip=grad_clip, norm=norm,
                             clip_fn=clip_fn)
    ref = copy.deepcopy(model)
    reference.attach(ref, input_clip=input_clip, grad_clip=grad_clip, norm=norm, clip_fn=clip_fn)
    return ours, ref


def grads_of(model, x, out_weights, *, pool_windows=None):
    """Gradients of ``(model(x) * out_weights).sum()`` and the window each MaxPool2d chose.

    Given ``pool_windows`` (from another run of the same architecture), every MaxPool2d takes those
    windows' elements instead of choosing: the float64 truth then follows the fp32 run's choices.
    Two pooled values within rounding of each other are a tie that fp32 breaks either way, and
    which way depends on the CPU's kernels (AVX-512 and AVX2 oneDNN did differ on the mnist net);
    max pooling is torch's, not ours, so either choice is a correct fp32 result."""
    windows, hooks = {}, []
    for name, m in model.named_modules():
        if isinstance(m, nn.MaxPool2d):
            def hook(mod, args, out, name=name):
                if pool_windows is None:
                    _, idx = nn.functional.max_pool2d(args[0], mod.kernel_size, mod.stride, mod.padding,
                                                      mod.dilation, mod.ceil_mode, return_indices=True)
                    windows[name] = idx
                    return out
                idx = pool_windows[name]
                return args[0].flatten(2).gather(2, idx.flatten(2)).view_as(idx)
            hooks.append(m.register_forward_hook(hook))
    try:
        x = x.clone().requires_grad_()
        model.zero_grad(set_to_none=True)
        (model(x) * out_weights).sum().backward()
    finally:
        for h in hooks:
            h.remove()
    return x.grad, {n: p.grad.clone() for n, p in model.named_parameters()}, windows


def longest_sum(model, x):
    """The most terms any one sum of a forward+backward of ``model`` on ``x`` adds (a dot product of
    the forward, of the input or weight gradient, or an example's squared norm)."""
    sums, hooks = [1], []

    def hook(m, args, out):
        inp, b = args[0], args[0].shape[0]
        if isinstance(m, nn.Linear):
            sums.extend([m.in_features, m.out_features, inp.numel() // m.in_features])
        else:
            k = math.prod(m.kernel_size)
            sums.extend([m.in_channels // m.groups * k, m.out_channels // m.groups * k, b * out[0, 0].numel()])
        sums.extend([inp[0].numel(), out[0].numel()])

    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            hooks.append(m.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in hooks:
            h.remove()
    return max(sums), len(hooks)


def fp32_tolerance(model, x):
    """Error allowed, relative to a gradient's largest entry, of an fp32 forward+backward against
    the float64 truth: each of the L clipped layers adds a forward and a backward sum (and a row's
    norm, a few roundings more) of at most K terms, whose rounding error grows like sqrt(K) u with
    u = eps/2 (Higham and Mary, SIAM J. Sci. Comput. 2019: probabilistic error analysis); every
    clip factor (clip, normalize) is Lipschitz in the norm, so errors add through the layers:
    2 L sqrt(K) eps. On the mnist net (K = 3136, L = 4) that is 5.3e-5: both the fused layers and
    the plain-PyTorch oracle err by about 1e-6, and a gradient bound 0.1% too large fails it."""
    k, n_layers = longest_sum(model, x)
    return 2 * n_layers * math.sqrt(k) * torch.finfo(torch.float32).eps


def assert_matches_float64_truth(ours, ref, x, *, seed=0):
    """Our fp32 gradients and the fp32 oracle's, each against the oracle evaluated in float64 on the
    same (fp32-representable) weights and inputs, within :func:`fp32_tolerance`.

    Comparing the two fp32 results with each other would fail wherever the oracle's own rounding
    differs, which depends on the CPU's kernels (the mnist net with clip_fn='normalize' flipped a
    max-pooling tie under AVX-512 oneDNN, not under AVX2)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        w_out = torch.randn_like(ref(x)) * 10
    tol = fp32_tolerance(ref, x)
    for who, model in (("ours", ours), ("fp32 oracle", ref)):
        gx, g, windows = grads_of(model, x, w_out)
        truth_x, truth, _ = grads_of(copy.deepcopy(ref).double(), x.double(), w_out.double(), pool_windows=windows)
        assert g.keys() == truth.keys()
        for name, want in [*truth.items(), ("input", truth_x)]:
            got = gx if name == "input" else g[name]
            scale = want.abs().max().item()
            assert scale > 0, f"{name}: the float64 truth is all zero, so the comparison could not fail"
            torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * scale, msg=f"{who}: {name}")


@pytest.mark.parametrize("clip_fn", CLIP_FNS)
@pytest.mark.parametrize("norm", ["l15", "l2"])
def test_mnist_net_matches_reference(device, clip_fn, norm):
    torch.manual_seed(0)
    # 'global' drops an example whose input or upstream gradient is over its bound: at 5.0 and 0.05 it
    # dropped every example and compared zeros. 20 drops only x[3] (input norms 16.6 | 319), 31.5 lies in
    # a gap of the last layer's upstream norms (30.9 | 32.1): some examples dropped, the rest kept, none
    # within rounding of a bound.
    input_clip, grad_clip = (20.0, 31.5) if clip_fn == "global" else (5.0, 0.05)
    ours, ref = paired(models.mnist_net(act=bnn.TemperedSigmoid), input_clip=input_clip, grad_clip=grad_clip,
                       norm=norm, clip_fn=clip_fn)
    ours, ref = ours.to(device), ref.to(device)
    x = torch.rand(16, 1, 28, 28, device=device)
    x[3] *= 20  # some inputs over the input bound, some under
    assert_matches_float64_truth(ours, ref, x)


def test_cifar10_net_matches_reference(device):
    torch.manual_seed(1)
    ours, ref = paired(models.cifar10_net(), input_clip=10.0, grad_clip=0.01, norm="l15")
    ours, ref = ours.to(device), ref.to(device)
    x = torch.randn(3, 3, 32, 32, device=device)
    assert_matches_float64_truth(ours, ref, x)


@pytest.mark.parametrize("clip_fn", CLIP_FNS)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_3d_input_matches_reference(device, clip_fn, bias):
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(7, 11, bias=bias), nn.Tanh(), nn.Linear(11, 5, bias=bias))
    # 1.5 and 0.3 would drop every example under 'global'; 9.5 lies in a gap of the input norms (8.83 | 9.7
    # with bias, 9.04 | 9.94 without) and 48 in one of the last layer's upstream norms (44.3 | 52.1).
    input_clip, grad_clip = (9.5, 48.0) if clip_fn == "global" else (1.5, 0.3)
    ours, ref = paired(model, input_clip=input_clip, grad_clip=grad_clip, clip_fn=clip_fn)
    x = torch.randn(6, 4, 7, device=device) * 2
    assert_matches_float64_truth(ours.to(device), ref.to(device), x)


CONV_CASES = [
    dict(kernel_size=3),
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=(3, 2), stride=(2, 1), padding=(1, 2), dilation=(2, 1)),
    dict(kernel_size=3, padding=2, dilation=2, groups=2),
    dict(kernel_size=1, groups=4),
    dict(kernel_size=5, padding="same"),
]


@pytest.mark.parametrize("case", CONV_CASES, ids=[str(c) for c in CONV_CASES])
@pytest.mark.parametrize("norm", ["l15", "l2"])
@pytest.mark.parametrize("bias", [True, False])
def test_conv2d_variants_match_reference(device, case, norm, bias):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(4, 8, bias=bias, **case), nn.ReLU(), nn.Conv2d(8, 4, 3, bias=bias))
    ours, ref = paired(model, input_clip=2.0, grad_clip=0.2, norm=norm)
    x = torch.randn(5, 4, 11, 9, device=device) * 3
    assert_matches_float64_truth(ours.to(device), ref.to(device), x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_layers_as_accurate_as_reference(request, device, dtype):
    """In bf16/fp16 our gradients are no further from the float64 truth than the plain-PyTorch oracle's own."""
    if device == "cpu" and dtype == torch.float16:
        pytest.skip("fp16 convolution is not implemented on every CPU backend; CUDA covers fp16")
    if device == "cuda" and dtype == torch.bfloat16:
        request.applymarker(pytest.mark.xfail(strict=True, reason=(
            "open (design.md): clipped rows are rounded toward zero so that no rounded row exceeds its "
            "bound, which shrinks bf16 rows by up to 2^-8; on an H100 the conv weight gradient erred "
            "0.0061 against the oracle's 0.0032")))
    torch.manual_seed(4)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 10))
    ours, ref = paired(model.to(dtype).float(), input_clip=3.0, grad_clip=0.5)  # weights representable in dtype
    x = torch.randn(4, 3, 8, 8, device=device).to(dtype)
    w_out = torch.randn(4, 10, device=device).to(dtype)
    _, exact, _ = grads_of(copy.deepcopy(ref).to(device=device, dtype=torch.float64), x.double(), w_out.double())
    _, g_ref, _ = grads_of(copy.deepcopy(ref).to(device=device, dtype=dtype), x, w_out)
    _, g_ours, _ = grads_of(ours.to(device=device, dtype=dtype), x, w_out)
    for name in exact:
        err_ours = ((g_ours[name].double() - exact[name]).norm() / exact[name].norm()).item()
        err_ref = ((g_ref[name].double() - exact[name]).norm() / exact[name].norm()).item()
        assert err_ours <= 1.25 * err_ref + 1e-3, (name, err_ours, err_ref)


@pytest.mark.parametrize("clip_fn", ["clip", "global", "normalize"])
def test_gradcheck_input_clipping_float64(clip_fn):
    """The input-clipping VJP is the exact derivative of the clipping map, for every clip function."""

    class ClipRows(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            out, f, n = _ops.clip_rows(x, torch.zeros(1, dtype=torch.int64), 0.8, "l2", clip_fn, 0.01)
            ctx.save_for_backward(out, f, n)
            return out

        @staticmethod
        def backward(ctx, g):
            out, f, n = ctx.saved_tensors
            return _ops.clip_rows_backward(g.contiguous(), out, f, n, 0.8, clip_fn)

    torch.manual_seed(5)
    x = torch.randn(5, 3, 4, dtype=torch.float64)
    x[0] *= 0.01  # under the bound (for 'global': kept; others: mostly clipped)
    assert torch.autograd.gradcheck(ClipRows.apply, (x.requires_grad_(),))


@pytest.mark.parametrize("clip_fn", ["clip", "global"])
def test_gradcheck_float64(clip_fn):
    """With the upstream bound out of reach, our backward is the exact gradient of our forward.

    ('normalize' rescales every upstream gradient, so its backward is deliberately not the forward's
    gradient; its input-clipping VJP is gradchecked on its own above.)"""
    torch.manual_seed(5)
    lin = bnn.Linear(5, 3, input_clip=0.7, grad_clip=1e6, clip_fn=clip_fn, dtype=torch.float64)
    x = torch.randn(4, 2, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: bpclip_fast.autograd.clipped_linear(x, w, b, lin, 1.0),
                                    (x, lin.weight, lin.bias))
    conv = bnn.Conv2d(2, 3, 3, stride=2, padding=1, dilation=1, input_clip=0.9, grad_clip=1e6, clip_fn=clip_fn,
                      dtype=torch.float64)
    xc = torch.randn(3, 2, 6, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, w, b: bpclip_fast.autograd.clipped_conv2d(x, w, b, conv, 1.0, conv._explicit_padding),
        (xc, conv.weight, conv.bias))


def test_empty_batch(device):
    lin = bnn.Linear(4, 3, input_clip=1.0, grad_clip=1.0).to(device)
    conv = bnn.Conv2d(2, 3, 3, input_clip=1.0, grad_clip=1.0).to(device)
    for layer, x in [(lin, torch.randn(0, 4, device=device)), (conv, torch.randn(0, 2, 5, 5, device=device))]:
        x.requires_grad_()
        y = layer(x)
        assert y.shape[0] == 0
        y.sum().backward()
        assert (layer.weight.grad == 0).all() and (layer.bias.grad == 0).all()
        assert x.grad.shape == x.shape


# ---------------------------------------------------------------- noise


def noisy_and_clean(layer, x, sigma, stream):
    """Gradients of one armed step and of the same step without noise."""
    w_out = torch.randn_like(layer(x).detach())
    layer.zero_grad()
    layer(x).mul(w_out).sum().backward()
    clean = layer.weight.grad.clone(), layer.bias.grad.clone()
    layer.zero_grad()
    layer.noise_multiplier = sigma
    bnn.arm_noise(layer, stream)
    layer(x).mul(w_out).sum().backward()
    layer.noise_multiplier = 0.0
    return clean, (layer.weight.grad.clone(), layer.bias.grad.clone())


@pytest.mark.parametrize("kind", ["linear", "conv"])
def test_noise_is_philox_stream_scaled_by_sensitivity(device, kind):
    torch.manual_seed(6)
    if kind == "linear":
        layer = bnn.Linear(30, 20, input_clip=1.0, grad_clip=0.5).to(device)
        x = torch.randn(8, 3, 30, device=device)
    else:
        layer = bnn.Conv2d(3, 6, 3, input_clip=1.0, grad_clip=0.5, norm="l2").to(device)
        x = torch.randn(8, 3, 7, 7, device=device)
    layer.set_max_input_shape(x.shape[1:])  # Δ depends on the shape here: fixed before any noise
    stream = bnn.NoiseStream(seed=1234)
    (cw, cb), (nw, nb) = noisy_and_clean(layer, x, 2.0, stream)
    std = 2.0 * layer.sensitivity_for(tuple(x.shape))
    assert layer.sensitivity == layer.sensitivity_for(tuple(x.shape))
    offset = stream.offset(0) - (1 << 20)  # the step that was just armed
    ew = _ops.philox_noise_(torch.zeros_like(cw), 1234, offset, std)
    eb = _ops.philox_noise_(torch.zeros_like(cb), 1234, offset + 1, std)
    torch.testing.assert_close(nw - cw, ew, rtol=1e-4, atol=1e-5 * std)
    torch.testing.assert_close(nb - cb, eb, rtol=1e-4, atol=1e-5 * std)


def test_noise_added_once_with_gradient_accumulation(device):
    torch.manual_seed(7)
    layer = bnn.Linear(10, 4, input_clip=1.0, grad_clip=1.0).to(device)
    layer.noise_multiplier = 3.0
    x1, x2 = torch.randn(5, 10, device=device), torch.randn(5, 10, device=device)
    layer(x1).sum().backward()
    layer(x2).sum().backward()
    clean = layer.weight.grad.clone()
    layer.zero_grad()
    stream = bnn.arm_noise(layer, bnn.NoiseStream(seed=9))
    layer(x1).sum().backward()  # two micro-batches, two backward passes, one step
    layer(x2).sum().backward()
    noise = layer.weight.grad - clean
    expect = _ops.philox_noise_(torch.zeros_like(clean), 9, 0, 3.0 * layer.sensitivity_for(tuple(x1.shape)))
    torch.testing.assert_close(noise, expect, rtol=1e-4, atol=1e-4)
    assert stream.step == 1


def test_noise_distinct_across_steps_and_layers(device):
    model = nn.Sequential(bnn.Linear(8, 8, input_clip=1.0, grad_clip=1.0),
                          bnn.Linear(8, 8, input_clip=1.0, grad_clip=1.0)).to(device)
    for m in model:
        m.noise_multiplier = 1.0
    stream = bnn.NoiseStream(seed=11)
    x = torch.zeros(2, 8, device=device)  # zero input: the gradients are pure noise (plus bias terms)
    draws = []
    for _ in range(2):
        model.zero_grad()
        bnn.arm_noise(model, stream)
        model(x).sum().backward()
        draws += [model[0].weight.grad.clone(), model[1].weight.grad.clone()]
    for i in range(len(draws)):
        for j in range(i):
            assert not torch.allclose(draws[i], draws[j])


def test_noise_off_when_multiplier_zero_and_when_not_armed(device):
    layer = bnn.Linear(5, 2, input_clip=1.0, grad_clip=1.0).to(device)
    x = torch.randn(3, 5, device=device)
    layer(x).sum().backward()
    clean = layer.weight.grad.clone()
    layer.zero_grad()
    bnn.arm_noise(layer)  # armed, but noise_multiplier is 0
    layer(x).sum().backward()
    assert torch.equal(layer.weight.grad, clean)


def test_seeded_streams_reproduce_and_default_is_secure():
    a, b = bnn.NoiseStream(), bnn.NoiseStream()
    assert a.secure and b.secure and a.seed != b.seed
    s = bnn.NoiseStream(seed=5)
    assert not s.secure and s.seed == 5
    grads = []
    for _ in range(2):
        torch.manual_seed(0)
        layer = bnn.Linear(4, 4, input_clip=1.0, grad_clip=1.0)
        layer.noise_multiplier = 1.0
        bnn.arm_noise(layer, bnn.NoiseStream(seed=5))
        layer(torch.ones(2, 4)).sum().backward()
        grads.append(layer.weight.grad)
    assert torch.equal(grads[0], grads[1])
    # The default stream does not follow torch.manual_seed.
    outs = []
    for _ in range(2):
        torch.manual_seed(0)
        layer = bnn.Linear(4, 4, input_clip=1.0, grad_clip=1.0)
        layer.noise_multiplier = 1.0
        bnn.arm_noise(layer)
        layer(torch.ones(2, 4)).sum().backward()
        outs.append(layer.weight.grad)
    assert not torch.equal(outs[0], outs[1])


# ---------------------------------------------------------------- errors


def test_error_padding_mode():
    with pytest.raises(ValueError, match="padding_mode='reflect' is not supported"):
        bnn.Conv2d(1, 1, 3, padding=1, padding_mode="reflect", input_clip=1.0, grad_clip=1.0)
    model = nn.Sequential(nn.Conv2d(1, 1, 3, padding=1, padding_mode="circular"))
    with pytest.raises(ValueError, match=r"0 \(Conv2d\): padding_mode='circular'"):
        bnn.convert_model(model, input_clip=1.0, grad_clip=1.0)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_error_non_positive_bounds(bad):
    with pytest.raises(ValueError, match="input_clip must be a positive finite number"):
        bnn.Linear(2, 2, input_clip=bad, grad_clip=1.0)
    with pytest.raises(ValueError, match="grad_clip must be a positive finite number"):
        bnn.Conv2d(1, 1, 1, input_clip=1.0, grad_clip=bad)


def test_error_unknown_clip_fn_and_norm():
    with pytest.raises(ValueError, match="clip_fn must be one of"):
        bnn.Linear(2, 2, input_clip=1.0, grad_clip=1.0, clip_fn="clamp")
    with pytest.raises(ValueError, match="norm must be one of"):
        bnn.Conv2d(1, 1, 1, input_clip=1.0, grad_clip=1.0, norm="l1")


def test_error_shape_dependent_sensitivity_needs_a_declared_maximum():
    layer = bnn.Linear(4, 4, input_clip=1.0, grad_clip=1.0)
    layer.noise_multiplier = 1.0
    bnn.arm_noise(layer)
    with pytest.raises(RuntimeError, match="depends on the input shape"):
        layer(torch.randn(2, 3, 4))  # noise scaled to this batch's T would reveal T
    layer(torch.randn(2, 4)).sum().backward()  # 2-D input: T = 1 whatever the data
    layer.set_max_input_shape((3, 4))
    layer(torch.randn(2, 3, 4))
    layer(torch.randn(2, 2, 4))  # smaller: the noise stays scaled to the declared maximum
    with pytest.raises(bpclip_fast.StepRefused, match=r"max-shape.*input shape \(2, 5, 4\)") as err:
        layer(torch.randn(2, 5, 4))
    assert not err.value.charged  # bare layers have no accountant
    with torch.no_grad():
        layer(torch.randn(2, 5, 4))  # evaluation trains nothing: no limit


def test_error_wrong_device():
    layer = bnn.Linear(3, 2, input_clip=1.0, grad_clip=1.0)
    with pytest.raises(ValueError, match="input is on meta but the layer's parameters are on cpu"):
        layer(torch.randn(2, 3, device="meta"))


def test_error_unsupported_or_mismatched_dtype():
    layer = bnn.Linear(3, 2, input_clip=1.0, grad_clip=1.0)
    with pytest.raises(TypeError, match="unsupported input dtype torch.int64"):
        layer(torch.ones(2, 3, dtype=torch.int64))
    with pytest.raises(TypeError, match="input is torch.bfloat16 but the layer's parameters are torch.float32"):
        layer(torch.ones(2, 3, dtype=torch.bfloat16))


def test_error_missing_batch_dimension():
    with pytest.raises(ValueError, match="needs a batch dimension"):
        bnn.Linear(3, 2, input_clip=1.0, grad_clip=1.0)(torch.ones(3))
    with pytest.raises(ValueError, match=r"must be \[B, C, H, W\]"):
        bnn.Conv2d(1, 2, 3, input_clip=1.0, grad_clip=1.0)(torch.ones(1, 5, 5))


def test_error_convert_refuses_batchnorm_and_unknown_trainables():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"1 \(BatchNorm2d\): BatchNorm in training mode normalises each example with "
                       "statistics"):
        bnn.convert_model(model, input_clip=1.0, grad_clip=1.0)
    assert type(model[0]) is nn.Conv2d  # nothing was changed
    # No fused layer: the generic exact path trains it under flat/per_layer (tests/test_generic.py)
    with pytest.raises(ValueError, match=r"0 \(PReLU\): clipping='backprop' has no proved bound"):
        bnn.convert_model(nn.Sequential(nn.PReLU(), nn.Linear(3, 2)), input_clip=1.0, grad_clip=1.0)
    with pytest.raises(ValueError, match=r"0 \(Embedding\).*use clipping='flat' or 'per_layer'"):
        bnn.convert_model(nn.Sequential(nn.Embedding(5, 3)), input_clip=1.0, grad_clip=1.0)
    frozen = nn.Sequential(nn.LayerNorm(3), nn.Linear(3, 2))
    frozen[0].requires_grad_(False)
    bnn.convert_model(frozen, input_clip=1.0, grad_clip=1.0)
    assert isinstance(frozen[1], bnn.Linear)


def test_convert_and_validate_consult_one_registry():
    """convert_model (the path without the engine) refuses exactly what validate refuses: an
    InstanceNorm with running statistics between two trainable layers was once accepted by
    convert_model while validate refused it."""
    def model():
        return nn.Sequential(nn.Conv2d(1, 2, 3), nn.InstanceNorm2d(2, track_running_stats=True), nn.Flatten(),
                             nn.Linear(2 * 4 * 4, 3))

    from bpclip_fast import validate

    problems = validate.static_problems(model())
    assert len(problems) == 1 and problems[0].startswith("1 (InstanceNorm2d): InstanceNorm with track_running_stats")
    net = model()
    with pytest.raises(ValueError) as err:
        bnn.convert_model(net, input_clip=1.0, grad_clip=1.0)
    assert problems[0] in str(err.value)
    assert type(net[0]) is nn.Conv2d and type(net[3]) is nn.Linear  # nothing was changed
    fine = nn.Sequential(nn.Conv2d(1, 2, 3), nn.InstanceNorm2d(2), nn.Flatten(), nn.Linear(2 * 4 * 4, 3))
    assert validate.static_problems(fine) == []
    bnn.convert_model(fine, input_clip=1.0, grad_clip=1.0)
    assert isinstance(fine[0], bnn.Conv2d) and isinstance(fine[3], bnn.Linear)


def test_check_finite_names_layers_and_resets(device):
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    bnn.convert_model(model, input_clip=1.0, grad_clip=1.0)
    model.to(device)
    x = torch.randn(5, 3, device=device)
    x[2, 1] = float("nan")
    out = model(x)
    assert torch.isfinite(out).all()  # the bad example was dropped, not spread
    w = torch.ones_like(out)
    w[4, 0] = float("inf")
    (out * w).sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    with pytest.raises(bnn.NonFiniteError, match=r"0: 1 input\(s\), 0 upstream gradient\(s\)") as err:
        bnn.check_finite(model)
    assert err.value.counts["2"] == (0, 1)
    bnn.check_finite(model)  # reset: no error now


def test_sensitivity_needs_a_declared_shape_where_it_depends_on_one():
    conv = bnn.Conv2d(1, 1, 3, input_clip=1.0, grad_clip=1.0, norm="l2")
    with pytest.raises(RuntimeError, match="grows with the input's height"):
        conv.sensitivity
    conv(torch.randn(1, 1, 5, 5))  # a forward does not fix it: the next batch may be larger
    with pytest.raises(RuntimeError, match="grows with the input's height"):
        conv.sensitivity
    conv.set_max_input_shape((1, 5, 5))
    assert conv.sensitivity == conv.sensitivity_for((1, 1, 5, 5))
    assert bnn.Conv2d(1, 1, 3, input_clip=1.0, grad_clip=1.0).sensitivity == pytest.approx(math.sqrt(2))
    assert bnn.Linear(3, 2, bias=False, input_clip=2.0, grad_clip=1.0).sensitivity == 2.0


# ---------------------------------------------------------------- drop-in behaviour


def test_state_dicts_load_both_ways():
    torch.manual_seed(8)
    plain = models.mnist_net()
    ours = bnn.convert_model(copy.deepcopy(plain), input_clip=1.0, grad_clip=1.0)
    ours_sd = ours.state_dict()
    assert ours_sd.keys() == plain.state_dict().keys()
    fresh_plain = models.mnist_net()
    fresh_plain.load_state_dict(ours_sd)
    fresh_ours = bnn.convert_model(models.mnist_net(), input_clip=1.0, grad_clip=1.0)
    fresh_ours.load_state_dict(plain.state_dict())
    for a, b in zip(fresh_plain.parameters(), fresh_ours.parameters()):
        assert torch.equal(a, b)
    # With no clipping active the forward is the plain forward.
    x = torch.rand(2, 1, 28, 28) * 1e-3
    torch.testing.assert_close(bnn.convert_model(copy.deepcopy(plain), input_clip=1e3, grad_clip=1.0)(x), plain(x))


def test_convert_keeps_parameter_objects():
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Conv2d(1, 1, 1))
    params = [id(p) for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    bnn.convert_model(model, input_clip=1.0, grad_clip=1.0)
    assert isinstance(model[0], bnn.Linear) and isinstance(model[2], bnn.Conv2d)
    assert [id(p) for p in model.parameters()] == params
    model[0](torch.randn(2, 3)).sum().backward()
    before = model[0].weight.detach().clone()
    opt.step()
    assert not torch.equal(before, model[0].weight)
    single = bnn.convert_model(nn.Linear(2, 2), input_clip=1.0, grad_clip=1.0)
    assert isinstance(single, bnn.Linear)


def test_tempered_sigmoid_default_is_tanh():
    x = torch.linspace(-5, 5, 101, dtype=torch.float64)
    torch.testing.assert_close(bnn.TemperedSigmoid()(x), torch.tanh(x))
    torch.testing.assert_close(bnn.TemperedSigmoid(1.0, 1.0, 0.0)(x), torch.sigmoid(x))


def test_torch_compile_traces_our_layers():
    torch.manual_seed(9)
    model = bnn.convert_model(nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 3)),
                              input_clip=1.0, grad_clip=0.5)
    x = torch.randn(3, 2, 6, 6)
    eager = grads_of(model, x, torch.ones(3, 3))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=False)
    traced = grads_of(compiled, x, torch.ones(3, 3))
    torch.testing.assert_close(traced[0], eager[0])
    for name in eager[1]:
        torch.testing.assert_close(traced[1][name.replace("_orig_mod.", "")] if name in traced[1] else
                                   traced[1]["_orig_mod." + name], eager[1][name])


def test_build_info_reports_the_build():
    info = bpclip_fast.build_info()
    for key in ("cuda_compiled", "cuda_archs", "torch_version", "cuda_available"):
        assert key in info
    assert isinstance(info["cuda_compiled"], bool) and isinstance(info["cuda_archs"], list)
    assert info["cuda_available"] == torch.cuda.is_available()
    if info["cuda_compiled"]:
        assert {"sm_80", "sm_90"} <= set(info["cuda_archs"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(5, 37), (3, 4, 9), (4, 3, 5, 5)], ids=str)
@pytest.mark.parametrize("case", ["nonfinite", "finite", "channels_last"])
def test_backward_recomputes_the_clipped_input_bit_for_bit(device, dtype, shape, case):
    # The layers save x and the backward ops rebuild x̃ = s·x with scale_rows (reclip in
    # csrc/layers.cpp); the backward is only the forward's gradient if that rebuild equals what
    # clip_rows produced, bit for bit: with zeroed examples (non-finite rows: s = 0), without any
    # (the CPU skips the zeroing pass then), and from an input that is not row-major.
    if case == "channels_last" and len(shape) != 4:
        pytest.skip("channels_last is a 4-d layout")
    x = (torch.randn(shape) * 3).to(dtype).to(device)
    if case == "nonfinite":
        x.view(shape[0], -1)[1, 2] = float("nan")
        x.view(shape[0], -1)[2, 0] = float("inf")
    if case == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    cnt = torch.zeros(1, dtype=torch.int64, device=device)
    xc, factor, _ = torch.ops.bpclip_fast.clip_rows(x, cnt, 2.0, "l2", "clip", 0.01)
    rebuilt = torch.ops.bpclip_fast.scale_rows(x, factor)
    assert rebuilt.dtype == xc.dtype and rebuilt.shape == xc.shape and rebuilt.is_contiguous()
    assert torch.equal(rebuilt.view(-1).view(torch.uint8), xc.contiguous().view(-1).view(torch.uint8))
    assert int(cnt) == (2 if case == "nonfinite" else 0)


def test_clipped_model_saves_no_more_for_backward_than_the_plain_one():
    # Structural, not timed: the layers save their input x (shared with the activation that made
    # it), not a second, clipped copy, so autograd holds the plain model's bytes plus two numbers
    # per example and layer (the factor and the norm). Saving x̃ failed this by 48 MB on the
    # CIFAR-10 net at batch 128.
    import copy

    from bpclip_fast import models

    def saved_bytes(model, x):
        # Walked in the graph, not through saved_tensors_hooks, which the clipped layers save past
        # (bpclip_fast.autograd._apply_without_hooks): every node's saved tensors, by storage.
        storages, stack, seen, kept = {}, [model(x).sum().grad_fn], set(), []
        while stack:
            fn = stack.pop()
            if fn is None or id(fn) in seen:
                continue
            seen.add(id(fn))
            kept.append(fn)  # alive, so that no later node's wrapper reuses its id
            held = list(fn.saved_tensors) if hasattr(fn, "saved_tensors") else []  # our Functions
            for name in dir(fn):
                if name.startswith("_saved_"):
                    v = getattr(fn, name)
                    held += [v] if isinstance(v, torch.Tensor) else [t for t in v if isinstance(t, torch.Tensor)] \
                        if isinstance(v, (list, tuple)) else []
            for t in held:
                if t is not None:
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            stack += [n for n, _ in fn.next_functions]
        return sum(storages.values())

    torch.manual_seed(0)
    plain = models.mnist_net()
    clipped = bnn.convert_model(copy.deepcopy(plain), input_clip=1.0, grad_clip=1.0)
    x = torch.randn(16, 1, 28, 28)
    per_example_scalars = len(bnn.clipped_layers(clipped)) * 2 * 16 * 4  # each layer's factor and norm
    assert saved_bytes(clipped, x) <= saved_bytes(plain, x) + per_example_scalars
