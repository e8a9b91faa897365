"""What the probes' ledgers had counted when their processes ended, against what their traces say.

Each ledger of a process under `kvdoctor run` keeps its violation counters in a crash box
(kvdoctor/probe/ledgers/crash_box.py): a file that outlives the process. Once the command has
ended, `run` reads every box of the run, sums the counts its trace already holds for that process,
ledger and kind, and writes a violation for the rest: counted at a hooked call, lost with a process
that died before its writer thread's next round (a device-side assert, an abort, a kill). A process
that ended cleanly has written everything, and adds nothing.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any

import numpy as np

from kvdoctor.trace import schema
from kvdoctor.trace.writer import TraceWriter, now_us

SIDECAR_SUFFIX = ".box.json"  # as kvdoctor/probe/ledgers/crash_box.py names them
MAX_BOXES = 4096
MAX_PAGES_NAMED = 64
RECOVERED = "counted at a hooked call; its process ended before writing it (read from its crash box by kvdoctor run)"


def collect(rendezvous: str) -> list[dict[str, Any]]:
    """Every box of the run with a count in it: its sidecar and its arrays. The box files are
    removed (those in /dev/shm outlive the run's directory)."""
    out: list[dict[str, Any]] = []
    for sidecar in sorted(glob.glob(os.path.join(glob.escape(rendezvous), "*" + SIDECAR_SUFFIX)))[:MAX_BOXES]:
        data = None
        try:
            with open(sidecar) as fh:
                body = json.load(fh)
            data = str(body["data"])
            raw = np.fromfile(data, dtype=np.uint8)
            arrays = {name: raw[o : o + n * np.dtype(t).itemsize].view(t) for name, (o, n, t) in body["layout"].items()}
        except (OSError, ValueError, KeyError, TypeError):
            continue
        finally:
            _remove(data, rendezvous)
        if np.any(arrays["counters"] > 0):
            out.append({**body, "arrays": arrays, "noted": _noted(body.get("emitted"))})
    return out


def _noted(path: Any) -> list[dict[str, Any]]:
    """The violations the process handed its emitter, in order (kvdoctor/probe/ledgers/crash_box.py)."""
    out: list[dict[str, Any]] = []
    try:
        with open(str(path)) as fh:
            for line in fh:
                try:
                    args = json.loads(line)
                except ValueError:
                    break  # the last line, cut by the crash
                if isinstance(args, dict) and isinstance(args.get("count"), int):
                    out.append(args)
    except (OSError, TypeError):
        pass
    return out


def _remove(path: str | None, rendezvous: str) -> None:
    """A box's file outside the run's directory (that one is removed whole)."""
    if path is not None and os.path.basename(path).startswith("kvdoctor-box-") and not path.startswith(rendezvous):
        try:
            os.unlink(path)
        except OSError:
            pass


def reported_counts(trace_path: str, pids: set[int]) -> dict[tuple[int, str, str], int]:
    """(pid, allocator, kind) -> the violation counts the trace holds for those processes."""
    out: dict[tuple[int, str, str], int] = {}
    try:
        with open(trace_path, "rb") as fh:
            for line in fh:
                if b'"violation"' not in line:
                    continue
                try:
                    event = json.loads(line.strip().rstrip(b","))
                except ValueError:
                    continue
                if not isinstance(event, dict) or event.get("name") != schema.VIOLATION or event.get("pid") not in pids:
                    continue
                args = event.get("args") or {}
                key = (int(event["pid"]), str(args.get("allocator", "")), str(args.get("kind", "")))
                count = args.get("count")
                out[key] = out.get(key, 0) + (count if isinstance(count, int) else 0)
    except OSError:
        pass
    return out


def unreported(boxes: list[dict[str, Any]], trace_path: str) -> list[schema.Event]:
    """A violation event for each count a box holds beyond what the trace says of it."""
    if not boxes:
        return []
    reported = reported_counts(trace_path, {int(box["pid"]) for box in boxes})
    events = []
    for box in boxes:
        pid, allocator = int(box["pid"]), str(box["allocator"])
        counters = box["arrays"]["counters"]
        for kind, slot in box["kinds"].items():
            written = reported.get((pid, allocator, kind), 0)
            missing = int(counters[slot]) - written
            if missing <= 0:
                continue
            # the emitter writes in order: the events it wrote are the first of those it was handed
            for args in [a for a in box["noted"] if a.get("kind") == kind]:
                if written > 0:
                    written -= args["count"]
                elif missing > 0:
                    events.append(_event(pid, {**args, "recovered": RECOVERED}))
                    missing -= args["count"]
            if missing > 0:  # counted, never handed to the emitter: the page bits and sites say what
                args = {"kind": kind, "allocator": allocator, "count": missing, "page_size": box["page_size"], "recovered": RECOVERED}
                events.append(_event(pid, {**args, **_evidence(box, kind)}))
    return events


def _event(pid: int, args: dict[str, Any]) -> schema.Event:
    return schema.Event(ph="i", name=schema.VIOLATION, pid=pid, ts=now_us(), cat=schema.CAT_PROBE, args=args)


def _evidence(box: dict[str, Any], kind: str) -> dict[str, Any]:
    """The site and slots a box's page bits and sites name, as the writer thread would have."""
    arrays, sites = box["arrays"], list(box.get("sites") or ["unknown"])

    def site_name(site_id: int) -> str:
        return sites[site_id] if 0 <= site_id < len(sites) else f"a call site interned after the box's last write (#{site_id})"

    vsite = arrays["violation_site"]
    if kind == schema.INDEX_OUT_OF_RANGE:
        oor = arrays["oor_value"]
        return {
            "site": site_name(int(vsite[int(box["sink"])])),
            "bad_index": int(oor[0]) if int(oor[0]) != 0 else int(oor[1]),
            "valid_rows": [0, int(box["rows"]) - 1],
        }
    bit = int(box["bits"][kind])
    pages = np.nonzero((arrays["flags"][: int(box["num_pages"]) + 1] & bit) != 0)[0][:MAX_PAGES_NAMED]
    by_site: dict[str, int] = {}
    for site_id in vsite[pages]:
        name = site_name(int(site_id))
        by_site[name] = by_site.get(name, 0) + 1
    ps = int(box["page_size"])
    slot_ids = [int(p) * ps + i for p in pages for i in range(ps)][:MAX_PAGES_NAMED]
    return {"site": max(by_site, key=lambda name: by_site[name]) if by_site else "unknown", "sites": by_site, "slot_ids": slot_ids}


def write_unreported(rendezvous_boxes: list[dict[str, Any]], trace_path: str) -> list[schema.Event]:
    """`unreported`'s events appended to the trace (every writer done); the events written."""
    events = unreported(rendezvous_boxes, trace_path)
    if events:
        writer = TraceWriter(trace_path)
        batch: list[schema.Event | dict[str, Any]] = list(events)
        try:
            writer.write_batch(batch)
        finally:
            writer.close()
    return events
