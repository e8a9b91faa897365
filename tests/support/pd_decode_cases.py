"""Drives SGLang's own PD decode transfer queue under the probe, one trace per case, and prints what
SGLang's pools did (`RESULT {json}`).

    python tests/support/pd_decode_cases.py ABORTED_TRACE STUCK_TRACE [ABORTED_OFF_TRACE]

Run in a fresh interpreter with the release under test first on PYTHONPATH. SGLang's: the pools
(`DecodeReqToTokenPool`, `TokenToKVPoolAllocator` of 8 slots, one request's, and what a decode server
without a radix cache builds beside them: `ChunkCache`, from 0.5.20 a disabled `UnifiedRadixCache`), the
preallocation (`alloc_for_decode_prealloc`, `kv_to_page_indices`), `DecodeTransferQueue.extend` and
`pop_transferred` (its `poll_and_all_reduce` over a gloo group of one rank, `release_kv_cache`),
`Scheduler.abort_request` (on a `Scheduler` given the fields its `__init__` sets for this path: a
whole scheduler needs a model worker), `MetadataBuffers`, and from 0.5.19 the deferred release
(`resolve_deferred_releases` over a `CommonKVManager`'s drain-ack table, the ack handed in as the
decode's receiver thread does).

The receiver is the network's end: `DrivenKVReceiver` below plays a Mooncake receiver's part (what its
`poll` reads from the manager's status table, which the prefill's messages fill): its state is the one
the case drives; `abort` does what `CommonKVReceiver.abort` does (Failed, the ABORT sent to the prefill,
and where deferred release is on, the room armed for the drain ack).

- aborted: a request's pages are sent to the prefill (WaitingForInput), SGLang polls it Transferring,
  the client aborts it (`abort_request`), SGLang polls it Failed. Up to 0.5.20 (by default; always up
  to 0.5.18) `pop_transferred` frees its pages at once and the next request is handed them while the
  writer may still write (sglang#24527); from 0.5.21 they are held until the prefill's drain ack
  (PR#35049, on by default), which the case then hands in.
- stuck: a request whose transfer stays Transferring over several polls (sglang#9266, PR#31800), with
  the probe's deadline at 0 s.
- aborted_off (releases with deferred release, optional): the aborted case with
  SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE off, 0.5.19's and 0.5.20's default.
"""

import inspect
import json
import os
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")

PAGE, TOKENS, ROOM = 1, 8, 7001
SERVER_ARGS: list = []


class OutputStreamer:
    """Where the scheduler streams a request's output (the tokenizer's socket in a server)."""

    def __init__(self) -> None:
        self.sent: list = []

    def stream_output(self, reqs, return_logprob, *args, **kwargs) -> None:
        self.sent.extend(r.rid for r in reqs)

    def send_output(self, output, recv_obj=None) -> None:
        self.sent.append(getattr(output, "rid", None))


class DrivenKVReceiver:
    """The decode's end of one transfer, driven by the case (see the module's docstring)."""

    def __init__(self, kv_mgr, room: int) -> None:
        from sglang.srt.disaggregation.base.conn import KVPoll

        self.kv_mgr, self.bootstrap_room, self.poll_state = kv_mgr, room, KVPoll.Bootstrapping
        self.conclude_state = None
        self.abort_notified = False
        self.bootstrap_infos = [{"rank": 0}]  # one prefill rank
        self.require_staging = False
        self.init_time = None
        self.sent_pages: list = []

    def init(self, *args, **kwargs) -> None:
        from sglang.srt.disaggregation.base.conn import KVPoll

        self.poll_state = KVPoll.WaitingForInput

    def send_metadata(self, kv_indices, *args, **kwargs) -> None:
        self.sent_pages = [int(p) for p in kv_indices]
        self.init_time = time.time()

    def poll(self):
        return self.conclude_state if self.conclude_state is not None else self.poll_state

    def abort(self) -> None:
        from sglang.srt.disaggregation.base.conn import KVPoll

        self.conclude_state = KVPoll.Failed
        self.ensure_abort_notified()

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        if self.abort_notified:
            return
        if getattr(self.kv_mgr, "enable_deferred_decode_kv_release", False):
            self.generation = self.kv_mgr.register_deferred_abort_room(self.bootstrap_room)
        self.abort_notified = True  # the ABORT went to the prefill

    def failure_exception(self):
        raise RuntimeError(f"KVTransferError(bootstrap_room={self.bootstrap_room}): Aborted by AbortReq.")

    def clear(self) -> None:
        return None


def publish_server_args():
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path="dummy", device="cpu", page_size=PAGE, disaggregation_mode="decode")
    try:
        from sglang.srt.runtime_context import get_context

        get_context().set_server_args(args)
    except ImportError:
        from sglang.srt.server_args import set_global_server_args_for_scheduler

        set_global_server_args_for_scheduler(args)
    return args


def deferred_release_default() -> bool:
    """SGLang's own default for SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE (absent before 0.5.19)."""
    from sglang.srt.environ import envs

    flag = getattr(envs, "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", None)
    return bool(flag.get()) if flag is not None else False


