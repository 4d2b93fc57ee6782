"""Expert parallelism from PyTorch (include/megamoe/ep.h, docs/python.md): an :class:`EpGroup` per
process and model (its NCCL communicator and one window for every layer), ``NVFP4MoE(...,
ep_group=group)`` per layer (the rank's experts, held once). :class:`EpLoopback` runs R virtual
ranks on SM partitions of one GPU, so that the multi-rank path is testable where one GPU is at hand.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import _ops


class EpLayerHandle(_ops.MoeHandle):
    """A prepared expert-parallel layer (``torch.ops.megamoe.ep_prepare``), owned by this object."""

    def describe(self, tokens: int = 1) -> str:
        return _ops.ops.ep_describe(int(self), "layer")

    @staticmethod
    def _free(handle: int) -> None:
        _ops.ops.ep_release(handle, "layer")


class EpLoopback:
    """R virtual ranks of expert parallelism on one GPU (megamoe::EpLoopback): each rank gets its
    own share of the SMs and a stream on them (:meth:`stream`). One thread drives every rank: make
    each rank's group and layers, prepare them all, then run each rank's forward under
    ``torch.cuda.stream(loopback.stream(r))`` with ``check_ids=False`` (a host synchronisation
    before every rank has launched would wait for ranks that wait for it), then :meth:`synchronize`
    (the ranks' streams belong to green contexts: ``torch.cuda.synchronize()`` does not wait for
    them). The outputs equal R GPUs'; the timings are not R GPUs'."""

    def __init__(self, world_size: int, device=None):
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        self.world_size = int(world_size)
        self.device = device
        self._handle = int(_ops.ops.ep_loopback_create(self.world_size, device))
        self._streams = {}

    def __deepcopy__(self, memo):
        return self  # the ranks' SMs and streams: one per process, shared by copies

    def stream(self, rank: int) -> torch.cuda.ExternalStream:
        """Rank ``rank``'s stream: its kernels run on its SMs only."""
        if rank not in self._streams:
            ptr, sms = _ops.ops.ep_loopback_stream(self._handle, int(rank))
            self._streams[rank] = torch.cuda.ExternalStream(ptr, device=self.device)
            self.sms_per_rank = int(sms)
        return self._streams[rank]

    def synchronize(self) -> None:
        """Waits for the work queued on every rank's stream."""
        for rank in range(self.world_size):
            self.stream(rank).synchronize()

    def __del__(self):
        try:
            _ops.ops.ep_release(self._handle, "loopback")
        except Exception:
            pass


class EpGroup:
    """One rank's endpoint of expert parallelism (megamoe::EpGroup), shared by every layer of a
    model: its communicator, one window sized for the largest layer (``hidden_size``, ``top_k``)
    and ``max_tokens_per_rank``, and its layers' scratch.

    ``process_group`` (a ``torch.distributed`` group of R ranks, one GPU each, R in 1..8, the GPUs
    of one host) names the ranks: creating the group is collective (rank 0 makes the NCCL id and
    broadcasts it over ``process_group``; every rank must pass the same sizes). ``loopback`` and
    ``rank`` instead make virtual rank ``rank`` of an :class:`EpLoopback` (no process group).
    The layers of a group run one at a time, in the same order on every rank; each rank runs each
    layer the same number of times (a batch is never split: forward refuses more than
    ``max_tokens_per_rank`` tokens). A wait for a peer that lasts longer than ``timeout_seconds``
    fails the run (RuntimeError at the next checked forward; the group is then unusable).
    """

    def __init__(self, process_group=None, *, hidden_size: int, top_k: int,
                 max_tokens_per_rank: int, device=None, timeout_seconds: float = 60.0,
                 precision: str = "w4a16", loopback: Optional[EpLoopback] = None,
                 rank: Optional[int] = None):
        _ops.check_precision(precision, "megamoe.EpGroup")
        if (loopback is None) == (process_group is None):
            raise ValueError("megamoe.EpGroup: pass a process_group, or a loopback and a rank")
        if loopback is not None:
            if rank is None:
                raise ValueError("megamoe.EpGroup: a loopback group needs its rank")
            self.rank, self.world_size = int(rank), loopback.world_size
            self.device = loopback.device
            unique_id, loopback_handle = "", loopback._handle
            self._loopback = loopback  # kept alive with the group
        else:
            import torch.distributed as dist

            self.rank = dist.get_rank(process_group)
            self.world_size = dist.get_world_size(process_group)
            self.device = (torch.device("cuda", torch.cuda.current_device()) if device is None
                           else torch.device(device))
            ids = [_ops.ops.ep_unique_id() if self.rank == 0 else None]
            dist.broadcast_object_list(ids, src=dist.get_global_rank(process_group, 0),
                                       group=process_group, device=self.device)
            unique_id, loopback_handle = ids[0], 0
            self._loopback = None
        self.hidden_size = int(hidden_size)
        self.top_k = int(top_k)
        self.max_tokens_per_rank = int(max_tokens_per_rank)
        self.precision = precision
        self._handle = int(_ops.ops.ep_group_create(
            unique_id, self.rank, self.world_size, self.device, self.max_tokens_per_rank,
            self.hidden_size, self.top_k, float(timeout_seconds), precision, loopback_handle))

    def expert_range(self, num_experts: int) -> tuple[int, int]:
        """This rank's routed experts [first, first + count) of ``num_experts``."""
        if num_experts % self.world_size:
            raise ValueError(f"megamoe.EpGroup: {num_experts} routed experts do not split evenly over "
                             f"{self.world_size} ranks; the number of experts must be a multiple of "
                             "the world size")
        count = num_experts // self.world_size
        return self.rank * count, count

    def describe(self) -> str:
        return _ops.ops.ep_describe(self._handle, "group")

    def __deepcopy__(self, memo):
        return self  # a process's endpoint: copies of a model share it

    def __del__(self):
        try:
            _ops.ops.ep_release(self._handle, "group")
        except Exception:
            pass
