"""Gives and takes back PD metadata buffer rows through SGLang's own `ReqToMetadataIdxAllocator`, under
the probe, one trace per case, and prints what SGLang's allocator held (`RESULT {json}`).

    python tests/support/metadata_pool_cases.py CLEAN LEAK DOUBLE_FREE BEHIND

Run in a fresh interpreter with the release under test first on PYTHONPATH. SGLang's: the allocator,
the requests (`Req`), the prefill's `PrefillBootstrapQueue.ensure_metadata_buffer` (a queue given only
the allocator its `__init__` sets: the rest needs a model worker and a transfer backend) and
`maybe_release_metadata_buffer`, the two calls a PD prefill server gives and takes back a row with.

- clean: four requests take a row each, all give it back, two more take and give back theirs.
- leak: three take a row, two give it back, the third is dropped holding its row.
- double_free: a request takes a row and gives it back; the case frees the index once more (the
  decode's `free(idx)` checks nothing either) and frees one past its rows, then a new request takes a row.
- behind: two take a row; one's index goes back on the allocator's `free_slots` behind the probe's
  back and the request is dropped; the other is dropped holding its row. The books do not balance.
"""

import gc
import json
import sys
import warnings
from array import array

warnings.filterwarnings("ignore")

ROWS = 8


def main() -> None:
    from kvdoctor.probe.core import runtime

    clean, leak, double_free, behind = sys.argv[1:5]
    probe = runtime.activate(clean)
    import sglang
    from sglang.srt.disaggregation import prefill
    from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    def request(rid: str) -> Req:
        return Req(rid, "", array("q", range(100, 108)), SamplingParams(max_new_tokens=4))

    def queue_of(allocator: ReqToMetadataIdxAllocator) -> prefill.PrefillBootstrapQueue:
        queue = object.__new__(prefill.PrefillBootstrapQueue)
        queue.req_to_metadata_buffer_idx_allocator = allocator
        return queue

    def take(queue: prefill.PrefillBootstrapQueue, req: Req) -> int:
        assert queue.ensure_metadata_buffer(req)
        return req.metadata_buffer_index

    def give_back(queue: prefill.PrefillBootstrapQueue, req: Req) -> None:
        prefill.maybe_release_metadata_buffer(req, queue.req_to_metadata_buffer_idx_allocator)

    out: dict = {"version": sglang.__version__, "map": getattr(probe.maps.get("sglang"), "source", None)}

    allocator = ReqToMetadataIdxAllocator(ROWS)
    queue = queue_of(allocator)
    reqs = [request(f"clean-{n}") for n in range(4)]
    for req in reqs:
        take(queue, req)
    for req in reqs:
        give_back(queue, req)
    for req in [request("clean-4"), request("clean-5")]:
        take(queue, req)
        give_back(queue, req)
    out["clean"] = {"free": sorted(allocator.free_slots), "listed": len(allocator.free_slots)}
    runtime.deactivate()

    probe = runtime.activate(leak)
    allocator = ReqToMetadataIdxAllocator(ROWS)
    queue = queue_of(allocator)
    reqs = [request(f"leak-{n}") for n in range(3)]
    taken = [take(queue, req) for req in reqs]
    give_back(queue, reqs[0])
    give_back(queue, reqs[1])
    del reqs
    gc.collect()
    out["leak"] = {"taken": taken, "leaked": taken[2], "free": len(allocator.free_slots)}
    runtime.deactivate()

    probe = runtime.activate(double_free)
    allocator = ReqToMetadataIdxAllocator(ROWS)
    queue = queue_of(allocator)
    first = request("df-0")
    index = take(queue, first)
    give_back(queue, first)
    allocator.free(index)  # the second free
    allocator.free(ROWS)  # a row the pool does not have
    second = request("df-1")
    take(queue, second)
    out["double_free"] = {"index": index, "listed": list(allocator.free_slots), "second_took": second.metadata_buffer_index}
    runtime.deactivate()

    probe = runtime.activate(behind)
    allocator = ReqToMetadataIdxAllocator(ROWS)
    queue = queue_of(allocator)
    reqs = [request(f"behind-{n}") for n in range(2)]
    taken = [take(queue, req) for req in reqs]
    allocator.free_slots.append(reqs[0].metadata_buffer_index)  # freed by a path the probe does not hook
    reqs[0].metadata_buffer_index = -1
    del reqs
    gc.collect()
    out["behind"] = {"taken": taken, "free": len(allocator.free_slots)}
    runtime.deactivate()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