def kv_manager():
    """A `CommonKVManager` carrying only its deferred-release state, as SGLang's own unit tests build one
    (its `__init__` opens the bootstrap sockets); a Mooncake manager supports deferred release."""
    from sglang.srt.disaggregation.common.conn import CommonKVManager

    mgr = CommonKVManager.__new__(CommonKVManager)
    mgr.enable_deferred_decode_kv_release = deferred_release_default()
    mgr._deferred_abort_ack_tracker = {}
    mgr._deferred_abort_generation = 0
    return mgr


def build(server_args):
    import torch
    from sglang.srt.disaggregation import decode
    from sglang.srt.disaggregation.utils import DisaggregationMode, MetadataBuffers, ReqToMetadataIdxAllocator
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams

    try:
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    except ImportError:
        from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

    pool = decode.DecodeReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False, pre_alloc_size=4)
    allocator = TokenToKVPoolAllocator(TOKENS, dtype=torch.float16, device="cpu", kvcache=None, need_sort=False)
    params = CacheInitParams(disable=True, req_to_token_pool=pool, token_to_kv_pool_allocator=allocator, page_size=PAGE)
    try:  # what a decode server without a radix cache builds: a ChunkCache, from 0.5.20 a disabled UnifiedRadixCache
        from sglang.srt.mem_cache.chunk_cache import ChunkCache

        tree = ChunkCache(params)
    except ImportError:
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

        params.tree_components = (ComponentType.FULL,)
        tree = UnifiedRadixCache(params)
    wanted = inspect.signature(MetadataBuffers).parameters
    buffers = MetadataBuffers(4, 8, torch.float32, **({"max_sampling_mask_tokens": 0} if "max_sampling_mask_tokens" in wanted else {}))
    scheduler = Scheduler.__new__(Scheduler)
    transfer = decode.DecodeTransferQueue.__new__(decode.DecodeTransferQueue)
    prealloc = decode.DecodePreallocQueue.__new__(decode.DecodePreallocQueue)
    prealloc.queue, prealloc.retracted_queue, prealloc.pending_reqs = [], [], []
    prealloc._num_published_destinations = 0
    prealloc.req_to_token_pool, prealloc.token_to_kv_pool_allocator, prealloc.tree_cache = pool, allocator, tree
    prealloc.token_to_kv_pool, prealloc.scheduler = allocator.get_kvcache(), scheduler
    import torch.distributed as dist
    from sglang.srt.environ import envs

    timeout = getattr(envs, "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT", None)
    fields = dict(  # DecodeTransferQueue.__init__'s, by release
        queue=[],
        gloo_group=dist.group.WORLD,
        req_to_metadata_buffer_idx_allocator=ReqToMetadataIdxAllocator(4),
        tp_rank=0,
        metadata_buffers=buffers,
        scheduler=scheduler,
        tree_cache=tree,
        spec_algorithm=None,
        enable_staging=False,
        staging_handler=None,
        enable_host_receive=False,
        enable_deferred_kv_release=deferred_release_default(),
        deferred_kv_release_timeout=timeout.get() if timeout is not None else 30.0,
        _deferred_releases=[],
        _skipped_checksum_signatures=set(),
    )
    for name, value in fields.items():
        setattr(transfer, name, value)

    class Parallel:  # one rank, no pipeline
        pp_size = 1

    streamer = OutputStreamer()

    class Metrics:
        enable_metrics = False

    for name, value in dict(
        server_args=server_args,
        chunked_req=None,
        waiting_queue=[],
        enable_hicache_storage=False,
        ipc_channels=type("Channels", (), {"send_to_tokenizer": streamer})(),
        send_to_tokenizer=streamer,
        output_streamer=streamer,
        disaggregation_mode=DisaggregationMode.DECODE,
        dllm_config=None,
        mm_receiver=None,
        grammar_manager=type("Grammars", (), {"abort_requests": lambda self, recv: None})(),
        disagg_decode_prealloc_queue=prealloc,
        disagg_decode_transfer_queue=transfer,
        ps=Parallel(),
        running_batch=None,
        last_batch=None,
        running_mbs=[],
        mbs=[],
        enable_continuous_input_polling=False,
        result_queue=[],
        enable_decode_hicache=False,
        enable_hisparse=False,
        metrics_reporter=Metrics(),
        spec_algorithm=None,
        req_to_token_pool=pool,
        token_to_kv_pool_allocator=allocator,
        tree_cache=tree,
    ).items():
        setattr(scheduler, name, value)
    return {
        "decode": decode,
        "prealloc": prealloc,
        "pool": pool,
        "allocator": allocator,
        "tree": tree,
        "scheduler": scheduler,
        "transfer": transfer,
    }


def request(rid: str, room: int):
    from array import array

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(rid, "", array("q", range(100, 100 + TOKENS)), SamplingParams(max_new_tokens=4))
    req.bootstrap_host, req.bootstrap_port, req.bootstrap_room = "2.2.2.2", 8998, room
    return req


