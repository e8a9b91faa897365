"""The PD decode transfer ledger's own bounds, apart from SGLang (its real paths:
tests/integration/test_pd_decode.py): a queue it does not understand turns only this ledger off and
says why; it follows at most MAX_TRANSFERS requests and counts the rest; the deadline can be set."""

from types import SimpleNamespace

import torch

from kvdoctor.probe.core.runtime import Probe
from kvdoctor.probe.engines.sglang import pd_decode, pd_decode_roles
from kvdoctor.trace import schema


class DecodeReqToTokenPool:
    """Named as SGLang's decode request pool: a host table of 8 rows."""

    def __init__(self) -> None:
        self.req_to_token = torch.arange(8 * 4, dtype=torch.int32).reshape(8, 4)


def queue(pool: object) -> SimpleNamespace:
    return SimpleNamespace(tree_cache=SimpleNamespace(req_to_token_pool=pool, token_to_kv_pool_allocator=SimpleNamespace(page_size=2)))


def decode_req(row: int) -> SimpleNamespace:
    req = SimpleNamespace(rid=f"r{row}", bootstrap_room=row, req_pool_idx=row, origin_input_ids=[0, 1, 2, 3])
    return SimpleNamespace(req=req, kv_receiver=SimpleNamespace(bootstrap_room=row))


def probe_with_events() -> tuple[Probe, list[schema.Event]]:
    probe = Probe(None)
    events: list[schema.Event] = []
    probe.emitter.listeners.append(events.append)
    return probe, events


def test_a_request_pool_the_ledger_does_not_read_turns_only_it_off_and_says_why():
    probe, events = probe_with_events()
    pd_decode_roles.guarded(probe, pd_decode.PdDecodeLedger.enter_all, queue(object()), [decode_req(1)])
    assert probe.ledgers_off == {pd_decode.LEDGER} and probe.ledger_on
    (said,) = [e.args["reason"] for e in events if e.name == schema.PROBE_STATUS and e.args.get("ledger") == pd_decode.LEDGER]
    assert "PD decode transfers not judged: NotJudged: the request pool is object" in said


def test_it_follows_at_most_max_transfers_and_counts_the_rest(monkeypatch):
    monkeypatch.setattr(pd_decode, "MAX_TRANSFERS", 3)
    probe, _ = probe_with_events()
    state = pd_decode_roles.state(probe)
    pd_decode_roles.guarded(probe, pd_decode.PdDecodeLedger.enter_all, queue(DecodeReqToTokenPool()), [decode_req(r) for r in range(1, 6)])
    assert sorted(state.by_row) == [1, 2, 3] and len(state.by_receiver) == 3 and state.counts["not_followed"] == 2
    assert state.by_row[2].pages == [4, 5] and state.by_row[2].page_count == 2  # row 2's slots 8-11 in pages of 2


def test_the_deadline_can_be_set_and_a_bad_value_keeps_the_default(monkeypatch):
    monkeypatch.setenv("KVDOCTOR_PD_TRANSFER_DEADLINE_S", "0")
    assert pd_decode.PdDecodeLedger().deadline_s == 0
    monkeypatch.setenv("KVDOCTOR_PD_TRANSFER_DEADLINE_S", "soon")
    assert pd_decode.PdDecodeLedger().deadline_s == pd_decode.DEADLINE_S == 300.0
