"""One gradient's trip: the gradsync files a default synced backward enters, traced, at most six; and
the Python calls into gradsync per extra parameter, at most two (issue 37: work per bucket, not per parameter).

``sys.setprofile`` records every Python call into the package during one ``loss.backward()`` of
``DistributedDataParallel(net)`` on 2 gloo ranks, after the first synced backward (which re-plans the
buckets once from the observed order, ``engine/layout.py``). docs/architecture.md lists the files.
"""
import contextlib
import os
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import gradsync
from gradsync.tools.launch import run_ranks
from helpers import batches, mlp, shard

MAX_FILES = 6
DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def trace_backwards(rank, world_size, steps, layers=None, local_views=False, local=None):
    """``local_views``: each backward is a window's first ``no_sync`` one with gradient views, after
    ``zero_grad(set_to_none=True)``, so every parameter's ``.grad`` must come into its slot.
    ``local`` ("views" or "copy"): each backward after the first (synced) one is a later ``no_sync`` one."""
    net = mlp() if layers is None else torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)])
    model = gradsync.DistributedDataParallel(net, gradient_as_bucket_view=local_views or local == "views")
    package = os.path.dirname(gradsync.__file__)
    trips = []
    for x, y in batches(steps, world_size):
        if layers is not None:
            x = x[:, :4]
        loss = F.mse_loss(model(shard(x, rank, world_size)), shard(y, rank, world_size))
        files, calls = [], [0]

        def profile(frame, event, arg):
            if event == "call" and frame.f_code.co_filename.startswith(package):
                calls[0] += 1
                name = os.path.relpath(frame.f_code.co_filename, package)
                if name not in files:
                    files.append(name)
        if local_views:
            model.zero_grad(set_to_none=True)
        sys.setprofile(profile)
        try:
            with model.no_sync() if local_views or (local and trips) else contextlib.nullcontext():
                loss.backward()
        finally:
            sys.setprofile(None)
        if local_views:  # every .grad is its bucket slot again
            assert all(p.grad.data_ptr() == v.data_ptr() for p, v in zip(model.parameters(), model.reducer.store.views))
        trips.append((files, calls[0]))
    return trips


def test_a_synced_backward_enters_at_most_six_files_and_the_docs_list_them():
    trips = run_ranks(trace_backwards, 2, 3)
    for rank_trips in trips:
        first, *steady = rank_trips
        assert "engine/layout.py" in first[0]  # the probe sees the first backward's re-plan
        for files, calls in steady:
            assert len(files) <= MAX_FILES, files
            assert files[0] == "engine/reducer.py", files  # the gradient's hook is the reducer's
    listed = re.findall(r"^\d+\. `([\w/]+\.py)`", DOC.read_text(), flags=re.M)
    assert set(trips[0][-1][0]) <= set(listed), (trips[0][-1][0], listed)


def test_python_calls_per_extra_parameter_are_at_most_two():
    # 16 and 128 parameters (8 and 64 small layers, one or two buckets): the slope is what each
    # gradient costs in Python; torch's C++ reducer makes no call, a call per bucket is amortized
    few, many = (run_ranks(trace_backwards, 2, 3, layers)[0][-1][1] for layers in (8, 64))
    per_parameter = (many - few) / (128 - 16)
    print(f"calls: {few} for 16 parameters, {many} for 128: {per_parameter:.2f} per extra parameter")
    assert per_parameter <= 2.0, (few, many, per_parameter)


def test_a_first_local_backward_brings_its_gradients_into_their_slots_with_no_call_per_parameter():
    # with views, a window's first no_sync backward has its first hook make each small .grad its zeroed slot and
    # take the other hooks out until it ends (engine/quiet.py): no call per gradient. A copy per gradient was ~6
    # calls per parameter, ~30% of a small no_sync backward; a copy per bucket with a hook each, 1.0
    few, many = (run_ranks(trace_backwards, 2, 3, layers, True)[0][-1][1] for layers in (8, 64))
    per_parameter = (many - few) / (128 - 16)
    print(f"calls: {few} for 16 parameters, {many} for 128: {per_parameter:.2f} per extra parameter")
    assert per_parameter <= 0.1, (few, many, per_parameter)


def test_a_later_local_backward_makes_no_call_per_parameter():
    # a no_sync backward whose .grad are where the window keeps them needs nothing per gradient: the first
    # hook takes the others out until the backward ends (engine/quiet.py); a hook call each was ~2.5 us
    for local in ("copy", "views"):
        few, many = (run_ranks(trace_backwards, 2, 3, layers, False, local)[0][-1][1] for layers in (8, 64))
        print(f"{local}: calls: {few} for 16 parameters, {many} for 128")
        assert many - few <= 8, (local, few, many)
