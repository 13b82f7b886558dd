"""vLLM's CPU communicator: ``all_gatherv`` / ``reduce_scatterv`` for data parallelism (CPU fix).

``CpuCommunicator`` does not implement them (the base class raises ``NotImplementedError``), and
the MoE layers of a data-parallel engine gather every rank's tokens with ``all_gatherv`` and
scatter the results back with ``reduce_scatterv``: every request fails with HTTP 500. The
fixes pad every rank to the largest size, ``all_gather`` and drop the padding; and
``all_reduce`` the whole tensor and keep this rank's rows. Installed with the other CPU fixes
(:mod:`..cpu_fixes`: on the CPU platform, for the vLLM versions with the bug).
"""

from __future__ import annotations

from .base import Patch


def _check_sizes(comm, sizes, what: str) -> None:
    if len(sizes) != comm.world_size:
        raise ValueError(f"{what}: len(sizes)={len(sizes)} != world_size={comm.world_size}")
    if any(s < 0 for s in sizes):
        raise ValueError(f"{what}: negative size in {sizes}")


def _through_comm(x) -> bool:
    """Whether the communicator's own collectives take this dtype. Its shared-memory backend
    (used by "tp"/"pp" groups) rejects integer tensors ("shm_all_gather_impl not implemented
    for 'Int'"); other dtypes go through torch.distributed on the same group."""
    import torch

    return x.dtype in (torch.float32, torch.bfloat16)


def _all_gather_dim0(comm, x):
    """Concatenating all-gather along dim 0 (rank-major)."""
    import torch

    if _through_comm(x):
        return comm.all_gather(x.contiguous(), 0)
    out = x.new_empty((comm.world_size * x.shape[0],) + tuple(x.shape[1:]))
    torch.distributed.all_gather_into_tensor(out, x.contiguous(), group=comm.device_group)
    return out


def _all_reduce(comm, x):
    """In-place sum over ranks."""
    import torch

    if _through_comm(x):
        return comm.all_reduce(x)
    torch.distributed.all_reduce(x, group=comm.device_group)
    return x


def _all_gatherv_one(comm, tensor, dim: int, sizes):
    import torch

    if dim < 0:
        dim += tensor.dim()
    if not 0 <= dim < tensor.dim():
        raise ValueError(f"all_gatherv: invalid dim for shape {tuple(tensor.shape)}")
    x = tensor.movedim(dim, 0)
    rest = tuple(x.shape[1:])
    if sizes is not None:
        sizes = [int(s) for s in sizes]
        _check_sizes(comm, sizes, "all_gatherv")
        if x.shape[0] != sizes[comm.rank_in_group]:
            raise ValueError(f"all_gatherv: rank {comm.rank_in_group} has {x.shape[0]} rows "
                             f"along dim {dim}, sizes say {sizes[comm.rank_in_group]}")
    if sizes is None or all(s == sizes[0] for s in sizes):
        if x.shape[0] == 0:
            out = x.new_empty((0,) + rest)
        else:
            out = _all_gather_dim0(comm, x)  # [world * rows, *rest], rank-major
    else:
        largest = max(sizes)
        padded = x.new_zeros((largest,) + rest)
        padded[: x.shape[0]] = x
        gathered = _all_gather_dim0(comm, padded)  # [world * largest, *rest], rank-major
        out = torch.cat([gathered[r * largest: r * largest + s] for r, s in enumerate(sizes)])
    return out.movedim(0, dim).contiguous()


def cpu_all_gatherv(self, input_, dim: int = 0, sizes=None):
    """All-gather with per-rank sizes along ``dim`` (``sizes[r]`` rows from rank ``r``).

    ``input_`` is one tensor or a list of tensors (one collective each, same ``sizes``);
    ``sizes=None`` means every rank contributes the same shape.
    """
    if isinstance(input_, (list, tuple)):
        return [_all_gatherv_one(self, t, dim, sizes) for t in input_]
    return _all_gatherv_one(self, input_, dim, sizes)


def cpu_reduce_scatterv(self, input_, dim: int = -1, sizes=None):
    """Sum ``input_`` over ranks and return this rank's ``sizes[rank]`` rows along ``dim``.

    ``input_`` has ``sum(sizes)`` rows along ``dim``, rank-major; ``sizes=None`` splits it
    evenly. The input is not modified.
    """
    world = self.world_size
    if dim < 0:
        dim += input_.dim()
    if not 0 <= dim < input_.dim():
        raise ValueError(f"reduce_scatterv: invalid dim for shape {tuple(input_.shape)}")
    total = input_.shape[dim]
    if sizes is None:
        if total % world:
            raise ValueError(f"reduce_scatterv: {total} rows not divisible by {world} ranks")
        sizes = [total // world] * world
    sizes = [int(s) for s in sizes]
    _check_sizes(self, sizes, "reduce_scatterv")
    if sum(sizes) != total:
        raise ValueError(f"reduce_scatterv: sum(sizes)={sum(sizes)} != {total} rows")
    if world == 1:
        return input_
    reduced = _all_reduce(self, input_.contiguous().clone())
    start = sum(sizes[: self.rank_in_group])
    return reduced.narrow(dim, start, sizes[self.rank_in_group]).contiguous()


ALL_GATHERV = Patch(
    "vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator.all_gatherv",
    "CPU fix: all-gather with per-rank sizes, which data-parallel MoE layers need and the CPU communicator "
    "does not implement", lambda original: cpu_all_gatherv)
REDUCE_SCATTERV = Patch(
    "vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator.reduce_scatterv",
    "CPU fix: reduce-scatter with per-rank sizes, which data-parallel MoE layers need and the CPU communicator "
    "does not implement", lambda original: cpu_reduce_scatterv)

PATCHES = (ALL_GATHERV, REDUCE_SCATTERV)
