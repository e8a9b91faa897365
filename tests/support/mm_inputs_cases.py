"""Runs image requests through SGLang's own prefill, decode and result processing under the probe,
and prints what SGLang's objects still held of their pixel values (`RESULT {json}`).

    python tests/support/mm_inputs_cases.py TRACE
    KVDOCTOR_MM_DEVICE=cuda python tests/support/mm_inputs_cases.py TRACE   # the batch on a GPU

Run in a fresh interpreter with the release under test first on PYTHONPATH. The scheduler, pools
and tiny model config are retract_cases.py's `build` (plain loop: each result is processed before
the next plan). SGLang's own: the requests (`Req`), their multimodal inputs (`MultimodalDataItem`
with a pixel-value tensor, made into `MultimodalInputs` by `Scheduler._get_multimodal_inputs` and
given to the request by `Req.extend_image_inputs`, as `handle_generate_request` does), the batch
(`ScheduleBatch.init_new`, `prepare_for_extend`, which moves each feature to the batch's device and
writes it back into its item), the loop's steps `Scheduler.process_batch_result` (prefill and decode,
with the finish checks, the release into the radix tree and the streamed output) and
`Scheduler.update_running_batch` (its `filter_batch` and `prepare_for_decode`), and where the loop
keeps the running batch (`Scheduler.running_batch`). Not SGLang's: the forward (what `run_batch`
returns is made here: `forward_ct += 1` and counted-up token ids, as retract_cases.py does), the
image processor (the pixel values are random, the image's pad tokens plain token ids), and the
order of the loop's steps, written out here as `event_loop_normal` runs them. The batch's device is
the CPU unless `KVDOCTOR_MM_DEVICE` names another (`cuda`: the pools are on the GPU, so
`prepare_for_extend` moves the pixel values there, and SGLang's Triton kernels write the request rows;
the forward's token ids are then made on the GPU, as a model's sampler leaves them).

On a GPU the result also says what `torch.cuda.memory_allocated()` read: before the image requests,
after their prefill batch was made, at idle, and after the probe was deactivated and the running
batch's `multimodal_inputs` list dropped (`memory`); and every synchronizing CUDA call the run made,
from the probe's activation to its deactivation, under `torch.cuda.set_sync_debug_mode("warn")`, by
the innermost Python frame that made it (`syncs`: SGLang's own path synchronizes, e.g.
`process_batch_result` reads the sampled token ids with `tolist()`, so "error" mode cannot be held
over it). tests/gpu/bugs/test_sglang_7340_8429_8902.py runs it on 0.5.7 and 0.5.8 and judges what it printed.

Two image requests (each one item of 2x3x32x32 float32 pixel values, 24576 bytes) prefill together
and finish at their second token, in a decode step; `update_running_batch` then filters the running
batch to empty. A text request comes next and finishes at its prefill, its empty batch is not merged,
and the engine is idle until exit. Where a request can belong to a session (0.5.12 on), one more
image request of a `Session` then finishes at its prefill: SGLang keeps a session's media for its
next turn, on purpose. The script keeps no reference to the requests or their tensors, only weak
ones: what keeps a tensor alive is SGLang's.
"""

import gc
import inspect
import json
import os
import sys
import time
import warnings
import weakref
from array import array

from retract_cases import Socket, build

warnings.filterwarnings("ignore")

SHAPE = (2, 3, 32, 32)
DEVICE = os.environ.get("KVDOCTOR_MM_DEVICE", "cpu")
LEFT: dict = {}  # on a GPU: what main measures after the probe is deactivated


def make_req(scheduler, rid: str, prompt: list, max_new_tokens: int, image: bool, session=None):
    import torch
    from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem, Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    if isinstance(Req(rid, "", [1], params).output_ids, array):  # token ids are an array("q") from 0.5.20
        prompt = array("q", prompt)
    req = Req(rid, "", prompt, params, vocab_size=scheduler.model_config.vocab_size, **({"session": session} if session else {}))
    req.sampling_params.normalize(None)
    if image:
        item = MultimodalDataItem(modality=Modality.IMAGE, feature=torch.randn(*SHAPE), offsets=[(1, 4)])
        try:  # what the tokenizer manager sends: a dict up to 0.5.19, then a MultimodalProcessorOutput
            from sglang.srt.managers.schedule_batch import MultimodalProcessorOutput
        except ImportError:
            processed = {"mm_items": [item]}
        else:
            processed = MultimodalProcessorOutput(mm_items=[item])
        if hasattr(scheduler, "_get_multimodal_inputs"):
            req.extend_image_inputs(scheduler._get_multimodal_inputs(processed))
        else:  # before 0.5.7 handle_generate_request calls MultimodalInputs.from_dict itself
            from sglang.srt.managers.schedule_batch import MultimodalInputs

            req.extend_image_inputs(MultimodalInputs.from_dict(processed))
    return req


