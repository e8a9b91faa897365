"""orphan_slots: slots neither free, nor in the tree, nor owned by a live request.

A census runs when the engine goes idle, at exit, and (rolling) every few seconds while it is
busy. The latest census of each allocator is the verdict (a later census sees leaks an earlier one
saw, unless the pool was cleared in between); the largest count seen is kept in the evidence.
Slots a request still owned when it gave back its row are reported by the probe at once (with the
path that gave it back, retract or finish, and the scheduler's forward count, where it saw them); they are
the finding when no census came after them (a server killed while busy), and the evidence of the
census's finding otherwise. A census the probe marked `judged: false` (a pool whose holders it
cannot all see) gives no verdict; the probe said why in a `probe_status`. A rolling census taken
sooner after an idle or exit census than its own `persisted_s` does not overrule it.
"""

from __future__ import annotations

from typing import Any

from kvdoctor.analysis.detectors.base import MAX_LABELS_COUNTED, MAX_LEDGER_ENTRIES, LeftOut, as_list, left_out_finding
from kvdoctor.analysis.findings import ERROR, Finding
from kvdoctor.analysis.named import NOT_NAMED, merge_named
from kvdoctor.analysis.slot_history import clean_pages, pages_for_slots
from kvdoctor.trace import schema
from kvdoctor.units import as_count, finite_number


