"""What every process of a multi-process (DistributedDataParallel) run must agree on.

The engine's analysis of a DDP run (:mod:`bpclip_fast.engine`, "Multi-process training") is of
*one* global batch: every rank holds the same dataset of ``N`` examples, batch ``t``'s coins (or
permutation) are the same on every rank, and rank ``r`` trains on the members with index ``≡ r
(mod W)``; rank 0's layers draw the one noise of std ``σΔ`` and every rank steps the same accountant
with ``(σ, q = W·batch_size/N)``. Nothing in that holds per rank. If ranks pass different things,
each derives its own ``q`` and its own Δ-bounds, and (``make_private_with_epsilon``) its own ``σ``,
while only rank 0's ``σ`` is drawn and only one accountant is reported. Shards of 1000 and 500
examples, for instance: the shorter shard's examples are sampled at twice the rate rank 0 accounts,
under rank 0's ``σ`` (``make_private_with_epsilon(2.0)`` reports ε = 1.99; they get 3.87); a rank
with ``loss_reduction="sum"`` beside ``"mean"`` multiplies its examples by ``batch_size`` against the
noise. So ``make_private`` compares, in one collective, everything the accountant and the noise
depend on (:func:`check`), and refuses on every rank, naming each argument that differs and each
rank's value. Values are compared after normalisation (``1`` equals ``1.0``), as SHA-256 digests, so
a list (per_layer bounds) or a dataclass (``Adaptive``) costs one slot.

Equal lengths do not make equal datasets. Shards of equal length are sampled at the accounted rate,
but the engine cannot tell disjoint shards from a per-rank permutation of one dataset or
overlapping shards: an example at index 0 on rank 0 and index 3 on rank 1 is trained by both, with
independent coins: twice the rate, and twice the contribution in one batch with probability
``q²``. (Disjoint shards would also be half unused: each rank trains only its residue class.)
So :func:`check` also compares a fingerprint of ``K`` items at fixed indices spread over the
dataset, and refuses when they differ between the ranks.

A false refusal of the same dataset with random augmentation must not happen, so the fingerprint
is compared only where every rank read every one of its ``K`` items ``READS`` times with identical
bytes; any non-reproducible read anywhere skips the comparison on every rank. A refusal then needs
an augmentation whose outcome repeated ``READS`` times on each of ``2K`` item reads and still
differed between ranks. For continuous augmentation (noise, crops, jitter whenever applied) that
has probability 0. The worst case is a transform with two outcomes, the rarer with probability
``p``: for ``W = 2`` the chance is ``c^{2K}·(1 − (1 − d)^K)``, with ``c = (1−p)^R + p^R`` and ``d =
2(1−p)^R p^R / c²``. Its maximum over ``p`` is 5·10⁻⁶ (at ``p ≈ 1/16``) for ``K = 8, R = 4``, and
smaller for larger ``W``. Items holding anything but tensors, numpy arrays, numbers, strings,
bytes, ``None`` and lists, tuples or dicts of them skip the comparison too, and so does an item
whose read raises: there is nothing exact to compare. A dataset that is the same on every rank
reads the same bytes on every rank (tensors are read on the CPU), so it is never refused. The
remaining false refusal is per-rank randomness fixed once, such as an unseeded
``TensorDataset(torch.randn(...))`` built in each process. Those are different datasets, and the
message says to seed them alike.
"""

from __future__ import annotations

import dataclasses
import hashlib
import numbers

import torch

K = 8  # items fingerprinted
READS = 4  # reads of each, all identical, or the comparison is skipped everywhere

REMEDY = ("Pass the same full dataset on every rank, with the same per-process batch_size and the same privacy "
          "arguments: the engine takes each rank's share of one global batch (rank r: the members with index "
          "≡ r mod world size), so do not shard the dataset yourself (no Subset per rank, no DistributedSampler "
          "indices); any randomness fixed when the dataset is built must be seeded alike on every rank")