def run() -> dict:
    import torch
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler import GenerationBatchResult
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from kvdoctor.probe.engines.sglang.mm_inputs import features

    scheduler = build(False, DEVICE)
    cuda = DEVICE != "cpu"
    memory = {"before_images": torch.cuda.memory_allocated()} if cuda else None
    scheduler.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)  # as Scheduler.__init__ sets it
    if hasattr(scheduler, "init_batch_result_processor"):
        components(scheduler)
    tree = scheduler.tree_cache
    steps = []

    def new_batch(reqs):
        for req in reqs:
            req.init_next_round_input(tree)
            if "extend_end" in vars(req):  # 0.5.23: PrefillAdder sets the round's end, the whole prompt here
                req.extend_end = len(req.full_untruncated_fill_ids)
            tree.inc_lock_ref(req.last_node)  # what PrefillAdder does for a request it takes
        batch = ScheduleBatch.init_new(
            reqs,
            scheduler.req_to_token_pool,
            scheduler.token_to_kv_pool_allocator,
            tree,
            scheduler.model_config,
            False,
            SpeculativeAlgorithm.NONE,
        )
        batch.prepare_for_extend()
        return batch

    def forward(batch, step: str) -> None:
        scheduler.forward_ct += 1
        if hasattr(batch, "launch_ts"):  # what run_batch records of a launch, from 0.5.23
            batch.forward_iter, batch.launch_ts, batch.after_idle_gap = scheduler.forward_ct, time.monotonic(), False
        tokens = torch.arange(len(batch.reqs), dtype=torch.int64, device=DEVICE) + 40 + scheduler.forward_ct
        batch.output_ids = tokens
        scheduler.process_batch_result(batch, GenerationBatchResult(next_token_ids=tokens))
        steps.append(
            {
                "step": step,
                "finished": [r.rid for r in batch.reqs if r.finished()],
                "req_features": {r.rid: feature_bytes(r.multimodal_inputs) for r in batch.reqs},
                # what the probe's reader finds in the same inputs (mm_inputs.features)
                "probe_reads": {r.rid: sum(int(t.nbytes) for t in features(r.multimodal_inputs)) for r in batch.reqs},
            }
        )

    images = [make_req(scheduler, f"img-{n}", list(range(10 + 10 * n, 18 + 10 * n)), 2, True) for n in range(2)]
    batch = new_batch(images)
    # the features prepare_for_extend left in the items: moved to the batch's device (the same tensors on the CPU)
    watched = {r.rid: [weakref.ref(i.feature) for i in r.multimodal_inputs.mm_items] for r in images}
    devices = {r.rid: sorted({str(i.feature.device) for i in r.multimodal_inputs.mm_items}) for r in images}
    del images
    if cuda:
        memory["after_prefill_batch"] = torch.cuda.memory_allocated()
    forward(batch, "prefill img-0, img-1")
    # get_next_batch_to_run: the prefill batch, filtered, becomes the running batch (it was empty)
    batch.filter_batch()
    scheduler.running_batch = batch
    scheduler.running_batch = scheduler.update_running_batch(scheduler.running_batch)
    forward(scheduler.running_batch, "decode img-0, img-1")
    # the next plan: update_running_batch filters both finished requests out; the batch stays the running one
    scheduler.running_batch = scheduler.update_running_batch(scheduler.running_batch)
    del batch
    text = new_batch([make_req(scheduler, "text-0", list(range(60, 66)), 1, False)])
    forward(text, "prefill text-0")
    text.filter_batch()  # get_next_batch_to_run: empty once filtered, so not merged; then idle
    del text
    if "session" in inspect.signature(Req).parameters:  # a session's request keeps its media for the next turn
        from sglang.srt.session.session_controller import Session

        session = Session(capacity_of_str_len=4096, session_id="session-0")
        turn = make_req(scheduler, "sess-0", list(range(70, 78)), 1, True, session=session)  # its first turn
        kept = new_batch([turn])
        del turn
        forward(kept, "prefill sess-0")
        kept.filter_batch()
        del kept
    alive = {rid: sum(1 for ref in refs if ref() is not None) for rid, refs in watched.items()}
    running = scheduler.running_batch
    if cuda:
        gc.collect()
        memory["idle"] = torch.cuda.memory_allocated()
        memory["alive_feature_bytes_at_idle"] = sum(int(ref().nbytes) for refs in watched.values() for ref in refs if ref() is not None)
        LEFT.update(scheduler=scheduler, memory=memory, watched=watched)
    return {
        "steps": steps,
        "device": DEVICE,
        "feature_devices": devices,
        "feature_bytes": int(torch.empty(SHAPE).nbytes),
        "alive_at_idle": alive,  # pixel-value tensors still alive at idle, per request
        "running_batch": {"reqs": len(running.reqs), "multimodal_inputs": [feature_bytes(m) for m in (running.multimodal_inputs or [])]},
        "clears_at_finish": hasattr(type(scheduler), "_maybe_clear_mm_inputs"),
    }


