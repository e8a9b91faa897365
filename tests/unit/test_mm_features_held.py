"""The multimodal inputs ledger's bookkeeping and the mm_features_held detector, without SGLang: plain
objects shaped like a batch's requests through the probe's own state, and hostile events through the
detector (tests/integration/test_mm_inputs.py runs SGLang's own classes)."""

from __future__ import annotations

import random

import torch

from kvdoctor.analysis.analyzer import analyze
from kvdoctor.analysis.detectors.mm_features_held import MmFeaturesHeldDetector
from kvdoctor.probe.core.runtime import Probe
from kvdoctor.probe.engines.sglang import mm_inputs
from kvdoctor.trace import schema


class Obj:
    """A plain object (SimpleNamespace is a C type whose attributes the probe's reader leaves alone)."""

    def __init__(self, **attrs) -> None:
        self.__dict__.update(attrs)


def probe_with_events() -> tuple[Probe, list[schema.Event]]:
    probe = Probe(None)
    events: list[schema.Event] = []
    probe.emitter.listeners.append(events.append)
    return probe, events


def req(rid: str, feature=None, finished=True, session=None):
    items = [Obj(feature=feature)]
    return Obj(rid=rid, finished_reason="stop" if finished else None, session=session, multimodal_inputs=Obj(mm_items=items))


def batch_of(reqs: list) -> Obj:
    """A batch as an extend batch leaves it: its requests and, beside them, each one's inputs."""
    return Obj(reqs=reqs, multimodal_inputs=[getattr(r, "multimodal_inputs", None) for r in reqs])


def counts(events: list[schema.Event]) -> list[dict]:
    return [e.args for e in events if e.name == schema.MM_INPUTS]


def test_a_hold_released_later_is_said_and_judged_a_warning(monkeypatch):
    monkeypatch.setattr(mm_inputs, "MIN_EVENT_INTERVAL_S", 0.0)
    probe, events = probe_with_events()
    pixels = torch.zeros(4, 8)
    batch = batch_of([req("r-0", pixels), req("r-1", None), req("r-2", torch.zeros(2), finished=False)])
    mm_inputs.after_result(probe, object(), batch)  # noted at its finish: nothing said yet
    assert counts(events) == []
    batch.reqs, batch.multimodal_inputs = [], []
    mm_inputs.after_result(probe, object(), batch)
    (held,) = counts(events)
    assert held["when"] == "result" and [(h["rid"], h["bytes"], h["results_since_finish"]) for h in held["held"]] == [("r-0", 128, 1)]
    mm_inputs.after_result(probe, object(), batch)  # unchanged: not said again
    del pixels
    assert mm_inputs.state(probe).holds["r-0"].refs[0]() is None  # nothing holds the tensor any more
    mm_inputs.after_result(probe, object(), batch)
    assert [c["released"] for c in counts(events)] == [[], ["r-0"]]
    (finding,) = [f for f in analyze(iter(events)).findings if f.kind == schema.MM_FEATURES_HELD]
    assert finding.severity == "warning" and "all released later" in finding.message


def test_session_requests_and_requests_still_decoding_are_never_noted():
    probe, events = probe_with_events()
    keep = [torch.zeros(8), torch.zeros(8)]
    batch = batch_of([req("s-0", keep[0], session=object()), req("d-0", keep[1], finished=False)])
    mm_inputs.after_result(probe, object(), batch)
    mm_inputs.after_result(probe, object(), batch)
    mm_inputs.state(probe).close(probe, "exit")
    (count,) = counts(events)
    assert count["when"] == "exit" and count["finished_requests_read"] == 0 and count["held"] == []


def test_the_table_of_holds_is_bounded(monkeypatch):
    monkeypatch.setattr(mm_inputs, "MAX_TRACKED", 2)
    probe, events = probe_with_events()
    keep = [torch.zeros(2) for _ in range(5)]
    mm_inputs.after_result(probe, object(), batch_of([req(f"r-{n}", t) for n, t in enumerate(keep)]))
    mm_inputs.state(probe).close(probe, "exit")
    (count,) = counts(events)
    assert count["held_requests"] == 2 and count["untracked_requests"] == 3 and count["finished_with_features"] == 5


