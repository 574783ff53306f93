"""The benchmarks' harness: paired statistics, records, the compare tool and the netns link."""
import datetime
import json
import os
import re
import subprocess
import sys

import pytest

from gradsync.tools.bench import compare, harness, netns
from gradsync.tools.bench.models import GradsyncEngine, ModelSpec, TorchEngine
from gradsync.tools.launch import run_ranks


def test_paired_ratios_are_medians_of_per_round_ratios():
    times = {"ref": [1.0, 2.0, 4.0], "x": [1.1, 2.0, 5.0]}
    got = harness.paired(times, "ref")
    assert got["paired_ratio"] == {"ref": 1.0, "x": 1.1}
    assert got["median_ms"]["x"] == 2000.0 and got["ratio_iqr"]["x"] == [1.0, 1.25]
    assert got["noise_ms"] == 2000.0  # |1-2|, |2-4|, |4-1|: median 2 s
    assert harness.quartiles([3.0]) == [3.0, 3.0] and harness.spread([1.0, 3.0, 2.0])["median"] == 2.0


def test_record_names_say_what_where_and_when(tmp_path):
    stem = harness.record_stem("speed-loopback", date=datetime.date(2026, 11, 23))
    assert stem == f"speed-loopback-{os.cpu_count()}cpu-2026-11-23"
    assert harness.record_stem("x", quick=True).endswith("-quick")
    with harness.LoadWatch() as load:
        pass
    record = {"rows": [], **load.as_record()}
    assert len(record["load_before"]) == len(record["load_after"]) == 3 and record["seconds"] >= 0
    path = harness.write_record(tmp_path / "out", stem, record, "# hi\n")
    assert path.name == f"{stem}.md" and json.loads((tmp_path / "out" / f"{stem}.json").read_text()) == record
    assert re.fullmatch(r".+-\d+cpu", harness.machine_info()["slug"])


def test_time_variants_alternates_every_variant():
    spec = ModelSpec(name="mlp-tiny", kind="mlp", width=16, depth=2, batch=2)
    kw = dict(bucket_cap_mb=25.0, view=None, set_to_none=True, lr=1e-3)
    variants = harness.with_aa({"torch": lambda m: TorchEngine(m, **kw), "gradsync": lambda m: GradsyncEngine(m, **kw)},
                               "torch")
    times = run_ranks(harness.time_variants, 2, spec, variants, 2, 1, 3)[0]
    assert set(times) == {"torch", "gradsync", "torch A/A"} and all(len(t) == 3 and min(t) > 0 for t in times.values())


def record(ratios_by_row, raw=None):
    return {"rows": [{"model": m, "accum": a, "paired_ratio": r, **({"raw": raw} if raw else {})}
                     for (m, a), r in ratios_by_row.items()]}


def test_compare_puts_a_change_against_the_a_a_band():
    before = record({("mlp", 1): {"torch": 1.0, "torch A/A": 1.02, "gradsync": 1.00},
                     ("gpt", 4): {"torch": 1.0, "torch A/A": 0.97, "gradsync": 0.95}})
    after = record({("mlp", 1): {"torch": 1.0, "torch A/A": 0.98, "gradsync": 1.10},
                    ("gpt", 4): {"torch": 1.0, "torch A/A": 1.01, "gradsync": 0.96}})
    table, moved = compare.compare(before, after, tolerance=0.0)
    assert moved == ["mlp acc 1: gradsync"]  # 1.10 moved by 10%, beyond its band of 2%
    assert "| gpt acc 4 | gradsync | 0.950 | 0.960 | 1.011 | ±0.030 | within noise |" in table
    assert "| mlp acc 1 | gradsync | 1.000 | 1.100 | 1.100 | ±0.020 | slower |" in table


def test_compare_band_from_the_reference_s_own_rounds_and_the_command_line(tmp_path, capsys):
    raw = {"torch": [1.0, 1.1, 1.0, 1.1, 1.0]}  # no A/A variant: the reference's round-to-round spread
    a, b = record({("m", 1): {"torch": 1.0, "g": 1.0}}, raw), record({("m", 1): {"torch": 1.0, "g": 1.05}}, raw)
    assert compare.rows(a)["m acc 1"]["band"] == pytest.approx(0.1)
    for name, rec in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(rec))
    assert compare.main([str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    assert "within noise" in capsys.readouterr().out


@pytest.mark.skipif(not netns.available(), reason="needs root, ip netns and tc")
def test_netns_link_is_made_and_removed_also_on_error():
    with netns.link("gs-test", "10.79.0", rate="100mbit", tag="t") as net:
        assert set(net.namespaces) <= set(netns.existing())
        ping = subprocess.run(net.exec(0, ["ip", "-o", "addr", "show", "dev", net.devices[0]]),
                              capture_output=True, text=True)
        assert "10.79.0.1/24" in ping.stdout
        shown = subprocess.run(["tc", "-n", net.namespaces[1], "qdisc", "show", "dev", net.devices[1]],
                               capture_output=True, text=True).stdout
        assert "tbf" in shown
    assert not set(net.namespaces) & set(netns.existing())
    with pytest.raises(RuntimeError), netns.link("gs-test", "10.79.0", tag="u") as net:
        raise RuntimeError("boom")
    assert not set(net.namespaces) & set(netns.existing())


def bridges() -> str:
    return subprocess.run(["ip", "-o", "link", "show", "type", "bridge"], capture_output=True, text=True).stdout


@pytest.mark.skipif(not netns.available(), reason="needs root, ip netns and tc")
def test_netns_star_is_made_and_removed_also_on_error():
    with netns.star("gs-st", "10.79.1", 3, rate="100mbit", tag="t") as net:
        assert len(net.namespaces) == 3 and set(net.namespaces) <= set(netns.existing()) and "gs-stbrt" in bridges()
        for end in range(3):
            shown = subprocess.run(net.exec(end, ["ip", "-o", "addr", "show", "dev", net.devices[end]]),
                                   capture_output=True, text=True).stdout
            assert f"10.79.1.{end + 1}/24" in shown
            assert "tbf" in subprocess.run(["tc", "-n", net.namespaces[end], "qdisc", "show", "dev", net.devices[end]],
                                           capture_output=True, text=True).stdout
        # namespace 0 reaches namespace 2 through the bridge, and nothing else: it has no other route
        reach = "import socket; socket.create_connection(('10.79.1.3', 1), timeout=5)"
        refused = subprocess.run(net.exec(0, [sys.executable, "-c", reach]), capture_output=True, text=True)
        assert "ConnectionRefusedError" in refused.stderr  # an answer from 10.79.1.3 (no listener), not a timeout
    assert not set(net.namespaces) & set(netns.existing()) and "gs-stbrt" not in bridges()
    with pytest.raises(RuntimeError), netns.star("gs-st", "10.79.1", 2, tag="u") as net:
        raise RuntimeError("boom")
    assert not set(net.namespaces) & set(netns.existing()) and "gs-stbru" not in bridges()
