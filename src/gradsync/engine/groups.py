"""Which process group carries the control plane: the data group itself, or a CPU group of the same ranks.

On a device the control traffic (headers, controls, carried values) stays on the CPU, so a step never
waits on the device to read it back (``control.py``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import process
from .._torch import has_cpu_backend, is_registered

SEPARATE_ON_CPU = False  # tests only: give a CPU data plane its own control group, as a device one has


def control_group(group: dist.ProcessGroup, data_device: torch.device) -> tuple[dist.ProcessGroup, torch.device]:
    """Return the group and device of the control plane for a data plane on ``data_device``.

    A CPU data plane shares its group. Off CPU the control tensors stay on the CPU: over ``group``
    when it has a CPU backend, otherwise over a new gloo group of the same ranks (its members alone
    take part in making it). Only without gloo do they go on the device (two syncs per backward)."""
    cpu = torch.device("cpu")
    if data_device.type == "cpu" and not SEPARATE_ON_CPU:
        return group, cpu
    if data_device.type != "cpu" and has_cpu_backend(group):
        return group, cpu
    if not dist.is_gloo_available():
        return group, data_device
    # the wrappers over one group share its control group, made once (a wrapper made again, each epoch, makes none):
    # over the whole world every rank makes it, and torch names it by count; over a subgroup only its members do,
    # and torch names it by its ranks
    ranks = tuple(dist.get_process_group_ranks(group))
    known = process.state.control_groups.get(ranks)
    if known is None or not is_registered(known):
        whole = len(ranks) == dist.get_world_size()
        known = dist.new_group(ranks=list(ranks), backend="gloo", use_local_synchronization=not whole)
        process.state.control_groups[ranks] = known
    return known, cpu


__all__ = ["SEPARATE_ON_CPU", "control_group"]
