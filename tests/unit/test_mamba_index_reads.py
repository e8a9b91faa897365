"""The Mamba state column check's bookkeeping, without vLLM: plain objects through the probe's own
state (tests/integration/test_vllm_mamba_index.py runs vLLM's own `MambaHybridModelState`). A
device copy still in flight is judged later, never waited for before exit; a model state not laid
out as read turns only this check off."""

from __future__ import annotations

import numpy as np
import torch

from kvdoctor.analysis.analyzer import analyze
from kvdoctor.probe.core.runtime import Probe
from kvdoctor.probe.engines.vllm import mamba_index
from kvdoctor.trace import schema


class Obj:
    def __init__(self, **attrs) -> None:
        self.__dict__.update(attrs)


class SlowRead:
    """A device copy in flight: ready only once `done` is set; `wait` counted."""

    def __init__(self, value: int) -> None:
        self.value, self.done, self.waited = value, False, 0

    def ready(self) -> bool:
        return self.done

    def wait(self) -> None:
        self.waited += 1
        self.done = True

    def get(self) -> list[np.ndarray]:
        return [np.array([self.value], dtype=np.int32)]


def probe_with_events() -> tuple[Probe, list[schema.Event]]:
    probe = Probe(None)
    events: list[schema.Event] = []
    probe.emitter.listeners.append(events.append)
    return probe, events


def model_state(align: bool = True, device: str = "cpu") -> Obj:
    return Obj(
        cache_config=Obj(block_size=16, mamba_block_size=64),
        _align_mode=align,
        _mamba_state_idx_gpu=torch.full((4,), 7, dtype=torch.int32, device=device),
    )


def new_req(rid: str, computed: int) -> Obj:
    return Obj(req_id=rid, num_computed_tokens=computed, block_ids=([1, 2, 3], [9]))


def violations(events: list[schema.Event]) -> list[dict]:
    return [e.args for e in events if e.name == schema.VIOLATION]


def test_a_copy_in_flight_is_judged_once_done_and_waited_for_only_at_exit(monkeypatch):
    probe, events = probe_with_events()
    reads = [SlowRead(7), SlowRead(1), SlowRead(0)]
    monkeypatch.setattr(mamba_index, "arrays_for", lambda device: Obj(snapshot=lambda arrays: reads.pop(0)))
    first, second, third = list(reads)
    st = mamba_index.state(probe)
    device = model_state(device="meta")  # a tensor off the host: its value comes through a copy
    st.after_add(probe, device, 0, new_req("r-0", 128), 0)
    st.after_add(probe, device, 1, new_req("r-1", 128), 0)
    assert violations(events) == [] and len(st.pending) == 2  # nothing read before its copy is done
    first.done = True
    st.periodic(probe)
    (bad,) = violations(events)
    assert (bad["request"], bad["mamba_state_column"], bad["valid_columns"]) == ("r-0", 7, [0, 1]), bad
    assert len(st.pending) == 1 and first.waited == second.waited == 0
    st.after_add(probe, device, 2, new_req("r-2", 0), 0)  # nothing computed: only -1 is in range
    st.close(probe, "exit")
    assert second.waited == third.waited == 1 and st.pending == []
    assert [(v["request"], v["mamba_state_column"], v["valid_columns"]) for v in violations(events)] == [
        ("r-0", 7, [0, 1]),
        ("r-2", 0, [-1, -1]),
    ]
    assert st.judged == 3 and st.bad == 2
    (finding,) = [f for f in analyze(iter(events)).findings if f.severity == "error"]
    assert finding.kind == schema.INDEX_OUT_OF_RANGE and finding.count == 2 and "vllm#55600" in finding.message, finding.message


def test_a_cpu_tensor_is_read_at_the_call_and_outside_align_mode_nothing_is():
    probe, events = probe_with_events()
    st = mamba_index.state(probe)
    st.after_add(probe, model_state(align=False), 0, new_req("r-0", 128), 0)
    assert st.judged == 0 and violations(events) == []
    state = model_state()
    state._mamba_state_idx_gpu[1] = 1
    st.after_add(probe, state, 1, new_req("r-1", 128), 0)
    st.after_add(probe, state, 0, new_req("r-0", 128), 0)
    assert st.judged == 2 and [v["request"] for v in violations(events)] == ["r-0"] and st.pending == []


def test_a_model_state_not_laid_out_as_read_turns_only_this_check_off():
    probe, events = probe_with_events()
    role = mamba_index.SeedRole()
    broken = model_state()
    broken.cache_config.mamba_block_size = None  # not set: not understood, never guessed
    hook = Obj(arg=lambda args, kwargs, name: args[{"req_index": 0, "new_req_data": 1}[name]])
    role.after(probe, hook, broken, (0, new_req("r-0", 128)), {}, None, 0)
    statuses = [e.args for e in events if e.name == schema.PROBE_STATUS]
    assert [(s["state"], s["ledger"]) for s in statuses] == [("partial", mamba_index.LEDGER)], statuses
    assert "mamba_block_size" in statuses[0]["reason"] and violations(events) == []
    assert probe.ledger_on and not probe.ledger_is_on(mamba_index.LEDGER) and probe.ledger_is_on("blocks")