def components(scheduler) -> None:
    """0.5.23's result processing goes through the scheduler's components (metrics reporter, load
    publisher and inquirer, output streamer, batch result processor): each built by the scheduler's
    own `init_*` method, as `Scheduler.__init__` calls them, from the fields they read (one rank, no
    model worker, no draft worker, no metrics)."""
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(attn_tp_rank=0, attn_cp_rank=0, pp_rank=0, attn_dp_rank=0, dp_rank=None)
    fields = dict(
        enable_priority_scheduling=False,
        enable_lora=False,
        enable_hierarchical_cache=False,
        enable_lmcache=False,
        enable_overlap_mlx=False,
        max_running_requests=4,
        max_req_len=64,
        kv_shard_widening=1,
        dllm_config=None,
        pool_stats_observer=None,
        tp_worker=None,
        model_worker=None,
        draft_worker=None,
        future_map=None,
        rust_server=None,
        hisparse_coordinator=None,
        decode_offload_manager=None,
        load_snapshot_writer=None,  # no DP balancing
        return_health_check_ipcs=[],  # no health check waiting
        enable_skip_finishing_decode=False,
        result_queue=[],
        schedule_policy="fcfs",
        schedule_low_priority_values_first=False,
        ipc_channels=type("Channels", (), {"send_to_detokenizer": Socket(), "send_to_tokenizer": Socket()})(),
    )
    for name, value in fields.items():
        setattr(scheduler, name, value)
    scheduler.init_metrics_collector()
    scheduler.init_metrics_reporter()
    scheduler.scheduler_stage_metrics = scheduler.metrics_reporter.scheduler_stage_metrics
    scheduler.init_schedule_policy()  # the decode plan's new-token ratio tracker
    scheduler.init_load_publisher()
    scheduler.init_load_inquirer()
    scheduler.init_output_streamer()
    scheduler.init_batch_result_processor()


def feature_bytes(mm_inputs) -> "int | None":
    """The bytes of the features a MultimodalInputs still holds (None: no inputs)."""
    if mm_inputs is None:
        return None
    return sum(int(i.feature.nbytes) for i in mm_inputs.mm_items if i.feature is not None)


class Syncs:
    """Every synchronizing CUDA call made inside (`torch.cuda.set_sync_debug_mode("warn")`), counted by
    the innermost Python frame outside torch that made it, whose file that frame is in (kvdoctor,
    sglang or this case), the phase (`run`: from the probe's activation through the case; `deactivate`:
    the probe's exit, its last counts and censuses) and, for the probe's, the chain of its frames."""

    def __init__(self) -> None:
        self.sites: dict = {}
        self.phase = "run"

    def __enter__(self):
        import torch

        self.catch = warnings.catch_warnings()
        self.catch.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self.show
        torch.cuda.set_sync_debug_mode("warn")
        self.phase = "run"
        return self

    def __exit__(self, *exc) -> None:
        import torch

        torch.cuda.set_sync_debug_mode("default")
        self.catch.__exit__(*exc)

    def show(self, message, category, filename, lineno, file=None, line=None) -> None:
        import traceback

        if "synchronizing" not in str(message):
            return

        def short(frame) -> str:
            name = frame.filename
            for cut in ("/kvdoctor/", "/sglang/", "/support/"):
                if cut in name:
                    name = cut.strip("/") + "/" + name.split(cut, 1)[1]
                    break
            return f"{name}:{frame.lineno} {frame.name}"

        frames = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename and "/warnings.py" not in f.filename]
        site = frames[-1] if frames else None
        where = "kvdoctor" if site and "/kvdoctor/" in site.filename else "sglang" if site and "/sglang/" in site.filename else "case"
        key = f"{where} [{self.phase}]: {short(site)}" if site else f"unknown [{self.phase}]"
        if where == "kvdoctor":  # the probe's own frames, outermost first: which of its parts synchronized
            key += " via " + " > ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.name}" for f in frames if "/kvdoctor/" in f.filename)
        self.sites[key] = self.sites.get(key, 0) + 1

    def summary(self) -> dict:
        by: dict = {}
        for key, n in self.sites.items():
            owner = key.split(":")[0]
            by[owner] = by.get(owner, 0) + n
        return {"total": sum(self.sites.values()), "by_owner": by, "sites": self.sites}


def main() -> None:
    import contextlib

    from kvdoctor.probe.core import runtime

    syncs = Syncs() if DEVICE != "cpu" else contextlib.nullcontext()
    with syncs:
        probe = runtime.activate(sys.argv[1])
        import sglang

        result = {"version": sglang.__version__, "case": run()}
        result["map"] = getattr(probe.maps.get("sglang"), "source", None)
        if DEVICE != "cpu":
            syncs.phase = "deactivate"
        runtime.deactivate()
    if DEVICE != "cpu":
        import torch

        result["syncs"] = syncs.summary()
        # what the running batch's multimodal_inputs list alone kept: dropped, with the probe gone
        memory = LEFT["memory"]
        LEFT["scheduler"].running_batch.multimodal_inputs = None
        gc.collect()
        memory["after_dropping_running_batch_inputs"] = torch.cuda.memory_allocated()
        memory["freed_by_dropping"] = memory["idle"] - memory["after_dropping_running_batch_inputs"]
        memory["idle_minus_before_images"] = memory["idle"] - memory["before_images"]
        memory["alive_after_dropping"] = sum(1 for refs in LEFT["watched"].values() for ref in refs if ref() is not None)
        result["memory"] = memory
        result["card"] = torch.cuda.get_device_name(0)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
