"""graph_replay_during_load: a CUDA graph replayed while a HiCache load for the batch was in flight."""

from typing import Any

from kvdoctor.analysis.detectors.base import ViolationDetector
from kvdoctor.trace import schema


class GraphReplayDuringLoadDetector(ViolationDetector):
    kind = schema.GRAPH_REPLAY_DURING_LOAD
    unit = "replays"

    def message(self, count: int, allocator: str, site: str, evidence: dict[str, Any]) -> str:
        batch = ""
        if evidence.get("forward_mode") is not None:  # a runner's execute(forward_batch) (0.5.14 on) names its batch
            rids = evidence.get("rids")
            named = f": {', '.join(str(r) for r in rids[:4])}{', ...' if len(rids) > 4 else ''}" if isinstance(rids, list) and rids else ""
            batch = f" (first: a {evidence['forward_mode']} batch of {evidence.get('batch_size', '?')}{named})"
        nodes = evidence.get("load_node_ids")
        loading = f" (loading tree nodes {', '.join(str(n) for n in nodes[:8])})" if isinstance(nodes, list) and nodes else ""
        return (
            f"{count} CUDA graph replay(s) by {evidence.get('graph_runner', 'a graph runner')}{batch} started while "
            f"{evidence.get('loads_in_flight', 'some')} HiCache host-to-device load(s){loading} were still in flight; the graph "
            "reads KV rows the load stream has not finished writing (kvdoctor run --fix graph-guard orders them)"
        )
