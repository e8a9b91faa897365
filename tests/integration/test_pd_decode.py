"""The PD decode transfer ledger on SGLang's own `DecodeTransferQueue`, `Scheduler.abort_request`,
`DecodeReqToTokenPool` and release path (sglang#24527 / PR#35049, sglang#9266).

A request whose pages were sent to the prefill is aborted while its transfer is Transferring. On 0.5.18
`pop_transferred` frees its pages at once and the next request is handed the same pages while the
prefill's writer may still write them: named, with the request, the pages and the release's call
site. On 0.5.23 (deferred release on by default from 0.5.21) the pages are held until the prefill's
drain ack: silent; with the deferred release off (0.5.19's and 0.5.20's default) the same path is
named again. A transfer polled Transferring past the deadline is a warning with its age.
Each release runs `tests/support/pd_decode_cases.py` in a fresh process (its docstring says what is
SGLang's); the two processes start together.
"""

from __future__ import annotations

import pytest
from conftest import error_findings, release_case_runs

from kvdoctor.analysis.analyzer import analyze

BUGGY, FIXED = "0.5.18", "0.5.23"  # the last release without PR#35049, and one that holds the pages by default
FREED, STUCK = "pd_transfer_freed_in_flight", "pd_transfer_stuck"
PAGES = [1, 2, 3, 4, 5, 6, 7, 8]  # the one request's 8 slots (page size 1) of an allocator of 8


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("pd"))
    return release_case_runs(
        "pd_decode_cases.py",
        folder,
        "pd",
        {release: ["aborted", "stuck"] + (["aborted_off"] if release == FIXED else []) for release in (BUGGY, FIXED)},
    )


def _findings(events: list, kind: str) -> list:
    return [f for f in analyze(iter(events)).findings if f.kind == kind]


def _transfer_events(events: list) -> list:
    return [e.args for e in events if e.name == "pd_transfer"]


def test_an_abort_mid_transfer_that_frees_the_pages_at_once_is_named_with_the_request_pages_and_site(runs):
    traces, result = runs[BUGGY]
    assert result["version"] == BUGGY and result["map"] == "sglang-0.5.17.toml"
    aborted = result["aborted"]
    # what SGLang did: the abort failed the transfer, pop_transferred freed the row at once, the next request got the pages
    assert aborted["pages"] == PAGES and aborted["deferred_default"] is False
    assert aborted["steps"][1:] == [
        {"step": "abort_request", "conclude_state": 0},
        {"step": "polled failed", "queue": 0, "held": 0, "row": None},
        {"step": "next request", "pages": PAGES},
    ]
    assert [f.kind for f in error_findings(traces["aborted"])] == [FREED]
    (finding,) = _findings(traces["aborted"], FREED)
    assert finding.count == 8 and finding.evidence["page_ids"] == PAGES and finding.evidence["requests"] == {"req-aborted": 8}
    assert finding.evidence["room"] == 7001 and finding.evidence["state_at_abort"] == "Transferring"
    site = finding.evidence["site"]
    assert (
        site.startswith("release_kv_cache (sglang/srt/mem_cache/common.py:")
        and "< pop_transferred (sglang/srt/disaggregation/decode.py:" in site
    )
    assert "sglang#24527" in finding.message and "request req-aborted" in finding.message
    assert [e["event"] for e in _transfer_events(traces["aborted"])] == ["aborted by the decode (abort_request)"]


def test_the_release_that_holds_the_pages_until_the_drain_ack_is_silent(runs):
    traces, result = runs[FIXED]
    assert result["version"] == FIXED and result["map"] == "sglang-0.5.23.toml"
    aborted = result["aborted"]
    assert aborted["deferred_default"] is True
    # what SGLang did: the row stayed held, the next request waited, the drain ack released the pages to it
    assert aborted["steps"][2:] == [
        {"step": "polled failed", "queue": 0, "held": 1, "row": 1},
        {"step": "next request waits", "free": 0},
        {"step": "drain ack", "held": 0, "row": None},
        {"step": "next request", "pages": PAGES},
    ]
    assert error_findings(traces["aborted"]) == []
    released = _transfer_events(traces["aborted"])[-1]
    assert released["event"] == "released after the prefill's drain ack" and released["rid"] == "req-aborted"
    assert "< _do_release (sglang/srt/disaggregation/decode.py:" in released["site"]


def test_the_same_release_with_the_deferred_release_off_is_named(runs):
    """SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE off: 0.5.19's and 0.5.20's default."""
    traces, result = runs[FIXED]
    steps = result["aborted_off"]["steps"]
    assert steps[2]["held"] == 0 and steps[3] == {"step": "next request", "pages": PAGES}
    (finding,) = _findings(traces["aborted_off"], FREED)
    assert finding.evidence["page_ids"] == PAGES and "< pop_transferred (sglang/srt/disaggregation/decode.py:" in finding.evidence["site"]


@pytest.mark.parametrize("release", [BUGGY, FIXED])
def test_a_transfer_stuck_in_transferring_past_the_deadline_is_a_warning_with_its_age(runs, release):
    traces, result = runs[release]
    assert result["stuck"]["queue"] == 1
    assert error_findings(traces["stuck"]) == []
    (finding,) = _findings(traces["stuck"], STUCK)
    assert finding.severity == "warning" and finding.evidence["requests"] == {"req-stuck": 1}
    assert finding.evidence["state"] == "Transferring" and finding.evidence["age_s"] >= 0 and finding.evidence["deadline_s"] == 0
    assert "sglang#9266" in finding.message


def test_each_transfer_in_the_queue_is_counted_by_state_with_its_age(runs):
    traces, _ = runs[BUGGY]
    counts = [e.args for e in traces["stuck"] if e.name == "pd_transfers"]
    assert counts[0]["by_state"] == {"WaitingForInput": 1} and counts[-1]["by_state"] == {"Transferring": 1}
    (oldest,) = counts[-1]["oldest"]
    assert oldest["rid"] == "req-stuck" and oldest["state"] == "Transferring" and oldest["age_s"] >= 0
    ended = [e.args for e in traces["aborted"] if e.name == "pd_transfers"][-1]
    assert ended["freed_in_flight"] == 1 and ended["oldest"][0]["rid"] == "req-next"
