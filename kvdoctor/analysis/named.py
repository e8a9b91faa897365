"""The tables of names an event carries (request ids a client chose, call sites), kept bounded in
the analysis whatever a trace names: a census can name a million requests, and the analysis (and
every report made from it) keeps only the `MAX_NAMED` largest of each table, with the rest said
exactly as `<table>_not_named`: how many entries were left out and their counts together, so
the named counts plus the rest still add up to what the trace said."""

from __future__ import annotations

import heapq
from typing import Any

from kvdoctor.units import as_count

MAX_NAMED = 64  # entries of one table kept (the probe names up to MAX_NAMED_PAGES pages' owners)
NOT_NAMED = "_not_named"
# The tables of names, by the key events carry them under (a census's, a violation's evidence).
NAMED_TABLES = ("requests", "orphan_requests", "allocated_at", "orphan_allocated_at", "sites", "before_attach_requests")
# The lists of ids (the probe lists at most MAX_IDS_IN_EVIDENCE): the first MAX_NAMED kept, the rest counted.
ID_LISTS = ("slot_ids", "orphan_slot_ids", "orphan_before_attach_slot_ids", "tree_holds_free_slot_ids", "block_ids")
NOT_LISTED = "_not_listed"


def bounded_args(args: dict[str, Any]) -> dict[str, Any]:
    """`args` itself when no table or id list in it is longer than MAX_NAMED; else a copy with each
    long table cut to its largest entries and the rest said as `<table>_not_named`, and each long
    list to its first ids and the rest counted as `<list>_not_listed`."""
    if not any(isinstance(args.get(key), (dict, list)) and len(args[key]) > MAX_NAMED for key in (*NAMED_TABLES, *ID_LISTS)):
        return args
    out = dict(args)
    for key in ID_LISTS:
        ids = out.get(key)
        if isinstance(ids, list) and len(ids) > MAX_NAMED:
            out[key] = ids[:MAX_NAMED]
            out[key + NOT_LISTED] = len(ids) - MAX_NAMED
    for key in NAMED_TABLES:
        table = out.get(key)
        if isinstance(table, dict) and len(table) > MAX_NAMED:
            out[key] = {}
            merge_named(out, key, table)
    return out


def merge_named(holder: dict[str, Any], key: str, table: dict[Any, Any]) -> None:
    """Adds `table`'s counts into `holder[key]` (a dict of name -> count), keeping at most
    MAX_NAMED entries there (the largest) and the others' number and counts in `holder[key + NOT_NAMED]`."""
    mine = holder.get(key)
    if not isinstance(mine, dict):
        mine = holder[key] = {}
    for name, value in table.items():
        mine[str(name)] = as_count(mine.get(str(name), 0)) + as_count(value)
        if len(mine) > 2 * MAX_NAMED:
            _cut(holder, key, mine)
    if len(mine) > MAX_NAMED:
        _cut(holder, key, mine)


def _cut(holder: dict[str, Any], key: str, mine: dict[str, Any]) -> None:
    kept = dict(heapq.nlargest(MAX_NAMED, mine.items(), key=lambda item: as_count(item[1])))
    left = holder.get(key + NOT_NAMED)
    if not isinstance(left, dict):
        left = holder[key + NOT_NAMED] = {"entries": 0, "count": 0}
    left["entries"] = as_count(left.get("entries")) + len(mine) - len(kept)
    left["count"] = as_count(left.get("count")) + sum(as_count(v) for k, v in mine.items() if k not in kept)
    mine.clear()
    mine.update(kept)


def scalars(args: dict[str, Any]) -> dict[str, Any]:
    """`args` without its lists and tables: what a detector keeps of the latest of an event it
    reads only counts from (a crafted event's million ids are not kept with it)."""
    return {key: value for key, value in args.items() if not isinstance(value, (dict, list))}