def row_of(req):
    kv = getattr(req, "kv", None)
    return getattr(kv, "req_pool_idx", None) if kv is not None and hasattr(kv, "req_pool_idx") else req.req_pool_idx


def preallocate(env, rid: str, room: int, mgr):
    """What `DecodePreallocQueue.pop_preallocated` does for one request past its bootstrap: SGLang's
    `_pre_alloc` (its row, its pages), the pages sent to the prefill (`send_metadata`), the request
    handed to the transfer queue (`extend`)."""

    decode = env["decode"]
    req = request(rid, room)
    env["prealloc"]._pre_alloc(req)
    row = row_of(req)
    locs = env["pool"].req_to_token[row][:TOKENS]
    receiver = DrivenKVReceiver(mgr, room)
    receiver.init(0)
    pages = decode.kv_to_page_indices(env["pool"].req_to_token[row][:TOKENS], PAGE)
    receiver.send_metadata(pages, 0, None)
    decode_req = decode.DecodeRequest(req=req, kv_receiver=receiver, waiting_for_input=True)
    decode_req.metadata_buffer_index = env["transfer"].req_to_metadata_buffer_idx_allocator.alloc()
    env["transfer"].extend([decode_req])
    return decode_req, sorted(set(int(s) // PAGE for s in locs.tolist()))


def next_request(env, mgr, steps: list) -> list:
    """The next request to come: its pages, once the allocator has them (what `pop_preallocated`
    checks first); [] while it waits."""
    free = int(env["allocator"].available_size())
    if free < TOKENS:
        steps.append({"step": "next request waits", "free": free})
        return []
    _, pages = preallocate(env, "req-next", ROOM + 1, mgr)
    steps.append({"step": "next request", "pages": pages})
    return pages


def aborted_case() -> dict:
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.managers.io_struct import AbortReq

    env, mgr = build(SERVER_ARGS[0]), kv_manager()
    decode_req, pages = preallocate(env, "req-aborted", ROOM, mgr)
    transfer, receiver = env["transfer"], decode_req.kv_receiver
    steps = []
    receiver.poll_state = KVPoll.Transferring  # the prefill's first chunk landed
    transfer.pop_transferred()
    steps.append({"step": "polled", "queue": len(transfer.queue)})
    wanted = inspect.signature(AbortReq).parameters
    env["scheduler"].abort_request(AbortReq(rid="req-aborted", **({"abort_all": False} if "abort_all" in wanted else {})))
    steps.append({"step": "abort_request", "conclude_state": int(receiver.conclude_state)})
    transfer.pop_transferred()
    held = len(getattr(transfer, "_deferred_releases", []))
    steps.append({"step": "polled failed", "queue": len(transfer.queue), "held": held, "row": row_of(decode_req.req)})
    next_pages = next_request(env, mgr, steps)
    if held:
        ack = {}
        try:
            from sglang.srt.disaggregation.common.conn import AbortAck

            ack = {"generation": receiver.generation} if "generation" in inspect.signature(AbortAck).parameters else {}
            mgr.handle_abort_ack_message(AbortAck(room=ROOM, prefill_rank=0, **ack).to_zmq())
        except ImportError:
            mgr.note_abort_ack(ROOM, 0)
        transfer.resolve_deferred_releases()
        steps.append({"step": "drain ack", "held": len(transfer._deferred_releases), "row": row_of(decode_req.req)})
        next_pages = next_pages or next_request(env, mgr, steps)
    return {"pages": pages, "steps": steps, "reused": sorted(set(pages) & set(next_pages)), "deferred_default": deferred_release_default()}


def stuck_case() -> dict:
    from sglang.srt.disaggregation.base.conn import KVPoll

    env, mgr = build(SERVER_ARGS[0]), kv_manager()
    decode_req, pages = preallocate(env, "req-stuck", ROOM + 2, mgr)
    decode_req.kv_receiver.poll_state = KVPoll.Transferring
    for _ in range(3):
        env["transfer"].pop_transferred()
    return {"pages": pages, "queue": len(env["transfer"].queue)}


def main() -> None:
    from kvdoctor.probe.core import runtime

    probe = runtime.activate(sys.argv[1]) if len(sys.argv) > 1 else None
    import sglang
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tempfile.mktemp(prefix='gloo-')}", rank=0, world_size=1)
    SERVER_ARGS.append(publish_server_args())
    result = {"version": sglang.__version__, "map": getattr(getattr(probe, "maps", {}).get("sglang"), "source", None)}
    result["aborted"] = aborted_case()
    runtime.deactivate()
    if len(sys.argv) > 3:
        from sglang.srt.environ import envs

        runtime.activate(sys.argv[3])
        with envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE.override(False):
            result["aborted_off"] = aborted_case()
        runtime.deactivate()
    if len(sys.argv) > 2:
        os.environ["KVDOCTOR_PD_TRANSFER_DEADLINE_S"] = "0"
        runtime.activate(sys.argv[2])
        result["stuck"] = stuck_case()
        runtime.deactivate()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
