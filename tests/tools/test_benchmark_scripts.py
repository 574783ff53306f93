"""The stand-alone benchmark scripts still run (tiny sizes; nothing timed, nothing asserted on speed)."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_chunked_memory_quick_run(capfd):
    load("chunked_memory").main(["--quick"])
    out = capfd.readouterr().out
    assert "Chunked(4)" in out and "gradsync no_sync" in out


def test_hook_accuracy_writes_a_table(tmp_path):
    load("hook_accuracy").main(["--steps", "3", "--out", str(tmp_path)])
    (report,) = tmp_path.glob("hook-accuracy-*.md")
    rows = {line.split("|")[1].strip(): line for line in report.read_text().splitlines()
            if line.startswith("| ") and line.split("|")[1].strip() != "hook"}
    assert float(rows["none (fp32 all-reduce)"].split("|")[2]) == 0.0
    for name in ("fp16_compress_hook", "bf16_compress_hook"):
        error = float(rows[name].split("|")[2])
        assert 0 < error < 1e-2, (name, error)  # compression costs a little precision, not more


def test_sharded_memory_quick_run():
    # a subprocess: the script re-executes itself to set glibc's mmap threshold before start-up
    env = dict(os.environ, PYTHONPATH=str(BENCHMARKS.parent / "src"))
    done = subprocess.run([sys.executable, str(BENCHMARKS / "sharded_memory.py"), "--quick"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert len(table) == 6 and all("(c) sharded, sync_each_batch" in table[i] for i in (2, 5))


def test_bf16_accuracy_quick_run(tmp_path):
    record = load("bf16_accuracy").main(["--ranks", "2", "--accumulation", "4", "--windows", "1",
                                         "--loss-steps", "0", "--out", str(tmp_path)])
    errors = {r["row"][:3]: r["accumulation_error"] for r in record["rows"]}
    assert errors["(c)"] * 100 <= errors["(a)"] and (tmp_path / "bf16_accuracy.md").exists()


def run_script(name, tmp_path):
    # a subprocess: the scripts import their neighbour benchmarks/paired.py
    env = dict(os.environ, PYTHONPATH=str(BENCHMARKS.parent / "src"))
    done = subprocess.run([sys.executable, str(BENCHMARKS / f"{name}.py"), "--quick", "--accum", "1",
                           "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    return (tmp_path / f"{name}.md").read_text()


def test_header_cost_quick_run(tmp_path):
    table = [line for line in run_script("header_cost", tmp_path).splitlines() if line.startswith("| mlp-tiny")]
    assert len(table) == 2  # with and without buffers


def test_overlap_optimizer_quick_run(tmp_path):
    report = run_script("overlap_optimizer", tmp_path)
    assert "gradsync views + overlap" in report and report.count("| gpt-tiny | 1 |") == 1


def test_auto_cap_quick_run(tmp_path):
    report = run_script("auto_cap", tmp_path)
    record = json.loads((tmp_path / "auto_cap.json").read_text())
    choice = record["rows"][0]["choice"]
    # gpt-tiny fits one bucket at every candidate cap: chosen without timing
    assert choice is not None and choice["bucket_cap_mb"] == choice["default_mb"] and choice["measured_ms"] == {}
    assert report.count("| gpt-tiny | 1 |") == 1 and "gradsync auto" in report


def test_compile_bench_quick_run(tmp_path):
    report = run_script("compile_bench", tmp_path)
    assert report.count("| gpt-tiny | 1 |") == 1 and "| mlp-tiny | 25 | gradsync+compile |" in report


def test_many_params_quick_run(tmp_path):
    report = run_script("many_params", tmp_path)
    record = json.loads((tmp_path / "many_params.json").read_text())
    (row,) = record["rows"]
    assert set(row["paired_ratio"]) == {"torch", "torch-views", "gradsync", "gradsync-copy", "gradsync-acc"}
    assert report.count("| blocks-4x(16+ln) | 1 |") == 2  # medians, then ratios with their spread
    assert "gradsync / torch" in report and "gradsync-acc / torch CPU" in report


def test_scaling_quick_run(tmp_path):
    report = run_script("scaling", tmp_path)
    record = json.loads((tmp_path / "scaling.json").read_text())
    assert [r["world"] for r in record["rows"]] == [1, 2, 4] and report.count("| mlp-tiny | 4 |") == 2
    one, two = record["rows"][0]["sent_per_rank"], record["rows"][1]["sent_per_rank"]
    assert all(v == 0 for v in one.values())  # one rank sends nothing
    for hook in ("gradsync bf16_compress_hook", "gradsync bf16_wire_hook"):  # bf16 on the wire
        assert 0 < two[hook] < two["gradsync"]


def test_sharded_prefetch_quick_run(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(BENCHMARKS.parent / "src"))
    done = subprocess.run([sys.executable, str(BENCHMARKS / "sharded_prefetch.py"), "--quick", "--accum", "2",
                           "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads((tmp_path / "sharded_prefetch-quick.json").read_text())["rows"]
    assert row["param_sums"]["sharded-prefetch"] == row["param_sums"]["sharded"]  # same training, only earlier
    assert (tmp_path / "sharded_prefetch-quick.md").read_text().count("| mlp-tiny | 2 |") == 1


def test_before_after_quick_run(tmp_path):
    # a subprocess: the script imports the baseline commit's package as gradsync_base
    if subprocess.run(["git", "-C", str(BENCHMARKS.parent), "cat-file", "-e", "7a4ad5f^{commit}"]).returncode:
        pytest.skip("the baseline commit is not in this checkout's history")
    env = dict(os.environ, PYTHONPATH=str(BENCHMARKS.parent / "src"))
    done = subprocess.run([sys.executable, str(BENCHMARKS / "before_after.py"), "--quick", "--accum", "1",
                           "--models", "mlp-tiny", "--runs", "2", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((tmp_path / "redesign_before_after-quick.json").read_text())
    assert sorted((r["group"], r["run"]) for r in record["rows"]) == [(g, run) for g in ("acc", "ddp", "sharded")
                                                                         for run in (1, 2)]
    assert record["code"]["before_file"] != record["code"]["after_file"]  # two different packages were timed
    for row in record["rows"]:  # the A/A pair trains identically (same code, same data): nothing about speed
        again = {"ddp": "before-again", "sharded": "sharded-before-again", "acc": "acc-before-again"}[row["group"]]
        assert row["max_param_diff"][again] == 0
    report = (tmp_path / "redesign_before_after-quick.md").read_text()
    assert report.count("| mlp-tiny | 1 | ddp |") == 3 and "## Do the runs agree?" in report  # 2 runs + agreement


def elastic_script(tmp_path, script, *args, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(BENCHMARKS.parent / "src"))
    return subprocess.run([sys.executable, str(BENCHMARKS / script), "--out", str(tmp_path), *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_elastic_soak_short_run(tmp_path):
    """The soak's own checks pass on a short run: two kills, two rejoins, nothing seen twice, exact."""
    done = elastic_script(tmp_path, "elastic_soak.py", "--samples", "1500", "--sleep", "0.2", "--name", "soak")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    figures = json.loads((tmp_path / "soak.json").read_text())
    assert len(figures["kills"]) >= 1 and len(figures["join_pause_s"]) >= 1  # how many: the machine's load decides
    assert figures["identical"] and figures["max_abs_diff"] <= 1e-5 and figures["lost_matches"]
    assert figures["processed"] == figures["distinct_processed"]


