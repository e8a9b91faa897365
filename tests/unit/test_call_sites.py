"""Call sites are keyed by code identity and bytecode offset on the hot path; the text a finding
shows must still be the frames of the call, one id per distinct path."""

import sys

import numpy as np
import torch

from kvdoctor.probe.base.callsites import CallSites
from kvdoctor.probe.ledgers.arrays import HostArrays


def _site(sites):
    return sites.at(sys._getframe(1))


def first_path(sites):
    return _site(sites)


def second_path(sites):
    return _site(sites)


def test_same_line_same_id_other_line_other_id():
    sites = CallSites()
    a = [first_path(sites) for _ in range(3)]
    b = second_path(sites)
    assert a[0] == a[1] == a[2] != b
    assert sites.name(a[0]).startswith("first_path (tests/unit/test_call_sites.py:")
    assert sites.name(b).startswith("second_path (tests/unit/test_call_sites.py:")
    assert len(sites) == 3  # "unknown" + two paths


def test_code_objects_behind_the_keys_stay_alive():
    sites = CallSites()
    namespace: dict = {}
    exec("def made(sites, site):\n    return site(sites)\n", namespace)
    first = namespace["made"](sites, _site)
    del namespace
    # a new function may reuse the freed memory; a kept code object cannot be freed, so its id is not reused
    namespace = {}
    exec("def other(sites, site):\n    x = 1\n    return site(sites)\n", namespace)
    second = namespace["other"](sites, _site)
    assert sites.name(first).startswith("made (") and sites.name(second).startswith("other (")


def test_single_reads_one_element_integer_tensors_only():
    host = HostArrays()
    assert host.single(torch.tensor([7], dtype=torch.int32)) == 7
    assert host.single(torch.tensor([7], dtype=torch.int64)) == 7
    assert host.single(torch.tensor([1, 2])) is None
    assert host.single(torch.tensor([1.5])) is None
    assert host.single(np.array([3])) is None
    assert host.single(None) is None