def _normal(value):
    """A canonical form: equal settings give equal forms (``1`` and ``1.0``; a list and a tuple)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        f = float(value)
        return int(f) if f.is_integer() and abs(f) < 2 ** 53 else f
    if isinstance(value, (list, tuple)):
        return tuple(_normal(v) for v in value)
    if isinstance(value, dict):
        return tuple((_normal(k), _normal(v)) for k, v in sorted(value.items(), key=lambda kv: repr(kv[0])))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__,) + tuple((f.name, _normal(getattr(value, f.name)))
                                                for f in dataclasses.fields(value))
    return repr(value)


def _digest(data: bytes) -> float:
    """52 bits of SHA-256 as a float64 (exact: every such integer is representable)."""
    return float(int.from_bytes(hashlib.sha256(data).digest()[:7], "little") >> 4)


def _feed(h, obj) -> bool:
    """Feeds ``obj``'s exact content to ``h``; ``False`` if it holds something with no exact bytes."""
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided:
            return False
        t = obj.detach().to("cpu").contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return True
    if type(obj).__module__ == "numpy" and hasattr(obj, "dtype") and hasattr(obj, "tobytes"):
        if obj.dtype.kind == "O":  # object arrays' bytes are pointers
            return False
        h.update(f"A{obj.dtype.str}{getattr(obj, 'shape', ())}".encode())
        h.update(obj.tobytes())
        return True
    if obj is None or isinstance(obj, (bool, numbers.Number, str, bytes)):
        h.update(f"V{type(obj).__name__}:{obj!r}".encode())
        return True
    if isinstance(obj, (list, tuple)):
        h.update(f"L{len(obj)}".encode())
        return all(_feed(h, o) for o in obj)
    if isinstance(obj, dict):
        h.update(f"D{len(obj)}".encode())
        return all(_feed(h, k) and _feed(h, v) for k, v in obj.items())
    return False


def _item_print(dataset, i: int) -> float:
    """The digest of item ``i`` if ``READS`` reads give identical bytes, else -1 (not comparable)."""
    prints = set()
    for _ in range(READS):
        h = hashlib.sha256()
        try:
            if not _feed(h, dataset[i]):
                return -1.0
        except Exception:  # noqa: BLE001 - an unreadable item has nothing to compare; the probe reports reads
            return -1.0
        prints.add(h.digest())
    return _digest(prints.pop()) if len(prints) == 1 else -1.0


def fingerprint(dataset, n: int) -> list[float]:
    """``K`` slots: the digests of the items at ``K`` fixed indices spread over ``[0, n)`` (-2 for no
    item where ``n < K``), or all -1 if any of them is not reproducible."""
    indices = sorted({round(j * (n - 1) / (K - 1)) for j in range(K)}) if n > 0 else []
    prints = [_item_print(dataset, i) for i in indices]
    if any(p < 0 for p in prints):
        prints = [-1.0] * len(prints)
    return prints + [-2.0] * (K - len(prints))


FIELDS = ("len(data_loader.dataset)", "data_loader.batch_size", "sample rate", "poisson_sampling",
          "noise_multiplier", "clipping", "input_clip", "grad_clip", "conv_norm", "max_grad_norm", "norm_method",
          "clip_fn", "gamma", "loss_reduction", "nonfinite", "max_input_shape", "adaptive", "accountant",
          "max_epsilon", "delta", "clipped layers built by hand", "private PCA projections")

# What a clipped layer the user built keeps through make_private (convert_model leaves it as it is):
# its bounds, and so its Δ. Only rank 0's layers draw noise, scaled to rank 0's Δ, so a rank whose
# own layer clips to a larger bound (an edited constant, a per-rank config) is under-noised.
_LAYER_SETTINGS = ("clipping", "input_clip", "grad_clip", "max_grad_norm", "clip_fn", "gamma", "norm_method")


def built_layers(model) -> list:
    """``[(name, type, settings)]`` of the clipped layers already in ``model`` (the engine's field
    "clipped layers built by hand"). The configuration is read under its ``_bp_`` names
    (:data:`bpclip_fast.layers.base.CONFIG`): a generic unit's public names are the user's."""
    from .layers.base import _Clipped, _Public

    return [(name, type(m).__name__, tuple((a, getattr(m, "_bp_" + a)) for a in _LAYER_SETTINGS)
             + (("norm", getattr(m, "norm", None) if isinstance(m, _Public) else None),
                ("max_input_shape", m.max_input_shape)))
            for name, m in model.named_modules() if isinstance(m, _Clipped)]


