"""Maps and the releases they cover: version ranges, the nearest map, and checking a map's hooks
against the installed SGLang's sources (module, class, method, arguments by name and position)."""

import copy
import dataclasses
import os
import sys

import pytest

from kvdoctor.probe.core.verify import argument_problem, check_map, module_source
from kvdoctor.probe.maps.loader import available_maps, map_for, maps_by_nearness
from kvdoctor.probe.maps.versions import VersionRange, version_key


def test_version_order_follows_releases():
    ordered = ["0.5.9", "0.5.10rc1", "0.5.10", "0.5.10.post1", "0.5.11", "0.5.22", "0.5.23"]
    keys = [version_key(v) for v in ordered]
    assert keys == sorted(keys)
    assert version_key("not a version") is None


@pytest.mark.parametrize(
    "spec,inside,outside",
    [
        (">=0.5.10,<0.5.16", ["0.5.10", "0.5.13.post1", "0.5.15.post1"], ["0.5.9", "0.5.16", "0.5.23"]),
        (["0.5.9"], ["0.5.9"], ["0.5.9.post1", "0.5.10"]),
        ("==0.5.23", ["0.5.23"], ["0.5.22"]),
    ],
)
def test_version_ranges(spec, inside, outside):
    covered = VersionRange(spec)
    assert all(v in covered for v in inside)
    assert not any(v in covered for v in outside)


def test_an_unreadable_range_is_refused():
    with pytest.raises(ValueError, match="unreadable version range"):
        VersionRange(">=0.5.10;<0.6")


def test_tested_and_nearest_maps():
    assert map_for("sglang", "0.5.23").source == "sglang-0.5.23.toml"
    assert map_for("sglang", "0.5.24") is None
    assert maps_by_nearness("sglang", "0.5.24")[0].source == "sglang-0.5.23.toml"
    assert maps_by_nearness("sglang", "0.5.8")[0].source == "sglang-0.5.9.toml"


@pytest.mark.parametrize(
    "release,source",
    [
        ("0.5.1.post3", "sglang-0.5.1.toml"),
        ("0.5.3.post1", "sglang-0.5.3.toml"),
        ("0.5.3.post2", "sglang-0.5.3.post2.toml"),
        ("0.5.8.post1", "sglang-0.5.3.post2.toml"),
        ("0.5.10.post1", "sglang-0.5.9.toml"),
        ("0.5.12.post1", "sglang-0.5.11.toml"),
        ("0.5.15.post1", "sglang-0.5.14.toml"),
        ("0.5.18", "sglang-0.5.17.toml"),
        ("0.5.20", "sglang-0.5.23.toml"),
    ],
)
def test_range_maps_meet_at_the_releases_that_moved_code(release, source):
    assert map_for("sglang", release).source == source


def test_no_release_is_covered_by_two_maps():
    from kvdoctor.probe.maps.releases import releases

    for entry in releases("sglang"):
        covering = [m.source for m in available_maps("sglang") if m.covers(entry.version)]
        # 0.5.0 was published only as release candidates, older than every map's range
        assert len(covering) == (0 if entry.version.startswith("0.5.0rc") else 1), (entry.version, covering)


def test_what_ci_did_with_a_release_follows_same_mem_cache():
    from kvdoctor.probe.maps.releases import ci_sentence

    assert ci_sentence("sglang", "0.5.13.post1") == "tested in CI (as 0.5.13, the same mem_cache/)"
    assert ci_sentence("sglang", "0.5.1.post2").startswith("not tested in CI: its sglang/srt/utils.py calls torch._C._cpu")
    assert ci_sentence("sglang", "0.5.99") == ""


def _installed_map():
    return copy.deepcopy(map_for("sglang", "0.5.23"))


def test_every_hook_of_the_tested_map_resolves_in_the_installed_sources():
    check = check_map(_installed_map())
    assert check.unresolved == [] and len(check.hooks) == 80


