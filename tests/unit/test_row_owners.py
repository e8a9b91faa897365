"""A request row serves many requests in turn: a slot history's entry names the one its row served
when the entry was written (the request table's owner log, stamped with the recorders' clock),
not the row's owner now, and names none where that owner is older than the log keeps."""

from __future__ import annotations

import numpy as np
import pytest

from kvdoctor.probe.ledgers import history
from kvdoctor.probe.ledgers.requests import OWNERS_KEPT, RequestTable


@pytest.fixture
def table(monkeypatch):
    clock = np.zeros(history.CLOCK_LEN, dtype=np.int64)
    monkeypatch.setattr(history, "CLOCK", clock)
    return RequestTable(), clock


def test_an_entry_names_the_owner_its_row_had_when_it_was_written(table):
    requests, clock = table
    clock[0] = 10
    requests.allocated(3, "a")  # entries 11.. are a's
    clock[0] = 20
    requests.freed(3)
    clock[0] = 25
    requests.allocated(3, "b")  # entries 26.. are b's
    clock[0] = 40
    assert requests.owner_at(3, 11) == requests.owner_at(3, 20) == "a"
    assert requests.owner_at(3, 25) == "a"  # the call stamped 25 came before b took the row
    assert requests.owner_at(3, 26) == requests.owner_at(3, 40) == "b"
    assert requests.owner_at(3, 10) is None  # before kvdoctor saw any owner take it
    assert requests.owner_at(4, 30) is None  # a row never seen taken
    assert requests.describe(3) == "req_pool_idx 3 (rid b, live)"  # what the row's table says now


def test_the_clock_wrapping_keeps_the_order(table):
    requests, clock = table
    clock[0] = 0xFFFFFFF0
    requests.allocated(1, "old")
    clock[0] = 5  # sequence numbers are 32-bit, 0 skipped (history.py)
    requests.allocated(1, "new")
    assert requests.owner_at(1, 0xFFFFFFFA) == requests.owner_at(1, 3) == "old"
    assert requests.owner_at(1, 6) == "new"


def test_each_row_keeps_its_last_owners_only(table):
    requests, clock = table
    for n in range(OWNERS_KEPT + 5):
        clock[0] = 100 * n
        requests.allocated(7, f"r{n}")
    assert len(requests.owners[7]) == OWNERS_KEPT
    assert requests.owner_at(7, 100 * 5 + 1) == "r5" and requests.owner_at(7, 100 * 4 + 1) is None


def test_with_the_recorder_off_no_owner_is_kept(monkeypatch):
    monkeypatch.setenv(history.ENV_ENTRIES, "0")
    requests = RequestTable()
    requests.allocated(1, "a")
    assert requests.clock is None and requests.owners == {} and requests.owner_at(1, 5) is None
