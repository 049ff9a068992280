"""Regression tests for what the bound fuzzer (tests/test_bound_fuzz.py, issue 24) found: each is the
shrunk case written out by hand, run through the same checks (tests/fuzz_bounds.py ``check``). A
finding not fixed yet would be a strict xfail here, its branch of the fuzzer's draws kept out by
``KNOWN_BROKEN`` in tests/test_bound_fuzz.py until its fix lands (none is now).
"""

from __future__ import annotations

import pytest
import torch

import fuzz_bounds as fb
import fuzz_generic as fg

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# Findings (a)-(c) were fixed on branch h1 (merge 4c7de2a) while the fuzzer was written, (d) by
# the products and squares of csrc/exact.cpp's rows_norms taken in double; each test below failed on
# the code before its fix as its docstring says.


def _conv(layout, method, **geometry):
    base = dict(cin=2, cout=2, kernel=(3, 3), stride=(1, 1), padding=(2, 2), dilation=(1, 1), groups=1)
    base.update(geometry)
    return fb.Case(kind="conv", mode="per_layer", dtype=torch.float32, clip_fn="clip", bias=False,
                   geometry=base, shape=(2, 5, 5), batch=1, layout=layout, values_x=("spike",),
                   values_g=("normal",), seed=3, bound=0.1, norm_method=method)


def test_conv_padded_case_holds_when_contiguous():
    """The case below with a contiguous input keeps its bound: the defect is the layout alone."""
    fb.check(_conv("contiguous", "ghost"))


@pytest.mark.parametrize("layout", ["channels_last", "nhwc_view"])
def test_conv_padded_channels_last_norms_read_the_wrong_patches(layout):
    """Found by the fuzzer (known bug (a)): a zero-padded Conv2d under flat/per_layer with a
    channels_last input, or an NHWC tensor viewed as NCHW by ``permute``. csrc/exact.cpp
    ``patches`` padded with ``constant_pad_nd`` (which keeps the input's memory format) and then
    took ``as_strided`` views with contiguous NCHW strides, so the norm was taken over the wrong
    patches (unpadded inputs went through ``x.contiguous()`` and were right). The release itself
    read the right values, so the example's stored contribution was ``C·‖G‖/bound`` with the bound
    of other numbers: 16.2×C here (a spike input, ghost norms), up to 427×C reported. Fixed on h1:
    the patches' view is built from the padded input's own strides."""
    fb.check(_conv(layout, "ghost"))


def test_conv_padded_channels_last_kept_gradients_are_the_wrong_gradient():
    """The same root cause on the instantiation path that keeps the per-example gradients: the
    kept ``G_i`` are built from the misread patches, so the bound and the release agree with each
    other (the contribution stays within C) but the released gradient is not the layer's gradient:
    the norm bound is below the true norm and the release is off the float64 truth."""
    case = fb.Case(kind="conv", mode="flat", dtype=torch.float64, clip_fn="clip", bias=False,
                   geometry=dict(cin=2, cout=1, kernel=(1, 1), stride=(1, 1), padding=(0, 1), dilation=(1, 1),
                                 groups=1),
                   shape=(2, 1, 2), batch=1, layout="channels_last", values_x=("normal",), values_g=("normal",),
                   bound=1e-3, gamma=1e-6)
    fb.check(case)


def _cancel(dtype=torch.float16, clip_fn="clip", bound=1e-3, seed=1):
    return fb.Case(kind="linear", mode="per_layer", dtype=dtype, clip_fn=clip_fn, bias=False,
                   geometry={"fin": 4, "fout": 3}, shape=(128, 4), batch=1, values_x=("cancel",),
                   values_g=("cancel",), seed=seed, bound=bound, norm_method="ghost")


def test_cancelling_positions_hold_in_bfloat16_and_float32():
    """The case below in the types whose subnormal range is out of reach keeps its bound."""
    fb.check(_cancel(torch.bfloat16))
    fb.check(_cancel(torch.float32))


def test_fp16_cancelling_positions_lose_the_cancellation_in_subnormals():
    """Found by the fuzzer (known bug (b)): Linear, fp16, T = 128 positions in pairs g: v, −2v with
    x: u, u/2, so the example's weight gradient cancels exactly (G = 0) but its spread
    P = Σ_t ‖g_t‖‖x_t‖ is large; the norm bound is then its margin (∝ P), the factor c = C/bound is
    small and c·g falls in fp16's subnormal range, where RZ(c·g) (scale_rows) loses up to one
    subnormal step (2^-24) *absolutely*: RZ(c·v) and RZ(−2c·v) no longer cancel, and the 64 pairs
    add coherently. The stored contribution was 2.11×C here (10.7×C reported at T = 128): the
    margin in csrc/exact.cpp was relative (r·P) only. Fixed on h1: c·g is rounded toward zero to
    fp32 (the release's accumulation dtype), and the bound carries the absolute term 2K·q·√p·X."""
    fb.check(_cancel())