def test_every_map_from_0_5_14_watches_the_graph_runners_and_the_hybrid_controller():
    """From 0.5.14 a graph replays through a runner's execute(), and from 0.5.19 every HiCache server's
    controller is HybridCacheController, whose load/write never reach HiCacheController's: without
    both, graph_replay_during_load and graph-guard see nothing (issue #31)."""
    for probe_map in available_maps("sglang"):
        hooks = {f"{c.cls}.{m}": r for c in probe_map.classes for m, r in c.methods.items()}
        graph = {hook for hook, role in hooks.items() if role in ("graph_replay", "graph_execute")}
        if version_key(probe_map.versions.anchor()) < version_key("0.5.14"):
            assert graph == {"CudaGraphRunner.replay"}, probe_map.source
            # replay(forward_batch, ...) from 0.5.2: the batch is named (0.5.1 is not installed to check)
            expected = "graph_replay" if probe_map.source == "sglang-0.5.1.toml" else "graph_execute"
            assert hooks["CudaGraphRunner.replay"] == expected, probe_map.source
            continue
        for runner in ("DecodeCudaGraphRunner", "PrefillCudaGraphRunner", "EAGLEDraftCudaGraphRunner", "EAGLEDraftExtendCudaGraphRunner"):
            assert hooks.get(f"{runner}.execute") == "graph_execute", (probe_map.source, runner)
        assert hooks.get("HybridCacheController.load") == "hicache_load", probe_map.source
        assert hooks.get("HybridCacheController.write") == "hicache_write", probe_map.source


def test_the_graph_runner_role_reads_the_forward_batch_where_0_5_23_passes_it():
    """Each 0.5.23 runner's execute names its batch `forward_batch`, first after self: the role's
    reads agree with the installed sources, by position and by name (a moved one is named)."""
    probe_map = _installed_map()
    decode = next(c for c in probe_map.classes if c.cls == "DecodeCudaGraphRunner")
    decode.args["execute"] = {"forward_batch": 1}
    (bad,) = check_map(probe_map).unresolved
    assert bad.hook == "DecodeCudaGraphRunner.execute" and "argument 'forward_batch' is at position 0, not 1" in bad.problem
    assert bad.ledger == "hicache"


def test_a_renamed_method_switches_its_ledger_off_and_names_the_hook():
    probe_map = _installed_map()
    tree = next(c for c in probe_map.classes if c.cls == "RadixCache")
    tree.methods["insert_renamed"] = tree.methods.pop("insert")
    check = check_map(probe_map)
    assert [(h.hook, h.problem) for h in check.unresolved] == [("RadixCache.insert_renamed", "RadixCache defines no insert_renamed")]
    assert list(check.ledgers_off()) == ["slots"]


def test_a_moved_argument_is_named_with_where_it_is_now():
    probe_map = _installed_map()
    paged = next(c for c in probe_map.classes if c.cls == "PagedTokenToKVPoolAllocator")
    paged.args["alloc_extend"] = {"last_loc": 1}
    check = check_map(probe_map)
    (bad,) = check.unresolved
    assert bad.hook == "PagedTokenToKVPoolAllocator.alloc_extend" and "argument 'last_loc' is at position 4, not 1" in bad.problem


def test_a_module_or_class_that_moved_is_named():
    probe_map = _installed_map()
    probe_map.classes[0] = dataclasses.replace(probe_map.classes[0], module="sglang.srt.mem_cache.no_such_module")
    probe_map.classes[1] = dataclasses.replace(probe_map.classes[1], cls="NoSuchAllocator")
    problems = {h.problem for h in check_map(probe_map).unresolved}
    assert "module sglang.srt.mem_cache.no_such_module not found" in problems
    assert any(p.startswith("class NoSuchAllocator not defined in") for p in problems)


def test_argument_problems():
    assert argument_problem(["prefix_lens", "seq_lens", "last_loc"], {"last_loc": 2}) == ""
    assert argument_problem(["a", "b"], {"last_loc": 4}) == "no argument 'last_loc' (positions: a, b)"
    assert argument_problem(["a"], {"x": 3}, has_varargs=True) == ""


def test_module_source_finds_files_without_importing_them():
    before = set(sys.modules)
    path = module_source("sglang.srt.mem_cache.radix_cache")
    assert path and path.endswith(os.path.join("sglang", "srt", "mem_cache", "radix_cache.py"))
    assert module_source("sglang.srt.mem_cache.allocator").endswith(os.path.join("allocator", "__init__.py"))
    assert module_source("sglang.srt.no_such") is None
    assert not {m for m in set(sys.modules) - before if m.startswith("sglang.srt")}


