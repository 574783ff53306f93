"""The docs say what the code and the newest results say: generated numbers, torch keyword lists."""
import inspect
import json
import re
from pathlib import Path

import pytest
import torch

import gradsync
from gradsync.tools.bench import docs

ROOT = Path(__file__).resolve().parents[2]


def test_docs_show_the_newest_benchmark_results():
    stale = docs.stale(str(ROOT))
    assert not stale, f"{stale} differ from {docs.newest_results(str(ROOT / docs.RESULTS))}: " \
                      "run `python -m gradsync.tools.bench.docs` and commit the result"


def test_every_doc_has_generated_blocks():
    for doc in docs.DOCS:
        assert docs.BLOCK.search((ROOT / doc).read_text()), doc


def test_newest_results_is_the_latest_full_run(tmp_path):
    for name in ("bench-a-2cpu-20261122-0017.json", "bench-b-8cpu-20261201-0900.json",
                 "bench-a-2cpu-20261231-2359-quick.json", "bench-a-2cpu-20261122-0017.md"):
        (tmp_path / name).write_text("{}")
    assert Path(docs.newest_results(str(tmp_path))).name == "bench-b-8cpu-20261201-0900.json"
    with pytest.raises(FileNotFoundError):
        docs.newest_results(str(tmp_path / "missing"))


def test_unknown_block_names_the_known_ones():
    record = json.loads(Path(docs.newest_results(str(ROOT / docs.RESULTS))).read_text())
    with pytest.raises(KeyError, match="bench:nope.*known: accumulation"):
        docs.render("<!-- bench:nope -->\n<!-- bench:end -->\n", record, "x.md")


def readme_item(label: str) -> str:
    """The text of the README bullet that starts with **label** ("" if there is none)."""
    text = (ROOT / "README.md").read_text()
    m = re.search(r"^- \*\*" + re.escape(label) + r"(.*?)(?=^- |^\n)", text, re.M | re.S)
    return m.group(1) if m else ""


def names(text: str) -> set[str]:
    return set(re.findall(r"`(\w+)=?`", text))


def parameters(fn) -> set[str]:
    return set(inspect.signature(fn).parameters) - {"self"}


def test_readme_lists_torch_constructor_keywords_as_the_signatures_have_them():
    torch_kw = parameters(torch.nn.parallel.DistributedDataParallel.__init__)
    ours = parameters(gradsync.DistributedDataParallel.__init__)
    listed = {label: names(readme_item(label)) & torch_kw
              for label in ("Same meaning as torch", "Accepted, no effect", "Refused", "Not accepted yet")}
    assert torch_kw == set().union(*listed.values()), "every torch keyword is listed"
    assert sum(map(len, listed.values())) == len(torch_kw), "and only once"
    accepted = listed["Same meaning as torch"] | listed["Accepted, no effect"] | listed["Refused"]
    assert accepted <= ours, f"listed as accepted, not in the signature: {accepted - ours}"
    assert not listed["Not accepted yet"] & ours, f"accepted now: {listed['Not accepted yet'] & ours}"
    assert ours - torch_kw <= names(readme_item("gradsync's own")), "every keyword of our own is listed"


def test_readme_lists_torch_join_keywords_as_the_signatures_have_them():
    accepted, _, missing = readme_item("`join()`").partition(";")
    torch_kw = parameters(torch.nn.parallel.DistributedDataParallel.join)
    ours = parameters(gradsync.DistributedDataParallel.join)
    assert names(accepted) & torch_kw == ours & torch_kw
    assert names(missing) & torch_kw == torch_kw - ours
