"""The engine's collectives under DistributedDataParallel (the analysis: module docstring of
:mod:`bpclip_fast.engine`, "Multi-process training"): every rank takes the same decision and the
same seeds, so the one accountant stepped on every rank describes the one release."""

from __future__ import annotations

import torch

from ..graph_nodes import untraced


def world():
    """(rank, world size, is distributed)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size(), True
    return 0, 1, False


def ddp_class():
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


def collective_device():
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def unwrapped(module, distributed: bool):
    """The model inside a DDP wrapper (``module`` itself if not wrapped)."""
    if isinstance(module, torch.nn.DataParallel):
        raise ValueError(refuse_data_parallel("make_private: the module is nn.DataParallel"))
    if not isinstance(module, ddp_class()):
        return module
    if not distributed:
        raise RuntimeError("make_private: the module is DistributedDataParallel but torch.distributed is not "
                           "initialised with more than one process")
    return module.module


def refuse_data_parallel(what: str) -> str:
    """The message for ``nn.DataParallel``: its replicas are shallow copies run in threads, sharing each
    layer's step records (rows, draw, the marks of a landing pass) with no test of what they do
    together; DDP is what the engine's guarantee covers across devices."""
    return (f"{what}, which is not supported: its replicas share the private layers' step records across "
            "threads. Use DistributedDataParallel (one process per device, supported by make_private), or the "
            "model itself on one device")


def wrapped(module, distributed: bool):
    """The model in DDP if the user did not wrap it (the engine's counters are per process and not
    buffers: DDP never broadcasts them)."""
    ddp = ddp_class()
    if distributed and not isinstance(module, ddp):
        module = ddp(module)
    return module


def broadcast_int(value: int) -> int:
    """Rank 0's ``value`` on every rank (the seeds: one noise stream, one sampler for all)."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=collective_device())
    dist.broadcast(t, 0)
    return int(t.item())


def broadcast_flags(flags: list) -> list:
    """Rank 0's booleans on every rank (which layers get the fallback draw)."""
    import torch.distributed as dist

    t = torch.tensor(flags, dtype=torch.uint8, device=collective_device())
    dist.broadcast(t, 0)
    return [bool(v) for v in t.tolist()]


def summed(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over every rank, on the CPU."""
    import torch.distributed as dist

    t = t.to(collective_device())
    dist.all_reduce(t)
    return t.cpu()


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on some rank (a step refused on one is refused on all)."""
    import torch.distributed as dist

    t = torch.tensor([1 if flag else 0], device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


class DistributedRecorder:
    """Under DistributedDataParallel the reducer writes the averaged gradient into ``.grad`` at the
    end of each backward, after our post-accumulate hooks: that write is DDP's own, not an edit.
    The records of the gradients this backward touched are therefore taken again once DDP is done.

    DDP queues its finalize callback when its last bucket is ready; ours is queued at the first
    accumulation and queues a second one, which the autograd engine runs after every callback
    queued before it (final callbacks run in order, and may add more)."""

    def __init__(self):
        self._touched = {}
        self._queued = False

    def touched(self, step, i: int) -> None:
        self._touched[(id(step), i)] = (step, i)
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._requeue)

    @untraced  # the engine's callbacks never run under dynamo (a compiled step's backward)
    def _requeue(self):
        torch.autograd.Variable._execution_engine.queue_callback(self._record)

    @untraced
    def _record(self):
        for step, i in self._touched.values():
            if step._param(i).grad is not None:
                step.landed(i)
        self._touched.clear()
        self._queued = False
