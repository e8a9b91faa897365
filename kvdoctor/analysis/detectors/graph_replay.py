"""graph_replay_during_load: a CUDA graph replayed while a HiCache load for the batch was in flight."""

from typing import Any

from kvdoctor.analysis.detectors.base import ViolationDetector
from kvdoctor.trace import schema


class GraphReplayDuringLoadDetector(ViolationDetector):
    kind = schema.GRAPH_REPLAY_DURING_LOAD

    def message(self, count: int, allocator: str, site: str, evidence: dict[str, Any]) -> str:
        return (
            f"{count} CUDA graph replay(s) by {evidence.get('graph_runner', 'a graph runner')} started while "
            f"{evidence.get('loads_in_flight', 'some')} HiCache host-to-device load(s) were still in flight; the graph "
            "reads KV rows the load stream has not finished writing (kvdoctor run --fix graph-guard orders them)"
        )
