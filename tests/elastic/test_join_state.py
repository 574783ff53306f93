"""``serialized``/``deserialized`` (``engine/collectives.py``): the state sent to a joiner and what members hold at a
re-shard, as bytes and back, without holding the GIL for long.

A replica that beats itself (under torchrun, SLURM, Kubernetes) needs the GIL between its heartbeat's store calls, and
a member whose beat stands still for 5 s is taken for gone. ``torch.save`` into a ``BytesIO`` held it about 3 s per GB while it grew the buffer, and
``torch.load`` of ``blob.numpy().tobytes()`` 6 s for 2 GB in one copy: a join of a model with a few GB of optimizer
state could evict the replica that sent it or the one that received it.
"""
import threading
import time

import pytest
import torch

from gradsync.engine.collectives import deserialized, serialized


def test_the_state_round_trips():
    base = torch.arange(12, dtype=torch.float32)
    state = {"step": 7, "moments": [base.view(3, 4), base[2:5]], "empty": torch.empty(0), "int": torch.arange(5),
             "half": torch.ones(3, dtype=torch.bfloat16), "names": {"a": (1, 2.5, None)}}
    back = deserialized(serialized(state))
    assert back["step"] == 7 and back["names"] == {"a": (1, 2.5, None)}
    assert torch.equal(back["moments"][0], state["moments"][0]) and torch.equal(back["moments"][1], base[2:5])
    assert back["moments"][0].untyped_storage().data_ptr() == back["moments"][1].untyped_storage().data_ptr()
    assert back["empty"].numel() == 0 and torch.equal(back["int"], state["int"]) and back["half"].dtype == torch.bfloat16


@pytest.mark.slow  # 1.2 GB serialized and read back: about 10 s and 5 GB of memory
def test_a_large_state_never_holds_the_gil_for_seconds():
    gaps, stop = [], threading.Event()

    def beat():  # what the heartbeat thread needs: a turn every 0.05 s
        last = time.monotonic()
        while not stop.is_set():
            time.sleep(0.05)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    state = {"exp_avg": torch.randn(150_000_000), "exp_avg_sq": torch.randn(150_000_000), "step": 3}
    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        back = deserialized(serialized(state))
    finally:
        stop.set()
        thread.join()
    assert torch.equal(back["exp_avg_sq"], state["exp_avg_sq"]) and back["step"] == 3
    # before: ~2 s saving and ~4 s loading this state in one stretch each; now each copy is torch's, GIL released
    assert max(gaps) < 1.5, f"the GIL was held for {max(gaps):.2f} s at a time"
