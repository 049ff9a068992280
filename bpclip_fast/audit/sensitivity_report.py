"""The sensitivity audit's report: what :func:`.contribution.sensitivity` returns — a row per checked unit
(:class:`SensitivityRow`) and per layer's noise (:class:`NoiseRow`) — with its verdict (``.ok``), its one line and its
JSON form.

Apart from the audit because it is a record, read by the CLI and by users without measuring anything: it changes
when the report does, not when the measurement does. What each field means: :mod:`.contribution`'s docstring, which
"module docstring" below refers to.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

__all__ = ["SensitivityReport", "SensitivityRow", "NoiseRow"]


@dataclass
class SensitivityRow:
    """One checked unit (a layer, or all layers together), in units of its bound."""

    name: str
    bound: float            # the declared bound the noise is scaled to (Δ_l, C_l or C)
    symbol: str             # "Δ", "C_l" or "C"
    largest: float          # the largest contribution norm over the batch (removal, float64)
    ratio: float            # largest / bound
    examples: list          # batch indices attaining the largest (within tol)
    saturated: int          # examples whose contribution is at the bound (within tol)
    status: str             # "ok", "exceeded", "info" (not checked: flat's per-layer rows), "frozen"
    adversarial: float | None = None  # the best ratio the adversarial search found
    adversarial_from: str | None = None
    alone: float | None = None        # the largest ratio of one example released alone, in the model's dtype
    alone_examples: list = field(default_factory=list)
    failed: list = field(default_factory=list)  # the checks that exceeded: "removal", "alone", "adversarial"

    @property
    def checked(self) -> bool:
        return self.status in ("ok", "exceeded")


@dataclass
class NoiseRow:
    """The noise one clipped layer draws, in bound units (module docstring: noise)."""

    name: str
    sigma: float            # the σ the layer draws with (the private layer's noise_multiplier)
    claimed_sigma: float    # the σ claimed (the engine's gradient_noise_multiplier; without one, sigma)
    bound: float            # Δ_l the noise is claimed to be scaled to
    std: float | None       # measured std of the noise, in bound units
    ratio: float | None     # std / (claimed_sigma · bound)
    low: float | None       # the ratio's confidence interval
    high: float | None
    coordinates: int        # noise coordinates measured (parameters × draws)
    parts: dict             # {"weight"/"bias": [ratio, low, high]}
    status: str             # "ok", "under", "over" (a note), "σ = 0", "frozen", "not measured"


@dataclass
class SensitivityReport:
    """What :func:`sensitivity` found; ``.ok``, ``.line()``, ``.to_dict()``. Holds data-dependent
    values: not covered by the privacy guarantee (module docstring)."""

    mode: str
    examples: int
    loss_reduction: str
    mean_batch_size: float | None
    dtype: str                # of the removal copy
    tol: float
    rounding: float           # the largest observed rounding of a release, in bound units
    native_dtype: str         # of the alone check and the noise measurement (the model's own)
    native_tol: float
    training: str             # how the copies ran: "train", "train, dropout off" or "eval"
    rows: list
    noise: list               # NoiseRow per clipped layer
    noise_draws: int
    noise_structure: dict | None  # the draws' shape and correlation tests (audit.noise.NoiseCheck)
    adversarial: dict
    notes: list
    seconds: float
    contributions: dict = field(default=None, repr=False)  # keep_contributions: {unit: [B, P] tensor}

    @property
    def under_noised(self) -> list:
        return [r for r in self.noise if r.status == "under"]

    @property
    def malformed_noise(self) -> list:
        """The structure tests the noise failed: correlated draws, or a shape other than Gaussian."""
        st = self.noise_structure or {}
        return list(st.get("correlated", [])) + (["not Gaussian"] if st.get("not_gaussian") else [])

    @property
    def ok(self) -> bool:
        return all(r.status != "exceeded" for r in self.rows) and not self.under_noised and not self.malformed_noise

    def line(self) -> str:
        head = f"sensitivity: {self.mode}, {self.examples} examples"
        checked = [r for r in self.rows if r.checked]
        if not checked:
            return f"{head}, no trainable clipped layer; OK"
        top = max(checked, key=lambda r: r.ratio)
        where = "" if top.name == "flat" else "total, " if top.name == "total" else f"layer {top.name}, "
        at = ", ".join(map(str, top.examples[:3])) + (", ..." if len(top.examples) > 3 else "")
        native = self.native_dtype.replace("torch.", "")
        text = (f"{head}, largest contribution {top.ratio:.5f} of {top.symbol}={top.bound:.4g} "
                f"({where}example{'s' if len(top.examples) > 1 else ''} {at}), "
                f"alone in {native} {max(r.alone for r in checked):.5f}")
        if "skipped" in self.adversarial:
            text += f", adversarial skipped ({self.adversarial['skipped']})"
        elif self.adversarial:
            text += f", adversarial {self.adversarial['best']:.4f}"
        measured = [r for r in self.noise if r.ratio is not None]
        if measured:
            lo, hi = min(r.ratio for r in measured), max(r.ratio for r in measured)
            text += f", noise {lo:.3f}" + (f"-{hi:.3f}" if f"{hi:.3f}" != f"{lo:.3f}" else "") + " of σΔ"
        elif any(r.status == "not measured" for r in self.noise):
            text += ", noise not measured"
        elif self.noise and all(r.status in ("σ = 0", "frozen") for r in self.noise):
            text += ", no noise (σ = 0)"
        bad = [r for r in checked if r.status == "exceeded"]
        verdict = []
        if bad:
            names = {"alone": f"alone in {native}"}
            verdict.append("EXCEEDED (" + ", ".join(f"{r.name}: {' and '.join(names.get(c, c) for c in r.failed)}"
                                                     for r in bad) + ")")
        if self.under_noised:
            def under(r):  # the layer, or its parameter whose noise is short (a bias left without noise)
                parts = [f"{r.name}.{p}: {v[0]:.3f}" for p, v in r.parts.items() if v[2] < 1] if r.high >= 1 else []
                return ", ".join(parts) or f"{r.name}: {r.ratio:.3f}"
            verdict.append("UNDER-NOISED (" + ", ".join(map(under, self.under_noised)) + " of σΔ)")
        if self.malformed_noise:
            verdict.append("NOISE NOT AS CLAIMED (" + ", ".join(self.malformed_noise) + ")")
        return text + ("; " + "; ".join(verdict) if verdict else "; OK")

    def to_dict(self) -> dict:
        skip = ("rows", "noise", "contributions")
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        out["rows"] = [asdict(r) for r in self.rows]
        out["noise"] = [asdict(r) for r in self.noise]
        out["ok"] = self.ok
        out["line"] = self.line()
        return out