_SLOTS = 1 + len(FIELDS) + K  # [a rank failed before the check] + the fields' digests + the item prints


def _gather(mine: list[float], device) -> list[list[float]]:
    import torch.distributed as dist

    local = torch.tensor(mine, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return [g.cpu().tolist() for g in gathered]


def _gather_texts(mine):
    import torch.distributed as dist

    texts = [None] * dist.get_world_size()
    dist.all_gather_object(texts, mine)
    return texts


class failures_joined:
    """``with failures_joined(what, device_fn):`` around the per-rank checks that precede :func:`check`.

    A rank that raises there (its own shard too short for ``batch_size·W``, its own ε calibration
    failing) would leave the others waiting in :func:`check`'s collective until the process group's
    timeout. Instead it joins that collective with a failure flag, and every rank refuses, naming
    the rank and its error; the failing rank re-raises its own. The block must end before
    :func:`check` is reached on the rank that runs it (no collective in between)."""

    def __init__(self, distributed: bool, what: str, device_fn):
        self.distributed, self.what, self.device_fn = distributed, what, device_fn

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is None or not self.distributed or not isinstance(exc, Exception):
            return False
        _gather([1.0] + [0.0] * (_SLOTS - 1), self.device_fn())
        _gather_texts(f"{type(exc).__name__}: {exc}")
        return False  # the rank's own exception propagates


def check(fields: dict, dataset, n: int, device, what: str = "make_private") -> None:
    """Refuses (``ValueError``, on every rank) unless every rank passed equal ``fields`` (``{name in
    FIELDS: value}``) and, where comparable, the same items of ``dataset`` (of length ``n``), and no
    rank failed in its :class:`failures_joined` block.

    One ``all_gather`` of ``_SLOTS`` float64; only on a refusal, a second one of texts for the
    message. Every rank sees the same gathered values, so every rank takes the same branch and no
    collective is left unmatched.
    """
    if tuple(fields) != FIELDS:
        raise AssertionError(f"bpclip_fast.ranks.check: fields {tuple(fields)} are not {FIELDS}")
    normal = {name: _normal(v) for name, v in fields.items()}
    rows = _gather([0.0] + [_digest(repr(v).encode()) for v in normal.values()] + fingerprint(dataset, int(n)),
                   device)
    failed = [r for r, row in enumerate(rows) if row[0] != 0.0]
    if failed:
        texts = _gather_texts(None)
        raise ValueError(f"{what}: " + "; ".join(f"rank {r} refused ({texts[r]})" for r in failed)
                         + ". Every rank refuses with it: the ranks of a distributed run set up one private "
                         "training together. " + REMEDY)
    rows = [row[1:] for row in rows]
    names = list(normal)
    differ = [j for j in range(len(names)) if any(row[j] != rows[0][j] for row in rows)]
    prints = [row[len(names):] for row in rows]
    comparable = all(p != -1.0 for row in prints for p in row)  # -1: some rank's reads were not reproducible
    items_differ = not differ and comparable and any(row != prints[0] for row in prints)
    if not differ and not items_differ:
        return
    texts = _gather_texts([repr(normal[names[j]]) for j in differ])
    world = len(rows)
    problems = [f"{names[j]} is " + ", ".join(f"rank {r}: {texts[r][k]}" for r in range(world))
                for k, j in enumerate(differ)]
    if items_differ:
        problems.append(f"the dataset's items at the same indices differ between the ranks (each rank read each of "
                        f"the {K} compared items {READS} times, with identical bytes): every rank seems to hold "
                        "its own shard, or its own order of the data")
    raise ValueError(f"{what}: the processes of this distributed run disagree on what the accountant and the noise "
                     "depend on (one global batch, one noise draw on rank 0, one accountant on every rank): "
                     + "; ".join(problems) + ". " + REMEDY)