def test_fp16_normalize_saturates_the_scaled_gradient():
    """Found by the fuzzer (new): Linear, flat, fp16, clip_fn="normalize", C = 10, γ = 1e-6, an
    example whose two positions cancel (x: u, u/2; g: v, −2v) with small values. Its norm bound is
    tiny, so normalize's factor c = C/(bound + γ) is about 2100 and c·g (−91 000, 182 000) exceeds
    fp16's largest value: scale_rows saturates both to ∓65504, the pair no longer cancels and the
    stored contribution is 184×C. The proof in csrc/exact.cpp assumes |RZ(c·g) − c·g| ≤ r·|c·g|,
    which saturation breaks (only normalize has c > 1). Fixed on h1 as a side effect of scaling
    into fp32; fp32/bf16 data can still saturate where C·max|g|/γ > 3.4e38, which finding (d)
    currently masks (such a g overflows the norms first)."""
    case = fb.Case(kind="linear", mode="flat", dtype=torch.float16, clip_fn="normalize", bias=False,
                   geometry={"fin": 3, "fout": 1}, shape=(2, 3), batch=5,
                   values_x=("normal", "normal", "scaled", "cancel", "normal"), values_g=("normal",) * 5, seed=1,
                   bound=10.0, gamma=1e-6)
    fb.check(case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("method", ["ghost", "instantiate"])
def test_exact_norms_of_a_large_finite_gradient_overflow_float32(dtype, method):
    """Found by the fuzzer (new): Linear with T = 2 positions under flat/per_layer, one example with
    entries 1e12 in x and g, so its per-example gradient (entries 2e24, norm ~4e24) is finite in
    float32. The exact norms square in float32 before summing in double (csrc/exact.cpp
    ``rows_norms``: ``gx * gg`` of the Gram matrices, ``inst.square()``, and the fp32 position norms
    of the spread), which overflows above ~1.8e19: the bound is infinite, the example is dropped
    (factor 0) and counted as non-finite, and ``check_finite`` raises NonFiniteError for finite
    data. A step then fails because of one record: the data-dependent error DESIGN.md §5 says must
    not be released (clip_rows, the backprop path, keeps such rows: its norms accumulate in fp64).
    Fixed: the Gram products and the instantiated squares are taken in double; rows of norm above
    ~2^64 can still overflow the fp32 position norms (a documented limit, csrc/exact.cpp)."""
    case = fb.Case(kind="linear", mode="per_layer", dtype=dtype, clip_fn="clip", bias=True,
                   geometry={"fin": 3, "fout": 2}, shape=(2, 3), batch=2, values_x=("normal", "huge"),
                   values_g=("normal", "huge"), bound=1.0, norm_method=method)
    x, g = fb.inputs(case, fb.plain_layer(case))
    assert torch.isfinite(torch.einsum("tp,td->pd", g[1], x[1]).to(torch.float32)).all()  # finite in fp32
    fb.check(case)  # asserts first that no finite example was counted as non-finite


def test_fp16_release_beyond_the_dtype_range_overflows_only_where_the_exact_sum_does():
    """Found by the fuzzer's long run (new; seed 1 after ~8100 examples): backprop Linear in fp16
    with C_x = C_g = 1000, so Δ = 10^6 is above fp16's largest value 65504. Examples' contributions
    of up to 9.7e5 (within Δ) are summed in fp32 and rounded to fp16 once, after the noise, so a
    coordinate whose sum leaves fp16's range becomes ±inf: here the full batch's release is finite
    (48832) but the batch without example 1 gives +inf. That rounding is post-processing of the
    noised value, so the guarantee holds, but such a layer trains on infinite gradients (with noise
    σΔ ≥ 65504 every step). Pinned here: only coordinates whose exact sum is out of range go
    non-finite (fuzz_bounds ``_overflowed``). Suggested: refuse, at convert_model/make_private, a
    fp16 layer whose Δ (times σ) exceeds the dtype's range, naming the layer and the bound."""
    case = fb.Case(kind="linear", mode="backprop", dtype=torch.float16, clip_fn="normalize", bias=False,
                   geometry={"fin": 1, "fout": 1}, shape=(4, 1), batch=5,
                   values_x=("normal", "normal", "normal", "normal", "spike"),
                   values_g=("scaled", "scaled", "normal", "scaled", "normal"), seed=1, bound=1000.0, gamma=0.01)
    layer = fb.plain_layer(case)
    model = fb.converted(case, layer)
    x, g = fb.inputs(case, layer)
    assert torch.isfinite(fb.release(model, case, x, g)).all()
    assert not torch.isfinite(fb.release(model, case, x[[0, 2, 3, 4]], g[[0, 2, 3, 4]])).all()
    assert fb.check(case).get("overflow")


@pytest.mark.parametrize("mode", ["flat", "per_layer"])
def test_conv_with_one_output_position_takes_its_norm_in_double(mode):
    """Found by the fuzzer's long run (new; seed 11): a Conv2d whose output has one position (a 1x1 input
    and kernel) under flat/per_layer, one example with x ~ 1e6 and g ~ 1e15. With one position the norm
    op takes sq = ||x||^2 ||g||^2 from the position norms, which for Conv2d were fp32 (Linear's are
    double sums): their product (1e42) overflowed, so a finite example was counted as non-finite and
    dropped, and the proof's double-precision term (u = v for T = 1) did not hold for them. Fixed:
    at T = 1 the conv's position norms are double sums over the patches, as Linear's."""
    case = fb.Case(kind="conv", mode=mode, dtype=torch.float32, clip_fn="clip", bias=False,
                   geometry={"cin": 1, "cout": 1, "kernel": (1, 1), "stride": (1, 1), "padding": (0, 0),
                             "dilation": (1, 1), "groups": 1},
                   shape=(1, 1, 1), batch=2, values_x=("normal", "scaled"), values_g=("normal", "huge"), seed=0,
                   bound=0.001, gamma=1e-6)
    fb.check(case)  # asserts first that no finite example was counted as non-finite


# ------------------------------------------------------------------------------ the generic exact path
# Found by the fuzzer's generic kinds (tests/fuzz_generic.py); each failed on e01e365 as its
# docstring says.


def _lstm(batch, layers, bidirectional, values_g, dtype=torch.float64, mode="per_layer"):
    return fb.Case(kind="lstm", mode=mode, dtype=dtype, clip_fn="clip", bias=True,
                   geometry=dict(hidden=2, layers=layers, bidirectional=bidirectional, batch_first=True,
                                 outputs="all"),
                   shape=(3, 2), batch=batch, values_x=("normal",) * batch, values_g=values_g, seed=5, bound=0.1)


@pytest.mark.filterwarnings("ignore:bpclip_fast.*generic exact path")
@pytest.mark.parametrize("mode", ["flat", "per_layer"])
@pytest.mark.parametrize("layers, bidirectional", [(2, False), (1, True)])
def test_batch_first_rnn_hidden_state_masks_the_examples_not_the_layers(layers, bidirectional, mode):
    """A ``batch_first`` LSTM whose ``h_n``/``c_n`` receive a gradient (``head(h_n[-1])``, the usual
    classifier): torch never applies ``batch_first`` to the hidden states, ``[layers·D, B, H]``, but
    ``generic.batch_dims`` masked dimension 0 of every output of a batch_first module. With
    ``B = layers·D`` (here 2) nothing refused it and example ``i``'s "gradient" was the gradient of
    layer/direction ``i``'s final state over *every* example: the zero-gradient example 1 got a
    stored gradient of norm > 0 (example 0's data, clipped and released as example 1's), and its
    removal crashed on the refusal below. Fixed by taking ``h_n``/``c_n``'s batch from dimension 1."""
    fg.check(_lstm(2, layers, bidirectional, ("normal", "zero"), mode=mode))


@pytest.mark.filterwarnings("ignore:bpclip_fast.*generic exact path")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16])
def test_batch_first_rnn_hidden_state_is_not_refused(dtype):
    """The same defect where ``B ≠ layers·D``: the step was refused ("an output of shape (1, 3, 2)
    has no dimension 0 of 3 rows") for an ordinary use of ``h_n``."""
    fg.check(_lstm(3, 1, False, ("normal", "scaled", "spike"), dtype=dtype))


