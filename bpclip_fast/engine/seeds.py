"""The secret seeds (module docstring of :mod:`bpclip_fast.engine`, "Checkpoints"): the noise seed
never leaves the process unless asked for explicitly; the sampling seed is drawn separately, since a
checkpoint of shuffled batches must carry it."""

from __future__ import annotations

import secrets

from .. import data
from .. import nn as bnn
from . import distributed


def fresh() -> int:
    """A seed from the OS: nobody else knows it."""
    return secrets.randbits(63)


def prepare(engine, noise_seed) -> int:
    """The noise seed (OS entropy unless explicit; one for all processes); returns the sampling
    seed, drawn separately: a checkpoint may need it (shuffled batches, see Checkpoints), the
    noise seed never leaves the process."""
    engine._secure = noise_seed is None
    seed = fresh() if noise_seed is None else int(noise_seed)  # range checked with the arguments
    sampler_seed = fresh() if noise_seed is None else data.derive_seed(seed, "sampler")
    if engine.distributed:
        seed = distributed.broadcast_int(seed)
        sampler_seed = distributed.broadcast_int(sampler_seed)
    set_noise_seed(engine, seed)
    return sampler_seed


def set_noise_seed(engine, seed: int) -> None:
    engine._seed = int(seed)
    engine._stream = bnn.NoiseStream(engine._seed)
    engine._stream.secure = engine._secure
