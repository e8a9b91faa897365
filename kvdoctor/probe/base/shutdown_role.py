"""The role in front of the engine's kill: the census asked of every probed process first (the
rendezvous it waits on is `shutdown.py`'s)."""

from __future__ import annotations

from typing import Any

from kvdoctor.probe.base.context import Args, Hook, Kwargs, ProbeContext, Role
from kvdoctor.trace import schema


class ShutdownRole(Role):
    """The engine's launcher is about to end its engine processes (SGLang's `kill_process_tree`
    sends SIGKILL; vLLM's `shutdown(procs)` sends SIGTERM and SIGKILL soon after), where no exit
    census may run. Their probes are asked for a census first, and the kill waits for their
    answers (bounded: see the module's docstring)."""

    runs_first = True

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        rendezvous = probe.rendezvous
        if rendezvous is None or rendezvous.asked_others:
            return None
        outcome = rendezvous.ask_and_wait()
        if not outcome["asked"]:
            return None
        answered = outcome["answered"]
        censuses = ", ".join(f"pid {pid}: {a.get('census')}" for pid, a in sorted(answered.items()))
        reason = f"census asked of {len(outcome['asked'])} probed process(es) before the engine's kill, waited {outcome['waited_s']} s"
        if censuses:
            reason += f" ({censuses})"
        if outcome["unanswered"]:
            reason += f"; no answer from pid(s) {', '.join(map(str, outcome['unanswered']))}: their last census stands"
        probe.emitter.emit(
            schema.PROBE_STATUS,
            {
                "component": "shutdown",
                "state": "on",
                "reason": reason,
                "waited_s": outcome["waited_s"],
                "unanswered": outcome["unanswered"],
            },
        )
        probe.emitter.flush()  # the kill may take this process too (include_parent=True ends in SIGKILL)
        return None