def test_inputs_laid_out_otherwise_turn_only_this_ledger_off():
    probe, events = probe_with_events()
    odd = Obj(rid="r-0", finished_reason="stop", session=None, multimodal_inputs=Obj(mm_items=("not", "a list")))
    mm_inputs.after_result(probe, object(), batch_of([odd]))
    assert probe.ledger_on and not probe.ledger_is_on(mm_inputs.LEDGER)
    (status,) = [e.args for e in events if e.name == schema.PROBE_STATUS]
    assert status["state"] == "partial" and "the multimodal inputs ledger is off: Obj.mm_items is tuple" in status["reason"]


JUNK = [None, True, -1, 10**400, float("nan"), float("inf"), "x", [], {}, [1, 2], {"a": 1}, "", 1.5]
FIELDS = ["rid", "bytes", "device", "items", "held_s", "results_since_finish", "request_alive"]


def test_hostile_mm_inputs_events_never_break_the_detector():
    for seed in range(400):
        rng = random.Random(seed)
        detector = MmFeaturesHeldDetector()
        for _ in range(rng.randint(1, 6)):
            holds = [{k: rng.choice(JUNK) for k in rng.sample(FIELDS, rng.randint(0, len(FIELDS)))} for _ in range(rng.randint(0, 3))]
            args = {
                k: rng.choice(JUNK) for k in rng.sample(["when", "scheduler", "untracked_requests", "held_requests"], rng.randint(0, 4))
            }
            args["held"] = rng.choice([holds, rng.choice(JUNK), [rng.choice(JUNK)]])
            args["released"] = rng.choice([[rng.choice(JUNK), "1"], rng.choice(JUNK)])
            detector.feed(schema.Event(ph="i", name=schema.MM_INPUTS, pid=rng.choice([1, 2, 10**30]), args=args))
        for finding in detector.findings():
            assert isinstance(finding.message, str), seed


def test_the_writers_round_counts_holds_once_old_enough(monkeypatch):
    monkeypatch.setenv("KVDOCTOR_MM_HELD_AGE_S", "0")
    probe, events = probe_with_events()
    keep = torch.zeros(3)
    mm_inputs.after_result(probe, object(), batch_of([req("r-0", keep)]))
    mm_inputs.state(probe).periodic(probe)
    (count,) = counts(events)
    assert count["when"] == "periodic" and count["held"][0]["rid"] == "r-0" and count["held"][0]["results_since_finish"] == 0
    monkeypatch.setenv("KVDOCTOR_MM_HELD_AGE_S", "not a number")
    assert mm_inputs.held_age_from_env() == mm_inputs.DEFAULT_HELD_AGE_S


def test_a_busy_engines_counts_are_said_at_most_once_a_second_and_no_release_is_lost(monkeypatch):
    monkeypatch.setattr(mm_inputs, "MIN_EVENT_INTERVAL_S", 3600.0)
    probe, events = probe_with_events()
    keep = {n: torch.zeros(2) for n in range(3)}
    for n in range(3):  # each result finishes one more request: the held set changes every time
        mm_inputs.after_result(probe, object(), batch_of([req(f"r-{n}", keep[n])]))
    del keep[0]
    mm_inputs.after_result(probe, object(), batch_of([]))
    assert [[h["rid"] for h in c["held"]] for c in counts(events)] == [["r-0"]]  # the first, then nothing within the interval
    mm_inputs.state(probe).close(probe, "exit")
    last = counts(events)[-1]
    assert last["when"] == "exit" and last["released"] == ["r-0"] and [h["rid"] for h in last["held"]] == ["r-1", "r-2"]


def test_a_text_server_reads_no_request_until_a_batch_lists_multimodal_inputs():
    probe, events = probe_with_events()
    finished = req("r-0", torch.zeros(4))
    text = Obj(reqs=[finished], multimodal_inputs=[None])  # what a text-only extend batch lists
    mm_inputs.after_result(probe, object(), text)
    mm_inputs.after_result(probe, object(), Obj(reqs=[finished], multimodal_inputs=None))  # a decode batch
    assert mm_inputs.state(probe).finished_read == 0 and not mm_inputs.state(probe).holds
    mm_inputs.after_result(probe, object(), batch_of([finished]))
    assert mm_inputs.state(probe).finished_read == 1 and list(mm_inputs.state(probe).holds) == ["r-0"]
