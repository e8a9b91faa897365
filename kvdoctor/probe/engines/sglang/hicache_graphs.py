"""CUDA graph replays while a HiCache host-to-device load is in flight (seed 002): named as
`graph_replay_during_load`, and with `--fix graph-guard` made to wait on the load's finish events on
the replay's own stream (no host synchronisation)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from kvdoctor.probe.base.context import Args, Hook, Kwargs, Role
from kvdoctor.probe.engines.sglang.hicache import MAX_NAMED, HiCacheLedger, HiCacheRole
from kvdoctor.trace import schema

if TYPE_CHECKING:
    from kvdoctor.probe.base.context import ProbeContext


class InFlight(NamedTuple):
    """HiCache host-to-device loads not finished yet: how many, their finish events (what graph-guard
    waits on) and the tree nodes they load (read from each ack, on the host)."""

    pending: int
    events: list[Any]
    node_ids: list[Any]


def loads_in_flight(st: HiCacheLedger) -> InFlight:
    """Loads queued or copying on the load stream; never blocks (cudaEventQuery)."""
    pending = 0
    events = []
    node_ids: list[Any] = []
    for controller in list(st.controllers.values()):
        pending += len(getattr(controller, "load_queue", ()) or ())
        for ack in list(getattr(controller, "ack_load_queue", ()) or ()):
            finish = getattr(ack, "finish_event", None)
            if finish is None and isinstance(ack, tuple) and len(ack) > 1:
                finish = ack[1]
            try:
                done = bool(finish.query()) if finish is not None else True
            except Exception:
                done = True
            if not done:
                pending += 1
                events.append(finish)
                nodes = getattr(ack, "node_ids", None)
                if isinstance(nodes, list) and len(node_ids) < MAX_NAMED:
                    node_ids.extend(nodes[: MAX_NAMED - len(node_ids)])
    return InFlight(pending, events, node_ids)


class GraphReplayRole(HiCacheRole):
    """A graph runner's replay (`CudaGraphRunner.replay` up to 0.5.13): a replay that starts while a
    HiCache load is still copying is a violation; with graph-guard the current stream, the one the
    replay runs on, waits on the loads' finish events (on the device)."""

    wants_site = True

    def batch_evidence(self, hook: Hook, args: Args, kwargs: Kwargs) -> dict[str, Any]:
        """What the call says of the batch being replayed ({} where the role reads no argument)."""
        return {}

    def before(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, site: int) -> Any:
        st = probe.states.get("hicache")
        if not isinstance(st, HiCacheLedger):
            return None
        st.counts["graph_replays"] += 1
        in_flight = loads_in_flight(st)
        if in_flight.pending:
            st.counts["graph_replays_during_load"] += 1
            probe.emitter.emit(
                schema.VIOLATION,
                {
                    "kind": schema.GRAPH_REPLAY_DURING_LOAD,
                    "count": 1,
                    "site": probe.sites.name(site),
                    "graph_runner": type(obj).__name__,
                    "loads_in_flight": in_flight.pending,
                    "note": "the graph reads KV rows a HiCache load is still copying on its side stream",
                    **self.batch_evidence(hook, args, kwargs),
                    **({"load_node_ids": in_flight.node_ids} if in_flight.node_ids else {}),
                },
            )
        return in_flight.events

    def rewrite(self, probe: ProbeContext, hook: Hook, obj: Any, args: Args, kwargs: Kwargs, ctx: Any) -> tuple[Args, Kwargs]:
        if "graph-guard" in probe.fixes and ctx:
            import torch

            stream = torch.cuda.current_stream()
            for event in ctx:
                stream.wait_event(event)
            probe.fixed("graph-guard", len(ctx))
        return args, kwargs


class GraphExecuteRole(GraphReplayRole):
    """`execute(forward_batch, ...)` of the graph runners from 0.5.14 on (decode and target verify,
    prefill, the EAGLE draft and draft-extend runners), and `CudaGraphRunner.replay(forward_batch,
    ...)` before them (0.5.2-0.5.13): the same check and the same guard, and the
    violation names the batch from what lives on the host (no value read from the device): its
    forward mode, size, request ids, how many KV slots it writes (`out_cache_loc`'s length, a
    shape), the stream the replay is issued on, and the tree nodes the loads in flight bring back."""

    reads = {"forward_batch": 0}

    def batch_evidence(self, hook: Hook, args: Args, kwargs: Kwargs) -> dict[str, Any]:
        batch = hook.arg(args, kwargs, "forward_batch")
        if batch is None:
            return {}
        out: dict[str, Any] = {}
        mode = getattr(batch, "forward_mode", None)
        if mode is not None:
            out["forward_mode"] = str(getattr(mode, "name", mode))
        size = getattr(batch, "batch_size", None)
        if isinstance(size, int):
            out["batch_size"] = size
        rids = getattr(batch, "rids", None)
        if isinstance(rids, list) and rids:
            out["rids"] = [str(r) for r in rids[:MAX_NAMED]]
        slots = getattr(batch, "out_cache_loc", None)
        shape = getattr(slots, "shape", None)
        if shape is not None and len(shape) >= 1:
            out["slots"] = int(shape[0])
            if getattr(slots, "is_cuda", False):
                out["stream"] = replay_stream(slots)
        return out


def replay_stream(on_device: Any) -> int:
    """The id of the current CUDA stream of the tensor's device: the stream the replay is issued on
    and graph-guard makes wait (a host-side lookup, no synchronisation)."""
    import torch

    return int(torch.cuda.current_stream(on_device.device).cuda_stream)


ROLES: dict[str, Role] = {"graph_replay": GraphReplayRole(), "graph_execute": GraphExecuteRole()}
