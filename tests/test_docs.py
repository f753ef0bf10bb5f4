"""The README and docs/ point at files and sections that exist."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + [os.path.join("docs", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs"))) if f.endswith(".md")]


def _anchors(path: str) -> set[str]:
    """GitHub's anchors of a markdown file's headings (lower case, punctuation dropped, spaces to '-')."""
    with open(path) as f:
        heads = [m.group(1) for m in re.finditer(r"^#+ (.+)$", f.read(), re.M)]
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("doc", DOCS)
def test_links_resolve(doc):
    path = os.path.join(ROOT, doc)
    with open(path) as f:
        text = re.sub(r"```.*?```", "", f.read(), flags=re.S)  # code blocks hold commands, not links
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        target, _, anchor = link.partition("#")
        full = os.path.normpath(os.path.join(os.path.dirname(path), target)) if target else path
        assert os.path.exists(full), f"{doc}: {link} (no file {os.path.relpath(full, ROOT)})"
        if anchor and full.endswith(".md"):
            assert anchor in _anchors(full), f"{doc}: {link} (no heading with anchor #{anchor})"


def test_quickstart_example_runs():
    # examples/quickstart.py (the README's API in one file) runs and its three modes train. On a CPU erase
    # runs sequentially, so its loss equals sequential's by construction: this checks the example, not
    # erase (tests/test_scheduler.py runs erase's ring path on fake streams; test_gpu.py on a GPU)
    import importlib.util
    import math

    spec = importlib.util.spec_from_file_location("quickstart", os.path.join(ROOT, "examples", "quickstart.py"))
    quickstart = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(quickstart)
    runs = quickstart.main(["--steps", "3", "--width", "32", "--batch", "64"])
    assert set(runs) == {"e2e", "sequential", "erase"}
    assert all(math.isfinite(r["loss"]) and 0 <= r["accuracy"] <= 1 for r in runs.values())
    assert runs["erase"]["loss"] == runs["sequential"]["loss"]