class OrphanSlotsDetector:
    consumes = frozenset({schema.CENSUS, schema.VIOLATION})

    def __init__(self) -> None:
        self.latest: dict[tuple[int, str], dict[str, Any]] = {}  # (pid, allocator): its latest census
        self.latest_ts: dict[tuple[int, str], float] = {}
        self.max_seen: dict[tuple[int, str], int] = {}
        self.at_release: dict[tuple[int, str], dict[str, Any]] = {}  # slots leaked at a request's release
        self.tree_unseen: set[tuple[int, str]] = set()  # ledgers whose tree took slots they never saw
        self.censuses = 0
        # ledgers beyond MAX_LEDGER_ENTRIES (a crafted trace): the latest orphan count of each, by
        # hash, then a sum of the counts of those that found no room even there
        self.left_latest: dict[int, int] = {}
        self.left_overflow = 0
        self.left_releases = LeftOut()
        self.histories: dict[tuple[int, str], Any] = {}  # each ledger's orphans' histories, as its last census that gave them

    def feed(self, event: schema.Event) -> None:
        args = event.args
        key = (event.pid, str(args.get("allocator", "")))
        if event.name == schema.VIOLATION:
            if args.get("kind") == schema.ORPHAN_SLOTS:
                self._released(key, event)
            return
        if event.name != schema.CENSUS:
            return
        if args.get("judged") is False:
            if as_count(args.get("tree_unseen_slots")) and len(self.tree_unseen) < MAX_LEDGER_ENTRIES:
                # the tree took slots the ledger never saw: what a request's release or a rolling
                # census (no tree audit) named may be those very slots, so neither is a verdict
                self.tree_unseen.add(key)
                if self.latest.get(key, {}).get("reason") == "rolling":
                    self.latest.pop(key, None)
                    self.latest_ts.pop(key, None)
            return  # the probe said it cannot prove it sees every holder of this pool: no verdict
        if not schema.census_is_readable(args):
            return  # a damaged count is no verdict, least of all a clean one
        self.censuses += 1
        if key not in self.latest and len(self.latest) >= MAX_LEDGER_ENTRIES:
            self._left_census(key, as_count(args.get("orphan_slots")))
            return
        self.max_seen[key] = max(self.max_seen.get(key, 0), as_count(args.get("orphan_slots")))
        if self._too_soon_to_overrule(key, args, event.ts):
            return
        if schema.SLOT_HISTORY in args:  # kept: a later census whose orphans' histories are the same says only that
            self.histories[key] = args[schema.SLOT_HISTORY]
        elif args.get(schema.HISTORY_UNCHANGED) is True and key in self.histories:
            args = {**args, schema.SLOT_HISTORY: self.histories[key]}
        self.latest[key] = args
        self.latest_ts[key] = event.ts

    def _too_soon_to_overrule(self, key: tuple[int, str], args: dict[str, Any], ts: float) -> bool:
        """A rolling census names a slot only once it has stayed orphaned `persisted_s`; until that
        long after an idle or exit census, it has not judged what that census saw, and its count is
        no verdict over it (a kill right after one left a rolling 0 over an idle census's 32)."""
        earlier = self.latest.get(key)
        if args.get("reason") != "rolling" or earlier is None or earlier.get("reason") == "rolling":
            return False
        persisted_s = finite_number(args.get("persisted_s")) or 0.0
        return (ts - self.latest_ts[key]) / 1e6 < persisted_s

    def _left_census(self, key: tuple[int, str], orphans: int) -> None:
        hashed = hash(key)
        if hashed in self.left_latest or len(self.left_latest) < MAX_LABELS_COUNTED:
            self.left_latest[hashed] = orphans
        else:
            self.left_overflow += orphans  # counted at each census: more, never fewer, than the latest say

    def _released(self, key: tuple[int, str], event: schema.Event) -> None:
        args = event.args
        if key not in self.at_release and len(self.at_release) >= MAX_LEDGER_ENTRIES:
            self.left_releases.add(key, as_count(args.get("count")))
            return
        found = self.at_release.setdefault(
            key, {"count": 0, "slot_ids": [], "requests": {}, "allocated_at": {}, "released_on": {}, "last_ts": 0.0}
        )
        found["count"] += as_count(args.get("count"))
        path, step = args.get("path"), args.get("forward_ct")
        if isinstance(path, str) and path:
            where = f"{path} at forward {step}" if isinstance(step, int) else path
            if where in found["released_on"] or len(found["released_on"]) < 16:
                found["released_on"][where] = as_count(found["released_on"].get(where, 0)) + as_count(args.get("count"))
        found["last_ts"] = event.ts
        if "history" not in found and args.get(schema.SLOT_HISTORY):  # the first release's, taken as it leaked
            found["history"] = clean_pages(args[schema.SLOT_HISTORY])
        found["slot_ids"] = (found["slot_ids"] + [i for i in as_list(args.get("slot_ids")) if isinstance(i, int)])[:64]
        for name in ("requests", "allocated_at"):
            value = args.get(name)
            if isinstance(value, dict):
                merge_named(found, name, dict(list(value.items())[:16]))  # bounded over any number of releases

    def _left_findings(self) -> list[Finding]:
        """The ledgers a full table did not keep, as one finding each kind: never dropped."""
        out = []
        orphans = sum(self.left_latest.values()) + self.left_overflow
        if orphans:
            leaking = sum(1 for n in self.left_latest.values() if n)
            out.append(
                Finding(
                    schema.ORPHAN_SLOTS,
                    ERROR,
                    f"{orphans} more KV slot(s) leaked, at the latest census of {leaking}{'+' if self.left_overflow else ''} "
                    f"(process, allocator) ledgers beyond the {MAX_LEDGER_ENTRIES} one analysis names one by one",
                    orphans,
                    {"ledgers_not_kept": len(self.left_latest), "census": "latest"},
                    0,
                    unit="slots",
                )
            )
        if self.left_releases.count:
            out.append(left_out_finding(schema.ORPHAN_SLOTS, ERROR, self.left_releases, "(process, allocator) release"))
            out[-1].unit = "slots"
        return out

    def findings(self) -> list[Finding]:
        out = self._left_findings()
        for key, found in self.at_release.items():
            if key in self.tree_unseen:
                continue  # its censuses said why they cannot judge (the analysis's not-judged ledgers)
            if key in self.latest and self.latest_ts[key] >= found["last_ts"]:
                self.latest[key] = {**self.latest[key], "leaked_at_release": found}
                continue
            out.append(self._release_finding(key, found))
        for (pid, allocator), args in self.latest.items():
            count = as_count(args.get("orphan_slots"))
            if count:
                out.extend(self._census_findings(pid, allocator, args, count))
            dangling = as_list(args.get("tree_holds_free_slot_ids"))
            freed = as_count(args.get("tree_freed_slots"))
            if freed:
                out.append(
                    Finding(
                        schema.TREE_HOLDS_FREE_SLOT,
                        ERROR,
                        f"the radix tree still holds {freed} slot(s) that were freed outside eviction "
                        f"(slots {', '.join(str(i) for i in dangling[:8])}); the next allocations hand them out twice",
                        freed,
                        {"allocator": allocator, "slot_ids": dangling, "pid": pid},
                        pid,
                        unit="slots",
                    )
                )
        return out

    def _census_findings(self, pid: int, allocator: str, args: dict[str, Any], count: int) -> list[Finding]:
        """A census's orphans: those leaked before the probe attached and those after, apart (the
        first have no request or call site to name; the second have both)."""
        sites: dict[str, Any] = args["orphan_allocated_at"] if isinstance(args.get("orphan_allocated_at"), dict) else {}
        reqs: dict[str, Any] = args["orphan_requests"] if isinstance(args.get("orphan_requests"), dict) else {}
        ids = as_list(args.get("orphan_slot_ids"))
        before = min(as_count(args.get("orphan_before_attach_slots")), count)
        if not before or before == count:
            return [self._orphan_finding(pid, allocator, args, count, ids, sites, reqs, whole=True)]
        before_ids = as_list(args.get("orphan_before_attach_slot_ids"))
        early = set(before_ids)
        return [
            self._orphan_finding(
                pid,
                allocator,
                args,
                before,
                before_ids,
                {schema.SITE_BEFORE_ATTACH: before},
                {k: v for k, v in reqs.items() if k == schema.OWNER_BEFORE_ATTACH},
                whole=False,
            ),
            self._orphan_finding(
                pid,
                allocator,
                args,
                count - before,
                [i for i in ids if i not in early],
                {k: v for k, v in sites.items() if k != schema.SITE_BEFORE_ATTACH},
                {k: v for k, v in reqs.items() if k != schema.OWNER_BEFORE_ATTACH},
                whole=False,
            ),
        ]

    def _orphan_finding(
        self, pid: int, allocator: str, args: dict[str, Any], count: int, ids: list[Any], sites: Any, reqs: dict[str, Any], *, whole: bool
    ) -> Finding:
        """One orphan finding; `whole`: it is all the census's orphans (SGLang's own count may be named)."""
        top_site = max(sites, key=lambda k: as_count(sites[k])) if isinstance(sites, dict) and sites else "unknown"
        top_req = max(reqs, key=lambda k: as_count(reqs[k])) if isinstance(reqs, dict) and reqs else "unknown request"
        sglang_says = _sglang_says(args, count) if whole else ""
        evidence = {
            "allocator": allocator,
            "census": args.get("reason"),
            "idle": args.get("idle"),
            "slot_ids": ids,
            "allocated_at": sites,
            "requests": reqs,
            "max_orphan_slots_seen": self.max_seen.get((pid, allocator), count),
            "free_slots": args.get("free_slots"),
            "tree_slots": args.get("tree_slots"),
            "total_slots": args.get("total_slots"),
            "pid": pid,
        }
        if schema.SLOT_HISTORY in args:  # the census's flight recorder, for the pages this finding names
            history = args[schema.SLOT_HISTORY]
            evidence[schema.SLOT_HISTORY] = clean_pages(history) if whole else pages_for_slots(history, ids)
        elif isinstance(args.get(schema.HISTORY_OFF), str):
            evidence[schema.HISTORY_OFF] = args[schema.HISTORY_OFF]
        for table, key in (("orphan_requests", "requests"), ("orphan_allocated_at", "allocated_at")):
            if whole and isinstance(args.get(table + NOT_NAMED), dict):  # a census that named more than analysis keeps
                evidence[key + NOT_NAMED] = args[table + NOT_NAMED]
        released = args.get("leaked_at_release")
        if isinstance(released, dict) and top_site != schema.SITE_BEFORE_ATTACH:
            # The release named the request that held the slots; a census can name only the
            # row, whose last user may be a later request.
            evidence["first_seen"] = f"at the release of {', '.join(list(released['requests'])[:4])}"
            if released.get("released_on"):
                evidence["released_on"] = released["released_on"]
            evidence["requests"] = released["requests"] if as_count(released["count"]) >= count else {**reqs, **released["requests"]}
            if released.get("history") and not evidence.get(schema.SLOT_HISTORY):
                evidence[schema.SLOT_HISTORY] = released["history"]
            top_req = max(released["requests"], key=lambda k: released["requests"][k]) if released["requests"] else top_req
        shown = ", ".join(str(i) for i in ids[:8]) + (", ..." if len(ids) > 8 else "")
        vllm = args.get("engine") == "vllm"
        if vllm:
            evidence["orphan_blocks"] = as_count(args.get("orphan_blocks")) if whole else count // max(1, as_count(args.get("block_size")))
            evidence["block_size"] = args.get("block_size")
        if top_site == schema.SITE_BEFORE_ATTACH:
            holders = "no request, deferred free or pending copy" if vllm else "no live request and no tree node"
            message = (
                f"{count} KV slot(s) leaked before kvdoctor attached: when it adopted the allocator's state {holders} "
                f"held them, and none did at the {args.get('reason', '')} census (slots {shown})" + sglang_says
            )
        elif vllm:
            message = (
                f"{count} KV slot(s) leaked ({evidence['orphan_blocks']} block(s) of {args.get('block_size')}): still referenced "
                f"but held by no live request at the {args.get('reason', '')} census (slots {shown}); allocated "
                f"by {top_site} for {top_req}, and their reference count never went back to 0"
            )
        else:
            message = (
                f"{count} KV slot(s) leaked: neither free, nor in the radix tree, nor owned by a live request "
                f"at the {args.get('reason', '')} census (slots {shown}); allocated by {top_site} for {top_req} "
                f"and never freed or inserted" + _released_on(evidence.get("released_on")) + sglang_says
            )
        page_size = 1 if vllm else max(1, as_count(args.get("page_size")))
        return Finding(schema.ORPHAN_SLOTS, ERROR, message, count, evidence, pid, unit="slots", page_size=page_size)

    @staticmethod
    def _release_finding(key: tuple[int, str], found: dict[str, Any]) -> Finding:
        pid, allocator = key
        count = as_count(found["count"])
        ids = found["slot_ids"]
        shown = ", ".join(str(i) for i in ids[:8]) + (", ..." if len(ids) > 8 else "")
        sites = found["allocated_at"]
        top_site = max(sites, key=lambda k: sites[k]) if sites else "unknown"
        requests = ", ".join(list(found["requests"])[:4]) or "a request"
        message = (
            f"{count} KV slot(s) leaked: still owned by {requests} when it gave back its row, never freed nor inserted "
            f"into the radix tree (slots {shown}); allocated by {top_site}" + _released_on(found.get("released_on")) + ". "
            "Found while the server was busy"
        )
        evidence = {
            "allocator": allocator,
            "census": "release",
            "slot_ids": ids,
            "allocated_at": sites,
            "requests": found["requests"],
            "pid": pid,
        }
        if found.get("released_on"):
            evidence["released_on"] = found["released_on"]
        if found.get("history"):
            evidence[schema.SLOT_HISTORY] = found["history"]
        return Finding(schema.ORPHAN_SLOTS, ERROR, message, count, evidence, pid, unit="slots")


def _released_on(paths: Any) -> str:
    """Where the probe saw the rows given back (retract, finish) and at which forward, if it did."""
    if not isinstance(paths, dict) or not paths:
        return ""
    shown = ", ".join(f"{where} ({as_count(n)} slot(s))" for where, n in list(paths.items())[:4])
    return f"; given back with the request's row by {shown}, while still its own"


def _sglang_says(args: dict[str, Any], count: int) -> str:
    """SGLang's own idle check is named only where its numbers, read in the same census, give the
    same count: an idle census whose ledger agrees with SGLang's free list, and the tree's sizes."""
    needed = ("total_slots", "host_free_slots", "tree_evictable_slots", "tree_protected_slots")
    if not args.get("idle") or any(not isinstance(args.get(k), int) for k in needed) or as_count(args.get("ledger_disagrees_slots")):
        return ""
    diff = args["total_slots"] - args["host_free_slots"] - args["tree_evictable_slots"] - args["tree_protected_slots"]
    if diff != count:
        return ""
    return f". This is SGLang's 'memory leak detected ... diff={count}', with names"
