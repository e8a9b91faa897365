"""Judges the multimodal inputs cases (sglang#7340, #8429, #8902) that test_sglang_7340_8429_8902.py ran on a GPU, one release each
(tests/support/mm_inputs_cases.py with `KVDOCTOR_MM_DEVICE=cuda`), and writes one JSON per release.

    python tests/gpu/bugs/sglang_7340_8429_8902_mm_inputs.py OUT 0.5.7:held 0.5.8:clears

Each `RELEASE:EXPECT` reads `OUT/mm_inputs_RELEASE.result` (the case's RESULT line) and its trace
`OUT/mm_inputs_RELEASE.trace.json`, and writes `OUT/mm_inputs_RELEASE.json`: the case's result (the
devices of the features, `torch.cuda.memory_allocated()` at each point, the synchronizing calls by
owner), the ledger's counts, the findings, and `checks` with `ok`. `held`: one error finding names
both image requests with their bytes on cuda:0, and the running batch's `multimodal_inputs` list
alone kept those bytes allocated on the device at idle; `clears`: no error or warning finding, no
feature alive at idle, nothing freed by dropping that list. Both: no synchronizing call made in the
multimodal inputs ledger's frames, and the probe's others only where the slot ledger says it reads
the device (its start, an idle engine's census, exit). Exit 0 when every check holds.
"""

from __future__ import annotations

import json
import os
import sys

IMAGES = ("img-0", "img-1")


def judge(out: str, release: str, expect: str) -> dict:
    from kvdoctor.analysis.analyzer import analyze
    from kvdoctor.trace import schema
    from kvdoctor.trace.reader import iter_events

    with open(os.path.join(out, f"mm_inputs_{release}.result")) as fh:
        lines = [line for line in fh if line.startswith("RESULT ")]
    if not lines:
        return {"release": release, "expect": expect, "ok": False, "error": "the case printed no RESULT"}
    result = json.loads(lines[-1][len("RESULT ") :])
    events = list(iter_events(os.path.join(out, f"mm_inputs_{release}.trace.json")))
    counts = [e.args for e in events if e.name == schema.MM_INPUTS]
    findings = [f.to_dict() for f in analyze(iter(events)).findings]
    flagged = [f for f in findings if f["severity"] in ("error", "warning")]
    case, memory, syncs = result["case"], result.get("memory", {}), result.get("syncs", {})
    size = case["feature_bytes"]
    checks = {
        "version": result["version"] == release,
        "features_moved_to_cuda": case["feature_devices"] == {rid: ["cuda:0"] for rid in IMAGES},
        # the multimodal inputs ledger never synchronizes; the probe's others do only where they say
        # they may (arrays.py to_host: a census of an idle engine, or exit)
        "no_sync_in_the_mm_inputs_ledger": not any(k.startswith("kvdoctor") and "mm_inputs" in k for k in syncs.get("sites", {})),
        "probe_syncs_only_at_ledger_start_idle_census_or_exit": probe_syncs(syncs).get("elsewhere", 0) == 0,
    }
    if expect == "held":
        held = [f for f in flagged if f["kind"] == schema.MM_FEATURES_HELD and f["severity"] == "error"]
        checks.update(
            finding_names_requests_bytes_device=len(flagged) == 1
            and len(held) == 1
            and held[0]["evidence"].get("requests") == {rid: size for rid in IMAGES}
            and held[0]["evidence"].get("devices") == ["cuda:0"]
            and held[0]["evidence"].get("still_held_bytes") == 2 * size,
            counts_on_cuda=bool(counts) and all(c["by_device"] == {"cuda:0": 2 * size} for c in counts),
            alive_at_idle=case["alive_at_idle"] == {rid: 1 for rid in IMAGES},
            allocated_at_idle=memory.get("alive_feature_bytes_at_idle") == 2 * size,
            freed_when_the_list_is_dropped=memory.get("freed_by_dropping") == 2 * size and memory.get("alive_after_dropping") == 0,
        )
    else:
        checks.update(
            silent=flagged == [],
            one_count_at_exit_none_held=[(c["when"], c["bytes"], c["held"]) for c in counts] == [("exit", 0, [])],
            alive_at_idle=case["alive_at_idle"] == {rid: 0 for rid in IMAGES},
            allocated_at_idle=memory.get("alive_feature_bytes_at_idle") == 0,
            nothing_freed_when_the_list_is_dropped=memory.get("freed_by_dropping") == 0,
        )
    return {
        "release": release,
        "expect": expect,
        "ok": all(checks.values()),
        "checks": checks,
        "card": result.get("card"),
        "memory": memory,
        "syncs": syncs,
        "probe_syncs": probe_syncs(syncs),
        "counts": counts,
        "findings": flagged,
        "result": result,
    }


def probe_syncs(syncs: dict) -> dict:
    """The synchronizing calls in the probe's frames, by what made them: the slot ledger's start
    (reading the allocator's free list once, when the ledger for it is made), its idle census (before
    the first allocation after the engine went idle), the probe's exit, or elsewhere."""
    out: dict = {}
    for key, n in syncs.get("sites", {}).items():
        if not key.startswith("kvdoctor"):
            continue
        if key.startswith("kvdoctor [deactivate]"):
            what = "exit"
        elif ":census_if_due" in key:
            what = "idle_census"
        elif ":ledger_for" in key:
            what = "ledger_start"
        else:
            what = "elsewhere"
        out[what] = out.get(what, 0) + n
    return out


def main() -> int:
    out, pairs = sys.argv[1], [a.split(":") for a in sys.argv[2:]]
    ok = True
    for release, expect in pairs:
        try:
            verdict = judge(out, release, expect)
        except Exception as exc:  # a missing file or a failed case is reported, not raised
            verdict = {"release": release, "expect": expect, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
        ok = ok and verdict["ok"]
        with open(os.path.join(out, f"mm_inputs_{release}.json"), "w") as fh:
            json.dump(verdict, fh, indent=1)
        brief = {k: verdict.get(k) for k in ("release", "ok", "checks", "memory", "error")}
        brief["syncs_by_owner"] = verdict.get("syncs", {}).get("by_owner")
        brief["probe_syncs"] = verdict.get("probe_syncs")
        brief["finding"] = [f["message"] for f in verdict.get("findings", [])]
        print(json.dumps(brief, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
