"""The benchmark scripts still run (tiny sizes; nothing timed, nothing asserted on speed), and the suite
keeps its shape: folders by question, one harness, no private gradsync names, no script importing another."""
import ast
import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gradsync.tools.bench import netns

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name.replace('/', '_')}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_chunked_memory_quick_run(capfd):
    load("memory/chunked").main(["--quick"])
    out = capfd.readouterr().out
    assert "Chunked(4)" in out and "gradsync no_sync" in out


def test_elastic_memory_quick_run(capfd):
    load("elastic/memory").main(["--quick", "--only", "fp32, gradient_as_bucket_view, elastic", "--only", "fp32"])
    rows = [line.split("|") for line in capfd.readouterr().out.splitlines() if line.startswith("| fp32")]
    assert [(r[1].strip(), r[2].strip()) for r in rows] == [("fp32, gradient_as_bucket_view, elastic", "yes"),
                                                            ("fp32", "no")]
    assert float(rows[0][5]) > 0 and float(rows[1][5]) == 0  # the staged copies: only where the window is the bucket


def test_hook_accuracy_writes_a_table(tmp_path):
    load("accuracy/hooks").main(["--steps", "3", "--out", str(tmp_path)])
    (report,) = tmp_path.glob("accuracy-hooks-*cpu-*.md")
    assert len(json.loads(next(tmp_path.glob("accuracy-hooks-*.json")).read_text())["rows"]) == 3
    rows = {line.split("|")[1].strip(): line for line in report.read_text().splitlines()
            if line.startswith("| ") and line.split("|")[1].strip() != "hook"}
    assert float(rows["none (fp32 all-reduce)"].split("|")[2]) == 0.0
    for name in ("fp16_compress_hook", "bf16_compress_hook"):
        error = float(rows[name].split("|")[2])
        assert 0 < error < 1e-2, (name, error)  # compression costs a little precision, not more


