"""A slot's recorded history as Perfetto shows it: one track per page, one instant event per
transition, at the time it happened.

A violation or census that names pages carries their flight-recorder histories in its args
(schema.SLOT_HISTORY). The trace opens in Perfetto as it is, so the probe's writer thread, as it
writes such an event, also writes each history entry as an instant event on that page's own track
(tid in a range no thread uses, named "slot N" by a THREAD_NAME event), `ago_ms` before the event.
A page dumped again (the next census) adds only the entries after those already written. Tracks
are bounded: past MAX_TRACKS pages the rest stay in the event's args only.
"""

from __future__ import annotations

from typing import Any

from kvdoctor.trace import schema

MAX_TRACKS = 1024
FIRST_TRACK_TID = 0x7FF00000  # above any 16-bit thread id the emitter gives (threading.get_ident() & 0xFFFF)


class SlotTracks:
    """The tracks written so far in one process's trace: (ledger, page) -> tid and its last seq."""

    def __init__(self, max_tracks: int = MAX_TRACKS) -> None:
        self.max_tracks = max_tracks
        self._tracks: dict[tuple[str, int], list[int]] = {}  # -> [tid, last seq written]

    def events_for(self, event: schema.Event) -> list[schema.Event]:
        """The track events of `event`'s histories ([] when it carries none); never raises."""
        try:
            pages = event.args.get(schema.SLOT_HISTORY) if isinstance(event.args, dict) else None
            if not isinstance(pages, list) or not pages:
                return []
            ledger = str(event.args.get("allocator") or event.args.get("ledger") or "")
            out: list[schema.Event] = []
            for page in pages:
                if isinstance(page, dict):
                    out.extend(self._page_events(event, ledger, page))
            return out
        except Exception:
            return []

    def _page_events(self, event: schema.Event, ledger: str, page: dict[str, Any]) -> list[schema.Event]:
        first, size, entries = page.get("first_slot"), page.get("page_size") or 1, page.get("entries")
        if type(first) is not int or not isinstance(entries, list):
            return []
        key = (ledger, first)
        track = self._tracks.get(key)
        if track is None and len(self._tracks) >= self.max_tracks:
            return []
        last = track[1] if track is not None else 0
        fresh = []
        for entry in entries:
            seq = entry.get("seq") if isinstance(entry, dict) else None
            if type(seq) is int and (seq > last or last - seq >= 1 << 31):  # not written already (seq wraps at 2^32)
                fresh.append(entry)
                last = seq
        if not fresh:
            return []
        out: list[schema.Event] = []
        if track is None:
            track = self._tracks[key] = [FIRST_TRACK_TID + len(self._tracks), 0]
            slots = f"slot {first}" if size == 1 else f"slots {first}-{first + size - 1}"
            out.append(
                schema.Event(
                    ph="M", name=schema.THREAD_NAME, pid=event.pid, tid=track[0], args={"name": f"{slots} ({ledger})" if ledger else slots}
                )
            )
        track[1] = last
        dumped_by = str(event.args.get("kind") or event.name)
        for entry in fresh:
            ago = entry.get("ago_ms")
            ts = event.ts - (ago * 1000.0 if type(ago) is int else 0.0)
            args = {k: entry.get(k) for k in ("seq", "site", "row", "rid", "thread") if entry.get(k) not in (None, "")}
            args["dumped_by"] = dumped_by
            out.append(
                schema.Event(
                    ph="i", name=str(entry.get("op") or "?"), pid=event.pid, ts=ts, cat=schema.CAT_HISTORY, tid=track[0], args=args
                )
            )
        return out
