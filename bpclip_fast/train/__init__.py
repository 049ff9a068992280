"""The reference trainer: ``bpclip-train`` (one run) and ``bpclip-sweep`` (a grid of runs).

    from bpclip_fast.train import Config, run
    result = run(Config(method="bpclip", epsilon=3.0, out="runs/one"))   # the run.json dictionary

See ``bpclip-train --help`` and ``docs/results.md``.
"""

from .trainer import Config, expected_calibration_error, run  # noqa: F401

__all__ = ["Config", "run", "expected_calibration_error"]
