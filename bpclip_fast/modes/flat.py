"""``clipping="flat"`` (DP-SGD, Opacus' default): each example's whole gradient, over every layer,
clipped to one ``C``; the layers share one collector (:class:`bpclip_fast.exact.FlatClipping`)
that computes each example's factor from all its layers' norms."""

from __future__ import annotations

from .base import ExactMode, check_positive


class Flat(ExactMode):
    name = "flat"
    collects = True

    def layer_thresholds(self, max_grad_norm, count: int) -> list:
        return [check_positive(max_grad_norm, "max_grad_norm", "convert_model")] * count

    def settle(self, module, layers, max_grad_norm, clip_fn: str, gamma: float) -> None:
        from .. import exact  # imported here: exact imports this package for the mode names

        exact.attach_flat(module, list(layers), max_grad_norm, clip_fn, gamma)

    def collector(self, layers):
        return layers[0]._bp_flat

    def built_layer_problems(self, named_layers, max_grad_norm) -> list[str]:
        # Layers of another mode are reported for their clipping already.
        return [f"{name} has max_grad_norm={layer._bp_max_grad_norm:g}, not {float(max_grad_norm):g}"
                for name, layer in named_layers
                if layer._bp_clipping == self.name and layer._bp_max_grad_norm != float(max_grad_norm)]

    # One threshold C for all the layers.
    def threshold_slots(self, layers) -> list:
        return [("max_grad_norm", layers, "max_grad_norm")]

    def count_slots(self, steps) -> list:
        # Every flat layer holding a contribution holds the same count (step_problems refuses otherwise).
        return [(st, 0) for st in steps if st.rows][:1] or [(None, 0)]

    def set_thresholds(self, layers, values, collector) -> None:
        collector._set_max_grad_norm(values[0])
        for layer in layers:
            layer._bp_set_bounds(max_grad_norm=values[0], noise_bound=values[0])

    def step_problems(self, steps) -> list:
        """Each release's factor must cover every layer an example reached in the step, so every
        layer holding a contribution must hold the same releases (books)."""
        held = [st for st in steps if st.rows]
        if len({frozenset(st.books) for st in held}) < 2:
            return []
        return [("rows", "under flat clipping the backward passes of this step reached different sets of layers "
                 "(another loss or head per pass, layers frozen in turn, backward(inputs=...)), so no factor "
                 "covered an example's whole gradient", [st.name for st in held])]