@pytest.mark.slow
def test_elastic_soak_on_two_network_namespaces(tmp_path):
    if os.geteuid() != 0 or subprocess.run(["ip", "netns", "list"], capture_output=True).returncode:
        pytest.skip("needs root and ip netns")
    done = elastic_script(tmp_path, "elastic_soak.py", "--namespaces", "--samples", "4000", "--sleep", "0.2",
                          "--name", "ns", timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    figures = json.loads((tmp_path / "ns.json").read_text())
    assert figures["machine_kill"] and figures["identical"] and figures["lost_matches"]
    assert figures["members"] == [0, 1, 4, 5] or len(figures["members"]) == 4


@pytest.mark.slow
def test_elastic_recovery_quick_run(tmp_path):
    done = elastic_script(tmp_path, "elastic_recovery.py", "--kills", "2", "--pairs", "1", "--name", "er")
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads((tmp_path / "er.json").read_text())
    assert len(data["kills"]) == 2 and all(k["latency_s"] < 30 for k in data["kills"])


def test_noise_scale_cost_quick_run(tmp_path):
    done = elastic_script(tmp_path, "noise_scale_cost.py", "--reps", "2", "--warmup", "0", "--runs", "1",
                          "--accum", "2", "--width", "64", "--stem", "ns")
    assert done.returncode == 0, done.stderr[-2000:]
    (run,) = json.loads((tmp_path / "ns.json").read_text())
    assert set(run["median_ms"]) == {"off", "off-again", "noise_scale"} and len(run["noise_ratios"]) == 2


def test_cluster_quick_run(tmp_path):
    """benchmarks/cluster.py: 2 ranks in network namespaces over a rate-limited veth where this runs as
    root (loopback otherwise), then a many-parameter model on loopback; the namespaces are gone after."""
    env = dict(os.environ, PYTHONPATH=str(BENCHMARKS.parent / "src"))
    done = subprocess.run([sys.executable, str(BENCHMARKS / "cluster.py"), "--quick", "--accum", "1", "--out",
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads((tmp_path / "cluster.json").read_text())
    assert [(r["model"], r["accum"]) for r in record["rows"]] == [("device-tiny", 1), ("many-tiny", 1)]
    assert record["rows"][0]["link"].startswith("veth" if record["namespaces"] else "loopback")
    assert record["rows"][1]["link"] == "loopback" and len(record["load_before"]) == 3
    for row in record["rows"]:
        names = set(row["times"])
        assert {"torch", "torch A/A", "gradsync", "gradsync auto", "gradsync auto bf16_wire", "compute",
                "all-reduce"} <= names and all(len(t) == record["reps"] for t in row["times"].values())
        assert len(row["limit"]) == record["reps"] and row["choice"]["gradsync auto"] is not None
        assert {"auto / torch", "auto / torch best", "auto / limit", "bf16_wire / auto", "A/A"} <= set(
            row["summary"]["ratio"])
    report = (tmp_path / "cluster.md").read_text()
    assert "| device-tiny |" in report and "| many-tiny | loopback | 1 |" in report
    if record["namespaces"]:
        left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert f"gs-clu-a{record['netns_tag']}" not in left and f"gs-clu-b{record['netns_tag']}" not in left