@pytest.mark.filterwarnings("ignore:bpclip_fast.*generic exact path")
@pytest.mark.parametrize("kind", ["custom", "mha"])
def test_generic_unit_on_an_empty_batch_releases_zeros(kind):
    """The removal of a batch's only example: the unit's backward on zero rows crashed
    (``torch.cat(): expected a non-empty list of Tensors`` in ``generic._per_example``) where every
    fused layer releases zeros (plus the noise): an empty Poisson batch is a legal step."""
    geometry = {} if kind == "custom" else dict(heads=1, batch_first=True, need_weights=False, outputs="first")
    fg.check(fb.Case(kind=kind, mode="flat", dtype=torch.float32, clip_fn="clip", bias=True, geometry=geometry,
                     shape=(2, 2), batch=1, values_x=("normal",), values_g=("normal",), bound=1e-3))


@pytest.mark.filterwarnings("ignore:bpclip_fast.*generic exact path")
def test_one_examples_overflowing_forward_nulls_every_examples_gradient():
    """Found by the fuzzer (seed 3), fixed by generic._isolate_nonfinite: an fp16 MultiheadAttention unit where one example's
    inputs (1023, fp16's "huge") overflow the attention logits to inf. The unit's masked backward
    multiplies that example's non-finite forward values by the zeros of every other example's mask
    (0·inf = NaN) and the weight gradients sum over all rows, so *every* example's stored gradient is
    NaN and every example is dropped (factor 0). The presence of the one example then moves the
    release by the others' whole clipped sum: 4.0 × C here (B − 1 examples), where the accountant
    assumes ≤ C. Fused layers form per-example gradients row by row and drop the bad example alone;
    the unit now recomputes each non-finite example with the others' inputs zeroed."""
    fg.check(fb.Case(kind="mha", mode="flat", dtype=torch.float16, clip_fn="clip", bias=False,
                     geometry=dict(heads=1, batch_first=False, need_weights=True, outputs="first"), shape=(1, 1),
                     batch=5, values_x=("normal",) * 4 + ("huge",), values_g=("normal",) * 5, bound=1e-3, gamma=1e-6))


