"""Loading the compiled extension, fake (meta) kernels for ``torch.compile``, and thin wrappers.

The schemas live in ``csrc/bpclip_fast.cpp``; this module adds nothing but shape propagation and
argument defaults, so that every op can be traced and checked by ``torch.library.opcheck``.
"""

from __future__ import annotations

import math

import torch

try:
    from . import _C  # noqa: F401  (registers torch.ops.bpclip_fast.*)

    _LOAD_ERROR: Exception | None = None
except ImportError as exc:  # pragma: no cover - exercised only on a broken install
    _LOAD_ERROR = exc


def extension_loaded() -> bool:
    return _LOAD_ERROR is None


def require_extension() -> None:
    if _LOAD_ERROR is not None:
        raise ImportError(
            "bpclip_fast's compiled extension (bpclip_fast._C) could not be loaded: "
            f"{_LOAD_ERROR}. Build it with `make build` (or `pip install --no-build-isolation -e .`)."
        ) from _LOAD_ERROR


# The noise std range of every kernel (csrc/common.h, noise_std_ok, where the floor is proved): 0, or in
# [2^-80, 1e30), so that every nonzero float32 draw times the std is a float32 normal number.
MIN_NOISE_STD = 2.0 ** -80
MAX_NOISE_STD = 1e30
NOISE_STD_RULE = "0 or between 2^-80 = 8.27e-25 (every float32 draw times it a normal number) and 1e30"


def noise_std_ok(std: float) -> bool:
    return std == 0.0 or MIN_NOISE_STD <= std < MAX_NOISE_STD


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