def test_sharded_memory_quick_run():
    # a subprocess: the script re-executes itself to set glibc's mmap threshold before start-up
    env = dict(os.environ, PYTHONPATH=str(BENCHMARKS.parent / "src"))
    done = subprocess.run([sys.executable, str(BENCHMARKS / "memory" / "sharded.py"), "--quick"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert len(table) == 6 and all("(c) sharded, sync_each_batch" in table[i] for i in (2, 5))


def test_bf16_accuracy_quick_run(tmp_path):
    record = load("accuracy/bf16").main(["--ranks", "2", "--accumulation", "4", "--windows", "1",
                                         "--loss-steps", "0", "--out", str(tmp_path)])
    errors = {r["row"][:3]: r["accumulation_error"] for r in record["rows"]}
    assert errors["(c)"] * 100 <= errors["(a)"] and (tmp_path / f"{record['stem']}.md").exists()
    assert record["stem"].startswith("accuracy-bf16-") and len(record["load_before"]) == 3


def record_of(tmp_path, scenario):
    """The one record a quick run wrote: its dated, self-explaining name, JSON and markdown."""
    (path,) = tmp_path.glob(f"{scenario}-*cpu-*-quick.json")
    assert re.fullmatch(rf"{scenario}-\d+cpu-\d{{4}}-\d\d-\d\d-quick\.json", path.name)
    return json.loads(path.read_text()), path.with_suffix(".md").read_text()


BOUND_S = 300  # a script run in this process: past it, SIGALRM ends it and run_ranks kills its ranks


@contextlib.contextmanager
def bounded(seconds: int = BOUND_S):
    """Bound an in-process script as a subprocess's timeout would (the tests run in the main thread)."""
    def expire(*_):
        raise TimeoutError(f"the script ran past {seconds}s")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_script(name, tmp_path, scenario):
    # in this process (the scripts' command line is main(argv); none needs a process of its own): a fresh
    # interpreter would import torch again, and its forked ranks torch._dynamo (conftest.py imported it here)
    with bounded():
        load(name).main(["--quick", "--accum", "1", "--out", str(tmp_path)])
    record, report = record_of(tmp_path, scenario)
    assert record["scenario"] == scenario and len(record["load_before"]) == len(record["load_after"]) == 3
    return report


def test_header_cost_quick_run(tmp_path):
    table = [line for line in run_script("speed/header_cost", tmp_path, "speed-header-cost").splitlines() if line.startswith("| mlp-tiny")]
    assert len(table) == 2  # with and without buffers


def test_overlap_optimizer_quick_run(tmp_path):
    report = run_script("speed/overlap_optimizer", tmp_path, "speed-overlap-optimizer")
    assert "gradsync views + overlap" in report and report.count("| gpt-tiny | 1 |") == 1


def test_auto_cap_quick_run(tmp_path):
    report = run_script("speed/auto_cap", tmp_path, "speed-auto-cap")
    record = record_of(tmp_path, "speed-auto-cap")[0]
    choice = record["rows"][0]["choice"]
    # gpt-tiny fits one bucket at every candidate cap: chosen without timing
    assert choice is not None and choice["bucket_cap_mb"] == choice["default_mb"] and choice["measured_ms"] == {}
    assert report.count("| gpt-tiny | 1 |") == 1 and "gradsync auto" in report


def test_compile_bench_quick_run(tmp_path):
    report = run_script("speed/compile_bench", tmp_path, "speed-compile")
    assert report.count("| gpt-tiny | 1 |") == 1 and "| mlp-tiny | 25 | gradsync+compile |" in report


def test_many_params_quick_run(tmp_path):
    report = run_script("speed/many_params", tmp_path, "speed-many-params")
    record = record_of(tmp_path, "speed-many-params")[0]
    (row,) = record["rows"]
    assert set(row["paired_ratio"]) == {"torch", "torch-views", "gradsync", "gradsync-copy", "gradsync-acc"}
    assert report.count("| blocks-4x(16+ln) | 1 |") == 2  # medians, then ratios with their spread
    assert "gradsync / torch" in report and "gradsync-acc / torch CPU" in report


def test_scaling_quick_run(tmp_path):
    report = run_script("speed/scaling", tmp_path, "speed-scaling")
    record = record_of(tmp_path, "speed-scaling")[0]
    assert [r["world"] for r in record["rows"]] == [1, 2, 4] and report.count("| mlp-tiny | 4 |") == 2
    one, two = record["rows"][0]["sent_per_rank"], record["rows"][1]["sent_per_rank"]
    assert all(v == 0 for v in one.values())  # one rank sends nothing
    for hook in ("gradsync bf16_compress_hook", "gradsync bf16_wire_hook"):  # bf16 on the wire
        assert 0 < two[hook] < two["gradsync"]


def test_sharded_prefetch_quick_run(tmp_path):
    with bounded():
        load("sharded/prefetch").main(["--quick", "--accum", "2", "--out", str(tmp_path)])
    record, report = record_of(tmp_path, "sharded-prefetch")
    (row,) = record["rows"]
    assert row["param_sums"]["sharded-prefetch"] == row["param_sums"]["sharded"]  # same training, only earlier
    assert report.count("| mlp-tiny | 2 |") == 1


def test_before_after_quick_run(tmp_path):
    # a subprocess: the script imports the baseline commit's package as gradsync_base
    if subprocess.run(["git", "-C", str(BENCHMARKS.parent), "cat-file", "-e", "7a4ad5f^{commit}"]).returncode:
        pytest.skip("the baseline commit is not in this checkout's history")
    env = dict(os.environ, PYTHONPATH=str(BENCHMARKS.parent / "src"))
    done = subprocess.run([sys.executable, str(BENCHMARKS / "speed" / "before_after.py"), "--quick", "--accum", "1",
                           "--models", "mlp-tiny", "--runs", "2", "--out", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    record, report = record_of(tmp_path, "speed-before-after")
    assert sorted((r["group"], r["run"]) for r in record["rows"]) == [(g, run) for g in ("acc", "ddp", "sharded")
                                                                         for run in (1, 2)]
    assert record["code"]["before_file"] != record["code"]["after_file"]  # two different packages were timed
    for row in record["rows"]:  # the A/A pair trains identically (same code, same data): nothing about speed
        again = {"ddp": "before-again", "sharded": "sharded-before-again", "acc": "acc-before-again"}[row["group"]]
        assert row["max_param_diff"][again] == 0
    assert report.count("| mlp-tiny | 1 | ddp |") == 3 and "## Do the runs agree?" in report  # 2 runs + agreement


def elastic_script(tmp_path, script, *args, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(BENCHMARKS.parent / "src"))
    return subprocess.run([sys.executable, str(BENCHMARKS / script), "--out", str(tmp_path), *args], env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_elastic_soak_short_run(tmp_path):
    """The soak's own checks pass on a short run: two kills, two rejoins, nothing seen twice, exact."""
    done = elastic_script(tmp_path, "elastic/soak.py", "--samples", "1150", "--sleep", "0.2", "--name", "soak")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    figures = json.loads((tmp_path / "soak.json").read_text())
    assert len(figures["kills"]) >= 1 and len(figures["join_pause_s"]) >= 1  # how many: the machine's load decides
    assert figures["identical"] and figures["max_abs_diff"] <= 1e-5 and figures["lost_matches"]
    assert figures["processed"] == figures["distinct_processed"]


@pytest.mark.slow
def test_elastic_soak_on_two_network_namespaces(tmp_path):
    if os.geteuid() != 0 or subprocess.run(["ip", "netns", "list"], capture_output=True).returncode:
        pytest.skip("needs root and ip netns")
    done = elastic_script(tmp_path, "elastic/soak.py", "--namespaces", "--samples", "4000", "--sleep", "0.2",
                          "--name", "ns", timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    figures = json.loads((tmp_path / "ns.json").read_text())
    assert figures["machine_kill"] and figures["identical"] and figures["lost_matches"]
    assert figures["members"] == [0, 1, 4, 5] or len(figures["members"]) == 4


@pytest.mark.slow
def test_elastic_recovery_quick_run(tmp_path):
    done = elastic_script(tmp_path, "elastic/recovery.py", "--kills", "2", "--pairs", "1", "--name", "er")
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads((tmp_path / "er.json").read_text())
    assert len(data["kills"]) == 2 and all(k["latency_s"] < 30 for k in data["kills"])


def test_elastic_in_job_quick_run(tmp_path):
    """benchmarks/elastic/in_job.py: the sharded model built elastic, plain and mirrored in one job, paired."""
    record = tmp_path / "record.md"
    record.write_text("# a record\n")
    done = elastic_script(tmp_path, "elastic/in_job.py", "--rounds", "4", "--warmup", "1", "--append", str(record))
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split(" | ") for line in record.read_text().splitlines() if line.startswith("| ") and "ms" not in line]
    assert [r[0] for r in rows] == ["| plain", "| elastic", "| mirrored"], record.read_text()
    assert rows[0][2].startswith("1.000") and all(float(r[1]) > 0 for r in rows)


def test_noise_scale_cost_quick_run(tmp_path):
    with bounded():
        load("speed/noise_scale_cost").main(["--reps", "2", "--warmup", "0", "--runs", "1", "--accum", "2",
                                             "--width", "64", "--name", "ns", "--out", str(tmp_path)])
    (run,) = json.loads((tmp_path / "ns.json").read_text())["runs"]
    assert set(run["median_ms"]) == {"off", "off-again", "noise_scale"} and len(run["noise_ratios"]) == 2


def test_cluster_quick_run(tmp_path):
    """benchmarks/speed/cluster.py: 2 ranks in network namespaces over a rate-limited veth where this runs as
    root (loopback otherwise), then a many-parameter model on loopback; the namespaces are gone after."""
    # its workers are processes of their own, ended by its --timeout
    load("speed/cluster").main(["--quick", "--accum", "1", "--timeout", str(BOUND_S), "--out", str(tmp_path)])
    record, report = record_of(tmp_path, "speed-cluster")
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
    assert "| device-tiny |" in report and "| many-tiny | loopback | 1 |" in report
    if record["namespaces"]:
        left = netns.existing()
        assert f"gs-clu-a{record['netns_tag']}" not in left and f"gs-clu-b{record['netns_tag']}" not in left


@pytest.mark.skipif(not netns.available(), reason="needs root, ip netns and tc")
def test_deterministic_on_a_link_quick_run(tmp_path):
    """benchmarks/speed/deterministic.py --link: 4 ranks, each alone in a namespace, on one bridge (so their
    collectives can only cross the veths), the namespaces gone after."""
    with bounded():
        load("speed/deterministic").main(["--quick", "--world", "4", "--link", "100mbit", "--accum", "1",
                                          "--out", str(tmp_path)])
    record, report = record_of(tmp_path, "speed-deterministic-link")
    assert record["world"] == 4 and [(r["model"], r["accum"]) for r in record["rows"]] == [("device-tiny", 1)]
    assert set(record["rows"][0]["paired_ratio"]) == {"default", "deterministic", "default A/A"}
    assert "behind a 100mbit veth" in report
    assert not [ns for ns in netns.existing() if ns.startswith("gsdet-")]
    lines = load("speed/gloo_collectives").main(["6144", "3", "1", "100mbit"])  # 6144: W divides it
    assert "3 gloo ranks, 100mbit veths" in lines[0] and len(lines) > 8
    assert not [ns for ns in netns.existing() if ns.startswith("gsglo-")]


def test_gloo_collectives_quick_run(capfd):
    lines = load("speed/gloo_collectives").main(["4096", "2", "1"])
    assert lines[0].startswith("| collective") and any("reduce_scatter_single" in line for line in lines)


def test_sharded_breakdown_quick_run(tmp_path):
    out = tmp_path / "breakdown.json"
    for label in ("before", "after"):  # labels accumulate in one record, a column each
        load("sharded/breakdown").main(["--quick", "--label", label, "--out", str(out)])
    record = json.loads(out.read_text())
    assert set(record["runs"]) == {"before", "after"}
    phases = record["runs"]["after"][0]["results"]["mlp-tiny"][0]
    assert phases["  copy into staging"] > 0 and phases["  launch (divide, issue; folds beyond max_inflight)"] > 0
    assert "| phase (ms, rank 0) |" in out.with_suffix(".md").read_text()


def test_sharded_knobs_quick_run():
    lines = load("sharded/knobs").main(["--quick"])
    assert len(lines) == 2 + 5 and lines[-1].startswith("| FSDP2")  # header, 4 knob settings and FSDP2


# ---------------------------------------------------------------- the suite's shape
QUESTIONS = ("speed", "sharded", "memory", "accuracy", "elastic")


def scripts() -> list[Path]:
    return sorted(p for p in BENCHMARKS.rglob("*.py") if "results" not in p.parts)


def test_scripts_live_in_folders_named_for_their_question():
    top = [p.name for p in BENCHMARKS.glob("*.py")]
    assert len(top) <= 3, top
    assert {p.parent.name for p in scripts() if p.parent != BENCHMARKS} <= set(QUESTIONS)


def test_no_script_imports_another_or_a_private_gradsync_name():
    names = {p.stem for p in scripts()}
    for path in scripts():
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert node.module.split(".")[0] not in names, f"{path}: imports script {node.module}"
                if node.module.startswith("gradsync"):
                    assert not [a.name for a in node.names if a.name.startswith("_")], f"{path}: {node.module}"
            if isinstance(node, ast.Import):
                assert not {a.name.split(".")[0] for a in node.names} & names, f"{path} imports a script"
        assert not re.search(r"\bgradsync(\.\w+)*\._[a-z]", text), f"{path}: a private gradsync name"
        assert not re.search(r"\b(measure|harness|bench)\._[a-z]", text), f"{path}: a private harness name"
        assert "gradsync.core" not in text and "gradsync.layers" not in text, f"{path}: the package's old layout"


def test_results_are_few_dated_and_indexed():
    files = sorted(p.name for p in (BENCHMARKS / "results").iterdir() if p.name != "traces")  # git-ignored
    assert len(files) <= 60, len(files)
    dated = re.compile(r"[a-z0-9.-]+-(\d{4}-\d\d-\d\d|\d{8}-\d{4})(-[a-z0-9.-]+)?\.(md|json|png)")
    assert not [f for f in files if not dated.fullmatch(f)], "undated or unexplained names"
    index = (BENCHMARKS / "README.md").read_text()
    for path in scripts():
        assert str(path.relative_to(BENCHMARKS)) in index, f"benchmarks/README.md does not list {path.name}"
    linked = re.findall(r"\]\((results/[^)#]+)\)", index)
    assert linked and not [f for f in linked if not (BENCHMARKS / f).exists()]


def test_docs_link_only_results_that_exist():
    root = BENCHMARKS.parent
    for doc in [root / "README.md", *sorted((root / "docs").glob("*.md")), root / "src/gradsync/tools/bench/docs.py"]:
        for name in re.findall(r"benchmarks/results/([\w.-]+\.(?:md|json|png))", doc.read_text()):
            assert (BENCHMARKS / "results" / name).exists(), f"{doc.name} links {name}"


def test_an_in_process_script_that_overstays_is_ended():
    import time
    with pytest.raises(TimeoutError, match="ran past 1s"), bounded(1):
        time.sleep(10)
