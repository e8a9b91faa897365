"""A stale `last_loc` is named with the request that passed it, where the host ledger knows it.

SGLang's EAGLE decode reads each request's `last_loc` from its own row (`get_last_loc` at
`kv_allocated_len - 1`); a row reused without clearing, read past what was written for the request
now in it, gives the previous occupant's entry, in a page another request holds. The finding must
name both: the request whose last_loc it is (row 3, B) and the one holding the page (row 5, C).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvdoctor.analysis.detectors.stale_last_loc import StaleLastLocDetector  # noqa: E402
from kvdoctor.probe.ledgers import arrays  # noqa: E402
from kvdoctor.probe.ledgers import slots as L  # noqa: E402
from kvdoctor.trace import schema  # noqa: E402


def test_a_stale_last_loc_names_the_request_that_passed_it_and_the_pages_holder():
    events = []
    ps = 16
    requests = L.RequestTable()
    ledger = L.SlotLedger(
        name="t", size=1024, page_size=ps, device="cpu", emit=lambda n, a: events.append((n, a)),
        requests=requests, sites=L.CallSites(), xp=arrays.HostArrays(),
    )  # fmt: skip
    requests.allocated(3, "B")
    requests.allocated(5, "C")
    b_page = torch.arange(2 * ps, 3 * ps)
    c_page = torch.arange(8 * ps, 9 * ps)
    ledger.on_alloc(torch.cat([b_page, c_page]), 1, only_page_starts=False)
    ledger.on_owner(b_page, 3)
    ledger.on_owner(c_page, 5)
    # B's last_loc is C's slot 8 * 16 + 11; C's own last_loc is healthy
    ledger.check_last_loc(torch.tensor([8 * ps + 11, 8 * ps + 7]), 2, torch.tensor([3, 5]))
    (violation,) = [a for n, a in events if n == schema.VIOLATION]
    assert violation["kind"] == schema.STALE_LAST_LOC and violation["count"] == 1
    assert violation["requests"] == {"req_pool_idx 5 (rid C, live)": ps}  # the page's holder
    assert violation["last_loc_of"] == {"req_pool_idx 3 (rid B, live)": 1}  # the request that passed it
    detector = StaleLastLocDetector()
    detector.feed(schema.Event(ph="i", name=schema.VIOLATION, ts=1.0, pid=1, args=violation))
    (finding,) = detector.findings()
    assert " for req_pool_idx 3 (rid B, live) point at slots" in finding.message
    assert "(req_pool_idx 5 (rid C, live))" in finding.message
    assert np.array_equal(finding.evidence["slot_ids"], list(range(8 * ps, 9 * ps)))
