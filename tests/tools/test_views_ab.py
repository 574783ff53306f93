"""benchmarks/speed/views_ab.py: the previous views path it re-creates gives today's gradients, and a quick run."""
import importlib.util
from pathlib import Path

import torch

from gradsync.tools.bench.models import GradsyncEngine, ModelSpec
from gradsync.tools.launch import run_ranks

ROOT = Path(__file__).resolve().parents[2]
spec_ = importlib.util.spec_from_file_location("views_ab", ROOT / "benchmarks" / "speed" / "views_ab.py")
views_ab = importlib.util.module_from_spec(spec_)
spec_.loader.exec_module(views_ab)
SPEC = ModelSpec(name="mlp-tiny", kind="mlp", width=64, depth=2, batch=4)


def grads_after(rank, world, cls):
    engine = cls(SPEC.build(seed=0), bucket_cap_mb=0.01, view=None, set_to_none=True, lr=1e-3)
    out = []
    for step in range(3):
        x, y = SPEC.batch_for(rank, step)
        engine.micro_step(x * (1 + rank), y, sync=True)
        out.append([p.grad.clone() for p in engine.model.parameters()])
        engine.optimizer_step()
    return out


def test_previous_views_path_is_bit_identical_to_the_current_one():
    now, before = (run_ranks(grads_after, 2, cls)[0] for cls in (GradsyncEngine, views_ab.PreviousViews))
    for a, b in zip(now, before):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_quick_run_prints_paired_ratios():
    lines = views_ab.main(1, quick=True)
    assert len(lines) == 2 and all("new/prev" in line and "torch-views" in line for line in lines)
