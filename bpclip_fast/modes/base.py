"""What a clipping mode decides, as one object per mode (jax_privacy's strategies rather than a
string tested wherever a rule differs): the bounds it takes, each layer's threshold, what it sets
over all the layers of a model, the σ of each layer, its adaptive-threshold slots and the
step-boundary checks only it needs. The layers keep ``clipping`` as a string (what a user and
the tests read); :func:`bpclip_fast.modes.strategy` turns it into the mode."""

from __future__ import annotations

import math

NAMES = ("backprop", "flat", "per_layer")
EXACT = ("flat", "per_layer")  # clip each example's exact gradient to max_grad_norm


def check_positive(value, what: str, layer: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{layer}: {what} must be a positive number, got {value!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"{layer}: {what} must be a positive finite number, got {value!r}")
    return v


def request_positive(value, what: str) -> float:
    """The check of a ``make_private`` argument (its errors name ``PrivacyEngine``)."""
    return check_positive(value, what, "PrivacyEngine")


class Mode:
    """One clipping mode. Stateless: the layers and the engine hold the state, a mode the rules.

    ``exact``: the layers clip each example's exact gradient to ``max_grad_norm`` (noise ``σC``),
    rather than each layer's input and upstream gradient (noise ``σΔ_l``).
    ``collects``: the model's layers share one collector (flat's ``exact.FlatClipping``).
    ``threshold_attrs``: each layer's clipping thresholds (what adaptive clipping moves).
    """

    name: str = ""
    exact: bool = False
    collects: bool = False
    threshold_attrs: tuple = ()

    def __repr__(self) -> str:
        return f"<clipping mode {self.name!r}>"

    # -------------------------------------------------------------- arguments
    def check_request(self, input_clip, grad_clip, max_grad_norm) -> None:
        """The bounds ``make_private`` takes in this mode, and only those."""
        raise NotImplementedError

    def layer_bounds(self, kind: str, input_clip, grad_clip, max_grad_norm) -> tuple:
        """``(input_clip, grad_clip, max_grad_norm)`` of one clipped layer built in this mode."""
        raise NotImplementedError

    def conversion_settings(self, *, input_clip, grad_clip, norm, norm_method) -> dict:
        """The keyword arguments of the clipped layers ``convert_model`` builds (besides
        ``clip_fn``, ``gamma``, ``clipping`` and each layer's ``max_grad_norm``)."""
        raise NotImplementedError

    def layer_thresholds(self, max_grad_norm, count: int) -> list:
        """Each of ``count`` converted layers' ``max_grad_norm`` (``None`` where it has none)."""
        return [None] * count

    # -------------------------------------------------------------- a model's layers together
    def settle(self, module, layers, max_grad_norm, clip_fn: str, gamma: float) -> None:
        """What the mode sets over all the clipped ``layers`` of ``module`` once they are built."""

    def collector(self, layers):
        """The collector the layers share (``None`` where the mode has none)."""
        return None

    def built_layer_problems(self, named_layers, max_grad_norm) -> list[str]:
        """What differs between clipped layers the user built and the engine's clipping of this mode
        (beyond their ``clipping``, which every mode checks)."""
        return []

    # -------------------------------------------------------------- σ
    def sigma_factor(self, n_layers: int) -> float:
        """Each layer's σ over the effective σ of one step's Gaussian on all ``n_layers`` layers."""
        raise NotImplementedError

    def effective_sigma(self, sigma: float, n_layers: int) -> float:
        """The effective σ of one step when each of ``n_layers`` layers adds noise of multiplier ``sigma``."""
        raise NotImplementedError

    # -------------------------------------------------------------- adaptive thresholds
    def threshold_slots(self, layers) -> list:
        """``[(name, layers, attribute)]``: every clipping threshold and the layers it sets."""
        return [(f"{layer.layer_name}.{attr}", [layer], attr) for layer in layers for attr in self.threshold_attrs]

    def count_slots(self, steps) -> list:
        """``[(step or None, j)]``, one per threshold slot: whose ``counts[j]`` counts it (``None``:
        no example reached that layer in this step)."""
        return [(st if st.rows else None, j) for st in steps for j in range(len(self.threshold_attrs))]

    def set_thresholds(self, layers, values, collector) -> None:
        """Gives the layers the thresholds ``values`` (one per slot) and the noise bounds they imply."""
        raise NotImplementedError

    # -------------------------------------------------------------- the step boundary
    def step_problems(self, steps) -> list:
        """``[(rule, details, names)]``: what ``step()`` must refuse that only this mode has."""
        return []


class ExactMode(Mode):
    """``flat`` and ``per_layer``: each example's exact gradient clipped to ``max_grad_norm``, every
    layer's noise ``N(0, σ²C²)`` with ``C`` the mode's noise bound, so the effective σ is ``σ``."""

    exact = True
    threshold_attrs = ("max_grad_norm",)

    def check_request(self, input_clip, grad_clip, max_grad_norm) -> None:
        if max_grad_norm is None:
            raise TypeError(f"make_private: clipping={self.name!r} needs max_grad_norm")
        if input_clip is not None or grad_clip is not None:
            raise TypeError(f"make_private: input_clip/grad_clip belong to clipping='backprop'; clipping={self.name!r} "
                            "clips each example's gradient to max_grad_norm")
        self.check_max_grad_norm(max_grad_norm)

    def check_max_grad_norm(self, max_grad_norm) -> None:
        """``make_private``'s ``max_grad_norm`` in this mode (one ``C``)."""
        request_positive(max_grad_norm, "max_grad_norm")

    def layer_bounds(self, kind: str, input_clip, grad_clip, max_grad_norm) -> tuple:
        if max_grad_norm is None:
            raise TypeError(f"{kind}: clipping={self.name!r} needs max_grad_norm (the bound on each example's "
                            "gradient norm)")
        if input_clip is not None or grad_clip is not None:
            raise TypeError(f"{kind}: input_clip and grad_clip belong to clipping='backprop'; clipping="
                            f"{self.name!r} clips each example's gradient to max_grad_norm")
        return None, None, check_positive(max_grad_norm, "max_grad_norm", kind)

    def conversion_settings(self, *, input_clip, grad_clip, norm, norm_method) -> dict:
        return dict(norm_method=norm_method)

    def sigma_factor(self, n_layers: int) -> float:
        return 1.0

    def effective_sigma(self, sigma: float, n_layers: int) -> float:
        return float(sigma)
