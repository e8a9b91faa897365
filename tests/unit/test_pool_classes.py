"""`kvdoctor probes` lists the installed SGLang's pool classes (read from its sources) as the running
probe would treat them: judged, hooked but not judged, or not covered. Checked on SGLang 0.5.23 as
installed, against the classes issue reports name."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvdoctor.probe.maps.loader import installed_version, map_for
from kvdoctor.runner.pools import pool_classes

pytestmark = pytest.mark.skipif(installed_version("sglang") != "0.5.23", reason="needs SGLang 0.5.23 installed (.ci/setup)")


def test_the_installed_pools_are_sorted_as_the_probe_treats_them():
    probe_map = map_for("sglang", "0.5.23")
    assert probe_map is not None
    standing = {c.name: c.standing for c in pool_classes(probe_map)}
    # the decode server's request pool is its own class, mapped as a request pool (test_pd_decode_server.py)
    for name in (
        "TokenToKVPoolAllocator",
        "PagedTokenToKVPoolAllocator",
        "ReqToTokenPool",
        "SWATokenToKVPoolAllocator",
        "DecodeReqToTokenPool",
    ):
        assert standing[name] == "judged", name
    # the SWA pool's subclasses take free paths of their own, which the SWA ledger does not follow: said why
    why = {c.name: c.why for c in pool_classes(probe_map)}
    for name in ("PureSWATokenToKVPoolAllocator", "UnifiedSWATokenToKVPoolAllocator"):
        assert standing[name] == "hooked, not judged" and why[name].startswith("derives from SWATokenToKVPoolAllocator with its own "), why[
            name
        ]
    for name in ("PureSWATokenToKVPoolAllocator", "UnifiedMambaTokenToKVPoolAllocator"):
        assert standing[name] == "hooked, not judged", name
    # a hybrid model's request pool and its Mamba slots (test_hybrid_server.py): judged, the slots as its part
    assert standing["HybridReqToTokenPool"] == "judged"
    assert standing["MambaSlotAllocator"] == "judged" and why["MambaSlotAllocator"].startswith("judged at the quiet censuses")
    assert standing["UnifiedMambaSlotAllocator"] == "not covered"


def test_kvdoctor_probes_prints_them():
    out = subprocess.run([sys.executable, "-m", "kvdoctor.cli", "probes"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip().startswith("pools ")]
    assert any(line.startswith("pools judged (") and "TokenToKVPoolAllocator" in line for line in lines), lines
    assert any(line.startswith("pools judged (") and "SWATokenToKVPoolAllocator" in line for line in lines), lines
    assert any(line.startswith("pools hooked, not judged (") and "PureSWATokenToKVPoolAllocator (derives from" in line for line in lines), (
        lines
    )
    assert any(line.startswith("pools judged (") and "DecodeReqToTokenPool" in line for line in lines), lines
    assert any(line.startswith("pools judged (") and "MambaSlotAllocator" in line for line in lines), lines
    assert any(line.startswith("pools not covered (") and "UnifiedMambaSlotAllocator" in line for line in lines), lines