if _LOAD_ERROR is None:

    @torch.library.register_fake("bpclip_fast::clip_rows")
    def _clip_rows_fake(x, nonfinite, bound, norm, clip_fn, gamma):
        b = x.shape[0]
        return (
            torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty((b,), dtype=_acc_dtype(x)),
            x.new_empty((b,), dtype=_acc_dtype(x)),
        )

    @torch.library.register_fake("bpclip_fast::scale_rows")
    def _scale_rows_fake(x, factor):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("bpclip_fast::clip_rows_backward")
    def _clip_rows_backward_fake(grad, clipped, factor, norm, bound, clip_fn):
        return torch.empty_like(grad, memory_format=torch.contiguous_format)

    @torch.library.register_fake("bpclip_fast::philox_noise_")
    def _philox_noise_fake(buf, seed, offset, std, accumulate, scale=1.0):
        return None

    @torch.library.register_fake("bpclip_fast::philox_noise2_")
    def _philox_noise2_fake(w, b, seed, offset, std, accumulate_w, accumulate_b, scale=1.0):
        return None

    @torch.library.register_fake("bpclip_fast::layer_tail_")
    def _layer_tail_fake(w, b, bias_rows, grad, clipped, factor, norm, input_bound, clip_fn, seed, offset, std,
                         scale=1.0):
        return w.new_empty((0,)) if grad is None else torch.empty_like(grad, memory_format=torch.contiguous_format)

    @torch.library.register_fake("bpclip_fast::banded_row_")
    def _banded_row_fake(ring, outs, starts, newest, weights, seed, offset, std):
        return None

    @torch.library.register_fake("bpclip_fast::scale_rows2")
    def _scale_rows2_fake(x, x_factor, y, y_factor, mask_y):
        return (torch.empty_like(x, memory_format=torch.contiguous_format),
                torch.empty_like(y, memory_format=torch.contiguous_format))

    @torch.library.register_fake("bpclip_fast::clip_rows_rescale")
    def _clip_rows_rescale_fake(g, nonfinite, bound, norm, clip_fn, gamma, x, x_factor):
        return (*_clip_rows_fake(g, nonfinite, bound, norm, clip_fn, gamma),
                torch.empty_like(x, memory_format=torch.contiguous_format))

    @torch.library.register_fake("bpclip_fast::linear_forward")
    def _linear_forward_fake(x, weight, bias, nonfinite, input_bound, clip_fn, gamma):
        b = x.shape[0]
        out = x.new_empty((*x.shape[:-1], weight.shape[0]))
        acc = _acc_dtype(x)
        return out, x.new_empty((b,), dtype=acc), x.new_empty((b,), dtype=acc)

    def _conv_out_size(size, k, s, p, d):
        return (size + 2 * p - d * (k - 1) - 1) // s + 1

    @torch.library.register_fake("bpclip_fast::conv2d_forward")
    def _conv2d_forward_fake(x, weight, bias, nonfinite, stride, padding, dilation, groups, input_bound, clip_fn,
                             gamma):
        b = x.shape[0]
        h = _conv_out_size(x.shape[2], weight.shape[2], stride[0], padding[0], dilation[0])
        w = _conv_out_size(x.shape[3], weight.shape[3], stride[1], padding[1], dilation[1])
        acc = _acc_dtype(x)
        return x.new_empty((b, weight.shape[0], h, w)), x.new_empty((b,), dtype=acc), x.new_empty((b,), dtype=acc)

    def _layer_backward_fake(x, weight, output_mask):
        input_grad, has_bias = output_mask
        gx = torch.empty_like(x, memory_format=torch.contiguous_format) if input_grad else x.new_empty((0,))
        gw = torch.empty_like(weight, memory_format=torch.contiguous_format)
        gb = weight.new_empty((weight.shape[0],)) if has_bias else weight.new_empty((0,))
        return gx, gw, gb

    @torch.library.register_fake("bpclip_fast::linear_backward")
    def _linear_backward_fake(grad_out, x, x_factor, x_norm, weight, nonfinite, bounds, clip_fn, gamma, output_mask,
                              noise_key, noise_std, scale=1.0):
        return _layer_backward_fake(x, weight, output_mask)

    @torch.library.register_fake("bpclip_fast::conv2d_backward")
    def _conv2d_backward_fake(grad_out, x, x_factor, x_norm, weight, nonfinite, stride, padding, dilation, groups,
                              grad_norm, bounds, clip_fn, gamma, output_mask, noise_key, noise_std, scale=1.0):
        return _layer_backward_fake(x, weight, output_mask)


    def _norms_fake(grad_out, x, T, d, p, groups, params, method, keep, keep_extra):
        """Mirrors csrc/exact.cpp (parse_method, keep_instantiated); opcheck compares the two."""
        b = x.shape[0]
        ghost = T == 1 or T * (d + p) < d * p
        inst = method == "instantiate" or (method == "auto" and not ghost)
        acc_size = _acc_dtype(x).itemsize
        kept = (keep and inst and params[0] and T > 1 and b > 0
                and (acc_size * groups * p * d <= grad_out.element_size() * (grad_out.numel() // b)
                     or b * groups * p * (d + (1 if params[1] else 0)) * acc_size <= keep_extra))
        sq = x.new_empty((b,), dtype=torch.float64)
        kw = x.new_empty((b, groups * p * d), dtype=_acc_dtype(x)) if kept else x.new_empty((0,))
        kb = x.new_empty((b, groups * p), dtype=_acc_dtype(x)) if kept and params[1] else x.new_empty((0,))
        return sq, torch.empty_like(sq), kw, kb

    @torch.library.register_fake("bpclip_fast::linear_grad_norms")
    def _linear_grad_norms_fake(grad_out, x, params, method, workspace, keep, nonfinite=None, keep_extra=0):
        b, d, p = x.shape[0], x.shape[-1], grad_out.shape[-1]
        T = x.numel() // (b * d) if b and d else 1
        return _norms_fake(grad_out, x, T, d, p, 1, params, method, keep, keep_extra)

    @torch.library.register_fake("bpclip_fast::conv2d_grad_norms")
    def _conv2d_grad_norms_fake(grad_out, x, kernel_size, stride, padding, dilation, groups, params, method,
                                workspace, keep, nonfinite=None, keep_extra=0):
        d = x.shape[1] // groups * kernel_size[0] * kernel_size[1]
        return _norms_fake(grad_out, x, grad_out.shape[2] * grad_out.shape[3], d, grad_out.shape[1] // groups,
                           groups, params, method, keep, keep_extra)

    @torch.library.register_fake("bpclip_fast::conv_patches")
    def _conv_patches_fake(x, kernel_size, stride, padding, dilation):
        ho = _conv_out_size(x.shape[2], kernel_size[0], stride[0], padding[0], dilation[0])
        wo = _conv_out_size(x.shape[3], kernel_size[1], stride[1], padding[1], dilation[1])
        return x.new_empty((x.shape[0], x.shape[1] * kernel_size[0] * kernel_size[1], ho * wo), dtype=_acc_dtype(x))

    @torch.library.register_fake("bpclip_fast::exact_bound_")
    def _exact_bound_fake(sq, bound, x, g, gb, wa, wb, offset, per, flags, consts, nonfinite=None):
        return None

    @torch.library.register_fake("bpclip_fast::exact_factors")
    def _exact_factors_fake(bounds, nonfinite, max_norm, clip_fn, gamma, fp64):
        b = bounds[0]
        return b.new_empty(b.shape, dtype=torch.float64 if fp64 else torch.float32), torch.empty_like(b)

    def _clipped_grads_fake(weight, params):
        acc = _acc_dtype(weight)  # the noised sum before its one rounding to the weight's dtype (csrc/exact.cpp)
        gw = weight.new_empty(weight.shape, dtype=acc) if params[0] else weight.new_empty((0,), dtype=acc)
        gb = weight.new_empty((weight.shape[0],), dtype=acc) if params[1] else weight.new_empty((0,), dtype=acc)
        return gw, gb

    @torch.library.register_fake("bpclip_fast::linear_clipped_grads")
    def _linear_clipped_grads_fake(grad_out, x, factor, weight, params, noise_key, noise_std, kept_w=None,
                                   kept_b=None, scale=1.0):
        return _clipped_grads_fake(weight, params)

    @torch.library.register_fake("bpclip_fast::conv2d_clipped_grads")
    def _conv2d_clipped_grads_fake(grad_out, x, factor, weight, stride, padding, dilation, groups, params, noise_key,
                                   noise_std, kept_w=None, kept_b=None, scale=1.0):
        return _clipped_grads_fake(weight, params)


    @torch.library.register_fake("bpclip_fast::word_checksum")
    def _word_checksum_fake(words):
        return words.new_empty((), dtype=torch.int64)

    @torch.library.register_fake("bpclip_fast::discrete_gaussian_")
    def _discrete_gaussian_fake(out, seed, offset, sigma):
        return None

    @torch.library.register_fake("bpclip_fast::integer_release_")
    def _integer_release_fake(buf, seed, offset, first, multiplier, grid_exp, sigma, scale):
        return None

    def _layer_norm_row_size(x, mean):
        """Mirrors layer_norm_row_size in csrc/common.h."""
        if mean.numel() > 0:
            return x.numel() // mean.numel()
        axis = mean.dim()
        while axis > 0 and mean.shape[axis - 1] == 1:
            axis -= 1
        d = 1
        for size in x.shape[axis:]:
            d *= size
        return d

    @torch.library.register_fake("bpclip_fast::norm_affine_example_grads")
    def _norm_affine_example_grads_fake(grad_out, x, mean, rstd, batch, groups, layer_norm):
        d = _layer_norm_row_size(x, mean) if layer_norm else x.shape[1]
        gw = x.new_empty((batch, d), dtype=_acc_dtype(x))
        return gw, torch.empty_like(gw)

    @torch.library.register_fake("bpclip_fast::examples_bound")
    def _examples_bound_fake(weight, bias, nonfinite=None):
        like = weight if weight is not None else bias
        return like.new_empty((like.shape[0],), dtype=torch.float64)

    @torch.library.register_fake("bpclip_fast::examples_factors")
    def _examples_factors_fake(weight, bias, nonfinite, max_norm, clip_fn, gamma, fp64):
        like = weight if weight is not None else bias
        b = like.shape[0]
        return (like.new_empty((b,), dtype=torch.float64 if fp64 else torch.float32),
                like.new_empty((b,), dtype=torch.float64))

    @torch.library.register_fake("bpclip_fast::examples_release")
    def _examples_release_fake(weight, bias, factor, noise_key, noise_std, scale):
        like = weight if weight is not None else bias
        return tuple(t.new_empty(t.shape[1:]) if t is not None else like.new_empty((0,)) for t in (weight, bias))


def build_config() -> dict:
    """What the extension was compiled with, as reported by the library itself."""
    require_extension()
    fields = dict(kv.split("=", 1) for kv in torch.ops.bpclip_fast._build_config().split(";"))
    archs = [a for a in fields.get("archs", "").split(",") if a]
    return {"cuda_compiled": fields.get("cuda") == "1", "cuda_archs": archs}


def cpu_cache(limit: int | None = None, poison: bool = False) -> dict:
    """The CPU storages the library's ops keep for reuse (csrc/host_cache.h): the released
    gradients, the kept per-example gradients and the patches of at least 1 MB, which glibc would
    otherwise return to the kernel at free and fault back in, zeroed, every step. A storage is reused
    only while nothing but the cache references it; one Python code has seen as a storage
    (``untyped_storage()``, ``torch.save``, ``copy.deepcopy``, pickling, ``share_memory_``) leaves the
    cache and is freed by its last user, as at::empty's would be. ``limit`` (bytes, default 1 GiB) caps what it
    holds, in use or idle; ``limit=0`` frees the idle ones and stops caching. ``poison`` (for the
    tests) fills the idle storages with 0xFF bytes, NaN in every float dtype. Returns the limit, the
    bytes held, the idle bytes among them and the number of storages."""
    require_extension()
    if limit is not None and int(limit) < 0:
        raise ValueError(f"bpclip_fast.cpu_cache: limit must be >= 0 bytes (0 stops caching), got {limit}")
    lim, held, idle, count = torch.ops.bpclip_fast._host_cache(-1 if limit is None else int(limit), bool(poison))
    return {"limit": lim, "held_bytes": held, "idle_bytes": idle, "storages": count}


def clip_rows(x, nonfinite, bound, norm="l2", clip_fn="clip", gamma=0.01):
    """Per-example clipping: returns (clipped, factor, norm)."""
    return torch.ops.bpclip_fast.clip_rows(x, nonfinite, float(bound), norm, clip_fn, float(gamma))


def scale_rows(x, factor):
    """``RZ(factor[b]·x[b])`` per example, rounded toward zero to x's dtype (zeros where the factor is
    0): exactly what ``clip_rows`` wrote for that factor."""
    return torch.ops.bpclip_fast.scale_rows(x, factor)


def clip_rows_backward(grad, clipped, factor, norm, bound, clip_fn="clip"):
    """Vector-Jacobian product of the L2 input clipping, from what the forward saved."""
    return torch.ops.bpclip_fast.clip_rows_backward(grad, clipped, factor, norm, float(bound), clip_fn)


def philox_noise_(buf, seed, offset, std, accumulate=False, scale=1.0):
    """``buf = std*z`` (or ``buf += std*z``) with z ~ N(0, 1) from Philox4x32-10 keyed by (seed, offset),
    then ``buf *= scale`` in the same pass where ``scale != 1`` (bit for bit a later ``buf.mul_(scale)``)."""
    torch.ops.bpclip_fast.philox_noise_(buf, int(seed), int(offset), float(std), bool(accumulate), float(scale))
    return buf


def discrete_gaussian_(out, seed, offset, sigma):
    """``out[i]`` = a draw of the discrete Gaussian ``N_Z(0, sigma^2)`` (``P(y)`` proportional to
    ``exp(-y^2 / (2 sigma^2))`` on the integers) for contiguous position ``i``, exact but for an event
    of probability below 2^-129 per element (``csrc/include/bpclip_fast/discrete_gaussian.h``).
    ``out``: int64; ``sigma``: an integer in [0, 2^52], 0 drawing zeros; the same bits on every
    backend."""
    if isinstance(sigma, bool) or int(sigma) != sigma:
        raise TypeError(f"bpclip_fast.discrete_gaussian_: sigma must be an integer, got {sigma!r}")
    torch.ops.bpclip_fast.discrete_gaussian_(out, int(seed), int(offset), int(sigma))
    return out


def integer_release_(buf, seed, offset, first, multiplier, grid_exp, sigma, scale=1.0):
    """The integer release of a buffer of clipped sums, in place (``csrc/include/bpclip_fast/
    integer_release.h``): ``buf[i] = ((k + Y) * 2**grid_exp) * scale`` rounded to buf's dtype, where
    ``k`` is ``buf[i] * multiplier`` on the grid ``2**grid_exp`` randomly rounded with a word that does
    not depend on the data, and ``Y`` is the discrete Gaussian draw of element ``first + i`` at
    ``(seed, offset, sigma)`` (:func:`discrete_gaussian_`'s element ``first + i``). ``buf``: float32
    or float64 (positions row-major); ``sigma``: an integer in [0, 2^52]."""
    for name, value in (("first", first), ("grid_exp", grid_exp), ("sigma", sigma)):
        if isinstance(value, bool) or int(value) != value:
            raise TypeError(f"bpclip_fast.integer_release_: {name} must be an integer, got {value!r}")
    torch.ops.bpclip_fast.integer_release_(buf, int(seed), int(offset), int(first), float(multiplier), int(grid_exp),
                                           int(sigma), float(scale))
    return buf


def philox_noise2_(w, b, seed, offset, std, accumulate_w=False, accumulate_b=False, scale=1.0):
    """A layer's two noise draws in one launch: ``w`` as ``philox_noise_(w, seed, offset, ...)`` and ``b``
    as ``philox_noise_(b, seed, offset + 1, ...)``, bit for bit (w and b share a device and dtype, and
    no memory: see :func:`_spans_cross`)."""
    if _spans_cross(w, b):
        raise ValueError("bpclip_fast.philox_noise2_: w and b overlap in memory (views of one buffer whose "
                         "spans cross); one launch draws both, so a shared element would be raced on or "
                         "overwritten by the other's copy-back; pass separate buffers, or call philox_noise_ "
                         "on each")
    torch.ops.bpclip_fast.philox_noise2_(w, b, int(seed), int(offset), float(std), bool(accumulate_w),
                                         bool(accumulate_b), float(scale))
    return w, b


def _storage_start(t) -> int:
    """The address of ``t``'s storage without ``t.untyped_storage()``: a storage's Python object holds
    it for as long as anything else does, so a released gradient from the CPU cache that banded noise
    checks every step would never be reused (csrc/cpu/host_cache.cpp)."""
    return t.data_ptr() - t.storage_offset() * t.element_size()


def _spans_cross(a, b) -> bool:
    """Whether two non-empty tensors' spans of memory (first to last byte they can reach) intersect.
    philox_noise2_'s CUDA kernel takes both buffers ``__restrict__`` in one launch and copies a
    non-contiguous one before it and back after it, so buffers that share an element would not get
    the two calls' values there. Spans, not elements: interleaved views are refused too (cheap, and
    a layer's weight and bias gradients are always separate buffers)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device or a.is_meta or b.is_meta:
        return False
    if _storage_start(a) != _storage_start(b):
        return False

    def span(t):
        lo = t.data_ptr()
        return lo, lo + t.element_size() * (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())))

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


#: banded_row_'s limits (csrc/include/bpclip_fast/band.h): ring slots (bands − 1) and outs per call
BAND_MAX_SLOTS = 63
BAND_MAX_OUTS = 4


def banded_row_outs_problem(ring_like, numel, outs, starts):
    """Why ``outs`` (with their flat ``starts``) cannot take a row of ``numel`` elements in the dtype and
    on the device of ``ring_like`` in :func:`banded_row_`'s one pass, or ``None``. The caller that gets a
    reason makes the row without outs and adds it itself."""
    if len(outs) != len(starts):
        return f"starts needs one entry per out ({len(outs)}), got {len(starts)}"
    if len(outs) > BAND_MAX_OUTS:
        return f"at most {BAND_MAX_OUTS} outs per call, got {len(outs)}"
    spans = []
    for k, (o, s) in enumerate(zip(outs, starts)):
        if not isinstance(o, torch.Tensor):
            return f"out {k} is a {type(o).__name__}, not a tensor"
        if o.dtype != ring_like.dtype or o.device != ring_like.device:
            return f"out {k} is {o.dtype} on {o.device}; the ring is {ring_like.dtype} on {ring_like.device}"
        if not o.is_contiguous():
            return f"out {k} is not contiguous (its elements would not be the row's consecutive ones)"
        s, n = int(s), o.numel()
        if s < 0 or s + n > numel:
            return f"out {k} covers elements [{s}, {s + n}) outside the row's [0, {numel})"
        for j, (q, sq, nq) in enumerate(spans):
            if n and nq and s < sq + nq and sq < s + n:
                return f"outs {j} and {k} cover the same elements of the row"
            if _spans_cross(q, o):
                return f"outs {j} and {k} share memory"
        spans.append((o, s, n))
    return None


def banded_row_(ring, outs, starts, newest, weights, seed, offset, std):
    """One row of the banded mechanism's correlated noise (:mod:`bpclip_fast.banded`) in one pass:
    with ``z`` the stream of ``philox_noise_(flat buffer of P, seed, offset, 1.0)``,

        ``w_i = std·z_i + Σ_{a=1..b−1} weights[a−1]·ring[(newest − a + 1) mod (b−1), i]``

    in the ring's dtype (fp32 or fp64), stored into the oldest slot ``(newest + 1) mod (b−1)`` (read
    before it is overwritten) and added to ``outs[k]`` where ``starts[k] ≤ i < starts[k] + outs[k].numel()``.
    ``ring``: contiguous float32/float64 ``[b−1, P]``; ``weights``: ``b−1`` floats (``−c_a/c_0``);
    ``outs``: contiguous, the ring's dtype and device, at most :data:`BAND_MAX_OUTS`, disjoint from
    the ring and from each other. The caller advances its newest slot. Returns the slot written."""
    op = "bpclip_fast.banded_row_"
    if not isinstance(ring, torch.Tensor) or ring.dim() != 2 or ring.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{op}: ring must be a float32 or float64 [bands − 1, P] tensor, got "
                         f"{getattr(ring, 'dtype', type(ring).__name__)} {tuple(getattr(ring, 'shape', ()))}")
    if not ring.is_contiguous():
        raise ValueError(f"{op}: ring must be contiguous (its rows are the flat noise rows)")
    slots, numel = ring.shape
    if not 1 <= slots <= BAND_MAX_SLOTS:
        raise ValueError(f"{op}: ring needs 1 to {BAND_MAX_SLOTS} slots (bands 2 to {BAND_MAX_SLOTS + 1}), got {slots}")
    newest = int(newest)
    if not 0 <= newest < slots:
        raise ValueError(f"{op}: newest must be a ring slot in [0, {slots}), got {newest}")
    weights = [float(v) for v in weights]
    if len(weights) != slots:
        raise ValueError(f"{op}: weights needs one entry per ring slot ({slots}: −c_a/c_0 for a = 1..{slots}), "
                         f"got {len(weights)}")
    if not all(math.isfinite(v) for v in weights):
        raise ValueError(f"{op}: weights must be finite, got {weights}")
    std = float(std)
    if not noise_std_ok(std):  # the kernels' rule (csrc/common.h, noise_std_ok)
        raise ValueError(f"{op}: std must be {NOISE_STD_RULE}, got {std}")
    outs, starts = list(outs), [int(s) for s in starts]
    why = banded_row_outs_problem(ring, numel, outs, starts)
    if why is None:
        why = next((f"out {k} shares memory with the ring" for k, o in enumerate(outs) if _spans_cross(o, ring)), None)
    if why is not None:
        raise ValueError(f"{op}: {why}; pass contiguous, separate outs of the ring's dtype, or make the row "
                         "without outs and add the returned slot yourself")
    torch.ops.bpclip_fast.banded_row_(ring, outs, starts, newest, weights, int(seed), int(offset), std)
    return ring[(newest + 1) % slots]


def scale_rows2(x, x_factor, y, y_factor, mask_y=False):
    """``(scale_rows(x, x_factor), scale_rows(y, y_factor))`` in one launch; with ``mask_y`` the second is
    ``y`` where ``y_factor > 0`` and zeros elsewhere (``scale_rows(y, sign(y_factor))``)."""
    return torch.ops.bpclip_fast.scale_rows2(x, x_factor, y, y_factor, bool(mask_y))


def clip_rows_rescale(g, nonfinite, bound, norm, clip_fn, gamma, x, x_factor):
    """``(*clip_rows(g, ...), scale_rows(x, x_factor))`` with one elementwise pass for both."""
    return torch.ops.bpclip_fast.clip_rows_rescale(g, nonfinite, float(bound), norm, clip_fn, float(gamma), x,
                                                   x_factor)


def norm_affine_example_grads(grad_out, x, mean, rstd, batch, groups=1, layer_norm=True):
    """Per-example gradients ``(gw, gb)`` of a LayerNorm (``layer_norm=True``; ``groups`` unused) or
    GroupNorm affine weight and bias, from the statistics of ``torch.ops.aten.native_layer_norm`` /
    ``native_group_norm``: ``[batch, D]`` (or ``[batch, C]``), float32 (float64 for float64 data)."""
    return torch.ops.bpclip_fast.norm_affine_example_grads(grad_out, x, mean, rstd, int(batch), int(groups),
                                                           bool(layer_norm))


def _need_values(weight, bias, op):
    # (the C++ check is unreachable here: with no tensor argument the dispatcher finds no kernel)
    if weight is None and bias is None:
        raise ValueError(f"bpclip_fast.{op}: needs the weight's or the bias's per-example values (both are None)")


def examples_bound(weight, bias=None, nonfinite=None):
    """Float64 ``[B]`` upper bounds on the norms of per-example values ``weight``/``bias`` ``[B, *]``
    (either may be ``None``) taken together; ``nonfinite`` (int64 ``[1]``) += the non-finite ones."""
    _need_values(weight, bias, "examples_bound")
    return torch.ops.bpclip_fast.examples_bound(weight, bias, nonfinite)


def examples_factors(weight, bias, nonfinite, max_norm, clip_fn="clip", gamma=0.0, fp64=False):
    """``(factor, bound)``: :func:`examples_bound` of ``weight``/``bias`` and
    ``exact_factors([bound], nonfinite, max_norm, clip_fn, gamma, fp64)``'s factor, in one kernel."""
    _need_values(weight, bias, "examples_factors")
    return torch.ops.bpclip_fast.examples_factors(weight, bias, nonfinite, float(max_norm), clip_fn, float(gamma),
                                                  bool(fp64))


def examples_release(weight, bias, factor, seed=0, offset=0, std=0.0, scale=1.0):
    """``(Σ_b RZ(factor[b]·weight[b]) + noise)·scale`` and the same for ``bias`` (noise counters
    ``offset`` and ``offset + 1``), in the values' dtype; an empty tensor where one is ``None``."""
    _need_values(weight, bias, "examples_release")
    return torch.ops.bpclip_fast.examples_release(weight, bias, factor, [int(seed), int(offset)], float(std),
                                                  float(scale))