def test_every_shipped_map_reads_its_ranges():
    for probe_map in available_maps():
        assert str(probe_map.versions)


def test_every_sglang_map_hooks_the_prefill_row_writer_or_says_it_cannot():
    """A map that hooks no `write_cache_indices` (role `req_write_extend`) names where its releases
    launch the prefill rows' kernel in place, so that a device table's ledger is not judged (#24)."""
    for probe_map in available_maps("sglang"):
        hooked = any(f.role == "req_write_extend" for f in probe_map.functions)
        assert hooked != bool(probe_map.prefill_rows_unhooked), probe_map.source
        if not hooked:
            assert "write_req_to_token_pool_triton" in probe_map.prefill_rows_unhooked, probe_map.source
    assert {m.source for m in available_maps("sglang") if m.prefill_rows_unhooked} == {
        "sglang-0.5.1.toml",
        "sglang-0.5.2.toml",
        "sglang-0.5.3.toml",
    }


def _engine_file(tmp_path, body):
    path = tmp_path / "demo.toml"
    path.write_text('engine = "demo"\n[maps]\n"demo-1.0.toml" = ">=1.0,<1.2"\n"demo-1.2.toml" = ">=1.2,<=1.3"\n' + body)
    return str(path)


def test_one_engine_file_gives_a_map_per_range_with_the_hooks_that_hold_there(tmp_path):
    from kvdoctor.probe.maps.loader import load_maps

    body = """
[[classes]]
module = "m"
class = "Pool"
kind = "requests"
index_attr = [{ value = "idx", until = "1.2" }, { value = "kv.idx", since = "1.2" }]
[classes.methods]
alloc = [{ role = "req_alloc_count", until = "1.2" }, { role = "req_alloc", since = "1.2" }]
free_rows = { role = "req_free_rows", since = "1.2" }
[classes.args]
alloc.n = { value = 2, until = "1.2" }

[[functions]]
module = "m"
function = "old_home"
role = "last_loc_source"
until = "1.2"
"""
    old, new = load_maps(_engine_file(tmp_path, body))
    assert (old.source, str(old.versions), new.source, str(new.versions)) == ("demo-1.0.toml", ">=1.0,<1.2", "demo-1.2.toml", ">=1.2,<=1.3")
    assert old.classes[0].methods == {"alloc": "req_alloc_count"} and old.classes[0].args == {"alloc": {"n": 2}}
    assert new.classes[0].methods == {"alloc": "req_alloc", "free_rows": "req_free_rows"} and new.classes[0].args == {}
    assert (old.classes[0].options, new.classes[0].options) == ({"index_attr": "idx"}, {"index_attr": "kv.idx"})
    assert [f.function for f in old.functions] == ["old_home"] and new.functions == []


def test_a_bound_inside_a_range_is_refused_with_the_hook_named(tmp_path):
    """A since/until must be where a map's range starts: one inside a range would give the map a
    hook for part of its releases only."""
    from kvdoctor.probe.maps.loader import load_maps

    body = '[[classes]]\nmodule = "m"\nclass = "Pool"\nkind = "tree"\nsince = "1.1"\n[classes.methods]\ninsert = "tree_insert"\n'
    with pytest.raises(ValueError, match=r"demo.toml: Pool \(m\): '1.1' is not where one of its \[maps\] ranges starts"):
        load_maps(_engine_file(tmp_path, body))


def test_a_source_checkout_with_nothing_installed_finds_its_maps(tmp_path):
    """Where kvdoctor runs from its sources on PYTHONPATH (the GPU machine's copy; no install, so no
    `kvdoctor.probes` package data): the maps are `probes/` beside the package, whatever floor of
    the probe the loader lives on. Run without site-packages, so no editable install can answer."""
    import subprocess

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    program = (
        f"import sys; sys.path.insert(0, {repo!r})\n"
        "from kvdoctor.probe.maps.loader import maps_dir, available_maps\n"
        "print(maps_dir()); print(len(available_maps('sglang')), len(available_maps('vllm')))\n"
    )
    run = subprocess.run([sys.executable, "-S", "-c", program], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    where, counts = run.stdout.split("\n")[:2]
    assert where == os.path.join(repo, "probes")
    assert [int(n) for n in counts.split()] == [len(available_maps("sglang")), len(available_maps("vllm"))]
