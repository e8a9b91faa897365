"""The connector ledger's holds and the connector_held_blocks detector, without vLLM: a fake
scheduler through the probe's own state, and small synthetic event lists through the detector."""

from __future__ import annotations

from types import SimpleNamespace

from kvdoctor.analysis.analyzer import analyze
from kvdoctor.analysis.detectors.connector_held import MAX_GROUPS, ConnectorHeldDetector
from kvdoctor.probe.core.runtime import Probe
from kvdoctor.probe.engines.vllm.connector import AWAITING_REMOTE_KV, HELD_BY_CONNECTOR, MAX_HOLDS, ConnectorHolds, Finishing
from kvdoctor.trace import schema


class FakeManager:
    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        base = int(request_id.rsplit("-", 1)[-1]) * 3 + 1
        return ([base, base + 1, base + 2],)


class NixlLikeConnector:
    pass


def holds_with_deadline(monkeypatch, deadline: str) -> tuple[ConnectorHolds, list[schema.Event]]:
    monkeypatch.setenv("KVDOCTOR_CONNECTOR_DEADLINE_S", deadline)
    probe = Probe(None)
    events: list[schema.Event] = []
    probe.emitter.listeners.append(events.append)
    return ConnectorHolds(probe), events


SCHEDULER = SimpleNamespace(connector=NixlLikeConnector(), ec_connector=None, kv_cache_manager=FakeManager())


def test_a_hold_past_the_deadline_is_said_once_then_again_at_exit(monkeypatch):
    holds, events = holds_with_deadline(monkeypatch, "0")
    holds.begin(SCHEDULER, Finishing("req-1", scheduler_delay=False, connector_delay=True), "FINISHED_STOPPED")
    holds.check()
    holds.check()
    overdue = [e.args for e in events if e.name == schema.CONNECTOR_OVERDUE]
    assert len(overdue) == 1 and overdue[0]["holder"] == "NixlLikeConnector" and overdue[0]["reason"] == HELD_BY_CONNECTOR
    assert overdue[0]["block_ids"] == [4, 5, 6] and overdue[0]["blocks"] == 3 and overdue[0]["still_held_at"] == "deadline"
    holds.close(holds.probe, "exit")
    assert [e.args["still_held_at"] for e in events if e.name == schema.CONNECTOR_OVERDUE] == ["deadline", "exit"]
    assert holds.held_requests() == {"req-1"}


def test_a_hold_released_in_time_leaves_no_event(monkeypatch):
    holds, events = holds_with_deadline(monkeypatch, "480")
    holds.begin(SCHEDULER, Finishing("req-2", scheduler_delay=True), "FINISHED_ABORTED")
    assert holds.pending["req-2"].reason == AWAITING_REMOTE_KV
    holds.release("req-2")
    holds.close(holds.probe, "exit")
    assert [e.name for e in events if e.name.startswith("connector_")] == []
    assert holds.stats["connector_holds"] == holds.stats["connector_releases"] == 1 and holds.held_requests() == set()


def test_an_overdue_hold_released_at_last_says_so(monkeypatch):
    holds, events = holds_with_deadline(monkeypatch, "0")
    holds.begin(SCHEDULER, Finishing("req-3", scheduler_delay=False, connector_delay=True), "FINISHED_LENGTH_CAPPED")
    holds.check()
    holds.release("req-3")
    assert [e.name for e in events if e.name.startswith("connector_")] == [schema.CONNECTOR_OVERDUE, schema.CONNECTOR_LATE_RELEASE]


def test_holds_are_bounded(monkeypatch):
    holds, _ = holds_with_deadline(monkeypatch, "480")
    for i in range(MAX_HOLDS + 5):
        holds.begin(SCHEDULER, Finishing(f"r-{i}", scheduler_delay=False, connector_delay=True), "FINISHED_STOPPED")
    assert len(holds.pending) == MAX_HOLDS and holds.stats["connector_holds_untracked"] == 5


def test_an_unreadable_deadline_keeps_the_default(monkeypatch):
    holds, _ = holds_with_deadline(monkeypatch, "soon")
    assert holds.deadline_s == 480.0


def overdue(request: str, *, released: bool = False, final: bool = False, holder: str = "NeverFreeConnector") -> schema.Event:
    name = schema.CONNECTOR_LATE_RELEASE if released else schema.CONNECTOR_OVERDUE
    args = {
        "request": request,
        "holder": holder,
        "reason": HELD_BY_CONNECTOR,
        "status": "FINISHED_STOPPED",
        "blocks": 2,
        "block_ids": [7, 8],
        "held_since": "2026-11-24T10:00:00.000Z",
        "held_s": 600.0 if final else 480.2,
        "deadline_s": 480.0,
        "still_held_at": "exit" if final else "deadline",
    }
    return schema.Event(ph="i", name=name, pid=11, ts=1.0, args=args)


def test_the_detector_names_the_connector_requests_blocks_and_deadline():
    analysis = analyze([overdue("a"), overdue("b"), overdue("a", final=True)], detectors=[ConnectorHeldDetector()])
    (finding,) = analysis.findings
    assert finding.kind == schema.CONNECTOR_HELD_BLOCKS and finding.severity == "error" and finding.count == 4
    assert finding.evidence["holder"] == "NeverFreeConnector" and finding.evidence["deadline_s"] == 480.0
    assert [r["request"] for r in finding.evidence["holds"]] == ["a", "b"]  # the longest held first
    assert finding.message.startswith("4 KV block(s) of 2 finished request(s) held by KV connector NeverFreeConnector past the 480 s")
    assert "Request a holds block(s) 7, 8 since 2026-11-24T10:00:00.000Z (600 s); also b" in finding.message


def test_holds_all_released_late_are_a_warning_and_none_is_no_finding():
    analysis = analyze([overdue("a"), overdue("a", released=True)], detectors=[ConnectorHeldDetector()])
    assert [
        (f.severity, "all released late" in f.message, "held block(s) 7, 8 from 2026-11-24T10:00:00.000Z for 480.2 s" in f.message)
        for f in analysis.findings
    ] == [("warning", True, True)]
    assert analyze([], detectors=[ConnectorHeldDetector()]).findings == []


def test_hostile_events_neither_crash_the_detector_nor_grow_it_without_bound():
    detector = ConnectorHeldDetector()
    for i in range(MAX_GROUPS + 10):
        args = {"request": ["x"], "holder": f"C{i}", "blocks": "many", "block_ids": "1,2", "held_s": float("nan"), "deadline_s": None}
        detector.feed(schema.Event(ph="i", name=schema.CONNECTOR_OVERDUE, pid=1, ts=1.0, args=args))
    findings = detector.findings()
    assert len(findings) == MAX_GROUPS and all(f.count == 0 and f.evidence["deadline_s"] == 0.0 for f in findings)


def test_the_age_of_a_hold_is_its_last_word_whatever_order_the_events_come_in():
    analysis = analyze([overdue("a", final=True), overdue("a")], detectors=[ConnectorHeldDetector()])
    (finding,) = analysis.findings
    assert finding.evidence["holds"][0]["held_s"] == 600.0 and "(600 s)" in finding.message
