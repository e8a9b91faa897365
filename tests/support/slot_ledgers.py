"""A slot ledger on its own, as the unit tests of the row writers use it: no trace (events dropped),
its own request table and call sites."""

from __future__ import annotations

from typing import Any

from kvdoctor.probe.ledgers import slots


def quiet_ledger(size: int, page_size: int, *, device: str = "cpu", xp: Any = None, name: str = "t") -> slots.SlotLedger:
    extra = {"xp": xp} if xp is not None else {}
    return slots.SlotLedger(
        name=name,
        size=size,
        page_size=page_size,
        device=device,
        emit=lambda n, a: None,
        requests=slots.RequestTable(),
        sites=slots.CallSites(),
        **extra,
    )