@pytest.mark.parametrize("seed", [1, 2])
def test_kept_release_is_tied_to_the_kept_values_when_the_allowance_is_spent(seed):
    """Found by the fuzzer (seed 52, eighteenth session), a defect of the harness, not of the
    release: for odd case seeds ``stored`` modelled the release with the pass's kept allowance spent
    (recomputed from ``RZ(c g)`` and ``x``) while the layer's own run kept its per-example gradients
    and released ``RZ(c Σ_t g_t x_t)``. With a subnormal upstream gradient (``RZ(c g)`` loses up to
    one subnormal step, 1.4e-45) and an input of ~1e3 (that step times 1e3 per product) the two
    differ by 2e-42 where the tie allows 7.7e-43. Both paths keep the bound (the kept release:
    ``|RZ(c y)| ≤ c|y|``); the release now runs with the allowance the model assumes."""
    case = fb.Case(kind="linear", mode="flat", dtype=torch.float32, clip_fn="normalize", bias=False,
                   geometry={"fin": 5, "fout": 1}, shape=(3, 5), batch=5, layout="contiguous",
                   layout_g="expanded", values_x=("normal", "normal", "normal", "normal", "scaled"),
                   values_g=("subnormal", "normal", "normal", "normal", "normal"), seed=seed,
                   norm_method="auto", conv_norm="l15", bound=0.001, gamma=0.01)
    fb.check(case)


def test_group_norm_statistics_do_not_depend_on_the_batch_layout():
    """Found by the fuzzer (seed 58, twenty-third session): a channels-last input to InstanceNorm3d
    under flat in float64, an upstream gradient constant along the last dimension and huge (2e14), so
    example 1's weight gradient ``Σ g·x̂`` is the last bits of an ``x̂`` that cancels (x̂ ≈ [1, −1]).
    ``native_group_norm`` reduces a channels-last input in another order than a contiguous one, and the
    batch of one left after removing example 0 is contiguous too: example 1's clipped gradient turned
    from +C to −C, so the removal moved the release by 2·C. Every example's statistics are now computed
    from the contiguous input (``layers/norms.py``, ``_group_norm_layout``; GroupNorm shares it)."""
    case = fb.Case(kind="instance_norm3d", mode="flat", dtype=torch.float64, clip_fn="clip", bias=False,
                   geometry={"channels": 2}, shape=(2, 1, 1, 2), batch=2, layout="channels_last",
                   layout_g="broadcast", values_x=("scaled", "scaled"), values_g=("normal", "huge"), seed=131,
                   norm_method="auto", conv_norm="l15", bound=0.001, gamma=1e-06)
    fb.check(case)
