"""Golden test: today's engine must reproduce tests/golden/golden.pt bit for bit.

Every configuration of tests/golden/configs.py (DDP with views, comm hooks, reduce_dtype,
find_unused_parameters, static_graph, no_sync, the accumulator with mean losses and num_items,
ShardedDataParallel, overlap_optimizer, join; 2 and 3 ranks) trains a small elementwise model for a few
optimizer steps; the gradients and parameters of every rank after every step must equal the recorded
ones exactly (dtype and shape too). The models and data are built so that no result depends on the
CPU model (see configs.py), so a difference means the engine computes differently: another summation
order, another rounding, a gradient that became None or zeros.

All configurations of one world size run in one multi-rank run (a few seconds in all). To re-pin
after an intended numerical change, regenerate from a clean checkout: see tests/golden/make_golden.py.
"""
from pathlib import Path

import pytest
import torch

from golden import configs
from gradsync.tools.launch import RankError

GOLDEN = Path(__file__).resolve().parent / "golden" / "golden.pt"
_results: dict[int, dict] = {}


@pytest.fixture(scope="module")
def golden():
    if not GOLDEN.exists():
        pytest.fail(f"{GOLDEN} is missing; generate it with tests/golden/make_golden.py from a clean checkout")
    return configs.load_golden(GOLDEN, with_meta=True)


def results_for(world_size: int) -> dict[str, dict | str]:
    """Each configuration of this world size: its tensors, or the error it raised.

    All of them run in one multi-rank run, once per session; if that run fails, each runs alone,
    so a configuration that raises fails its own test only.
    """
    if world_size not in _results:
        names = configs.by_world_size()[world_size]
        try:
            merged = configs.run_world(world_size, names)
            _results[world_size] = {n: {k: v for k, v in merged.items() if k.startswith(n + "/")} for n in names}
        except RankError:
            _results[world_size] = {}
            for n in names:
                try:
                    _results[world_size][n] = configs.run_world(world_size, [n], timeout=60)
                except RankError as exc:
                    _results[world_size][n] = str(exc)
    return _results[world_size]


def test_golden_file_covers_exactly_the_configurations(golden):
    recorded = {key.split("/", 1)[0] for key in golden[0]}
    assert recorded == set(configs.CONFIGS), (
        f"golden.pt has {sorted(recorded - set(configs.CONFIGS))} that configs.py lacks and lacks "
        f"{sorted(set(configs.CONFIGS) - recorded)}; regenerate it with tests/golden/make_golden.py")


@pytest.mark.parametrize("name", list(configs.CONFIGS))
def test_bit_identical_to_golden(name, golden):
    got = results_for(configs.CONFIGS[name].world_size)[name]
    if isinstance(got, str):
        pytest.fail(f"configuration {name} raised:\n{got}")
    tensors, meta = golden
    want = {k: v for k, v in tensors.items() if k.startswith(name + "/")}
    assert want, f"golden.pt has nothing for configuration {name}; regenerate it"
    problems = configs.differences(got, want)
    shown = "\n  ".join(problems[:40]) + (f"\n  ... and {len(problems) - 40} more" if len(problems) > 40 else "")
    versions = ("" if meta.get("torch") == str(torch.__version__) else
                f"\n(golden.pt was made with torch {meta.get('torch')}, this is torch {torch.__version__}: "
                "torch's own arithmetic or gloo may differ too)")
    assert not problems, (f"configuration {name}: {len(problems)} tensor(s) differ from golden.pt "
                          f"(engine {meta.get('engine_commit')}):\n  {shown}{versions}")
