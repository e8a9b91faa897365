"""The docs' supported-releases table (docs/supported.md) is the one `kvdoctor probes --table`
generates from the maps and the release list, so it cannot drift from what the matrix tests."""

import copy
import os

from kvdoctor.probe.core.verify import check_map
from kvdoctor.probe.maps.loader import map_for
from kvdoctor.runner.support import graph_replays_line, installed_line, markdown_table
from kvdoctor.trace.schema import SERVING_ENGINES

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BEGIN, END = "<!-- generated: probes-table -->\n", "\n<!-- end generated -->"


def test_the_docs_table_is_generated():
    page = open(os.path.join(REPO, "docs", "supported.md")).read()
    copy = page[page.index(BEGIN) + len(BEGIN) : page.index(END, page.index(BEGIN))]
    assert copy == "\n\n".join(markdown_table(engine) for engine in SERVING_ENGINES)


def test_the_table_names_why_a_release_is_not_run():
    table = markdown_table("sglang")
    row = [line for line in table.splitlines() if "sglang-0.5.1.toml" in line][0]
    assert "not run: 0.5.1, 0.5.1.post1, 0.5.1.post2, 0.5.1.post3" in row and "_is_amx_tile_supported" in row


def test_installed_line_for_the_environment_and_for_a_release_past_every_map(monkeypatch):
    assert installed_line("sglang") == "SGLang 0.5.23: map sglang-0.5.23.toml, 80/80 hooks resolve, tested in CI"
    monkeypatch.setenv("KVDOCTOR_SGLANG_VERSION", "0.5.99")
    assert installed_line("sglang") == (
        "SGLang 0.5.99: no map of its own; nearest sglang-0.5.23.toml, 80/80 hooks resolve, not in the release list"
    )


def test_probes_says_per_release_whether_graph_replays_are_watched():
    """Issue #31: the runners of 0.5.14 on are watched by their execute(); a map without a graph
    runner hook, or whose HiCache ledger is off in the sources installed, says it is not."""
    latest = map_for("sglang", "0.5.23")
    assert graph_replays_line(latest) == (
        "graph replays: watched (DecodeCudaGraphRunner.execute, PrefillCudaGraphRunner.execute, "
        "EAGLEDraftCudaGraphRunner.execute, EAGLEDraftExtendCudaGraphRunner.execute, "
        "FrozenKVMTPCudaGraphRunner.execute, MultiLayerEagleDraftExtendCudaGraphRunner.replay)"
    )
    assert graph_replays_line(map_for("sglang", "0.5.13")) == "graph replays: watched (CudaGraphRunner.replay)"
    bare = copy.deepcopy(latest)
    bare.classes = [c for c in bare.classes if c.kind != "graph_runner"]
    assert graph_replays_line(bare) == "graph replays: not watched: no graph runner hook in this map"
    moved = copy.deepcopy(latest)
    next(c for c in moved.classes if c.cls == "HybridCacheController").methods["load_renamed"] = "hicache_load"
    line = graph_replays_line(moved, check_map(moved))
    assert line.startswith("graph replays: not watched: the hicache ledger is off (HybridCacheController.load_renamed:")
    row = [r for r in markdown_table("sglang").splitlines() if "sglang-0.5.14.toml" in r][0]
    assert row.endswith(
        "`DecodeCudaGraphRunner.execute`, `PrefillCudaGraphRunner.execute`, "
        "`EAGLEDraftCudaGraphRunner.execute`, `EAGLEDraftExtendCudaGraphRunner.execute`, "
        "`FrozenKVMTPCudaGraphRunner.execute` |"
    )
