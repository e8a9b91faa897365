"""Loads and unloads LoRA adapters through SGLang's own `LoRAManager` and `LoRAMemoryPool`, under the
probe, and prints what SGLang's pool held (`RESULT {json}`).

    python tests/support/lora_pool_cases.py TRACE [TRACE_NOT_UNDERSTOOD]

Run in a fresh interpreter with the release under test first on PYTHONPATH. Everything but the base
model's container is SGLang's: the parallel state (gloo, one rank), the server arguments (read from
a tiny Llama config written here), the LoRA backend, the LoRA layer wrapping the model's `o_proj`,
the pool and its eviction policy, and adapters loaded from PEFT files written here (rank 4,
random weights; nothing is downloaded). The base model is two layers of SGLang's `ReplicatedLinear`
as `o_proj`: every other LoRA layer of 0.5.12 on (`QKVParallelLinearWithLoRA`, `RowParallelLinearWithLoRA`,
...) pins a host tensor as it is built, which needs a CUDA driver; `ReplicatedLinearWithLoRA` does not.

The path driven is the server's: `load_lora_adapter` (what `ModelRunner.load_lora_adapter` calls),
a batch that uses the adapter (`fetch_new_loras`, as `ForwardBatch.init_new` calls it: the adapter
takes a pool slot), then `unload_lora_adapter` (what `ModelRunner.unload_lora_adapter` calls). The
pool has three slots (the base model's and two): two adapters are each loaded, used and unloaded,
then a third is loaded and used, which evicts the older of whatever the first two left in the pool.

With a second trace, the probe is then activated again on the same manager, whose pool's slot list
is made a tuple (a layout the LoRA ledger does not read), and one more adapter is loaded.
"""

import json
import os
import socket
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore")

HIDDEN, LAYERS, RANK = 64, 2, 4


def write_adapter(folder: str, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    config = {"peft_type": "LORA", "r": RANK, "lora_alpha": 8, "target_modules": ["o_proj"], "task_type": "CAUSAL_LM"}
    with open(os.path.join(folder, "adapter_config.json"), "w") as fh:
        json.dump({**config, "base_model_name_or_path": "tiny"}, fh)
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(LAYERS):
        prefix = f"base_model.model.model.layers.{layer}.self_attn.o_proj"
        weights[prefix + ".lora_A.weight"] = torch.randn(RANK, HIDDEN, generator=generator)
        weights[prefix + ".lora_B.weight"] = torch.randn(HIDDEN, RANK, generator=generator)
    save_file(weights, os.path.join(folder, "adapter_model.safetensors"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    trace = sys.argv[1]
    from kvdoctor.probe.core import runtime

    probe = runtime.activate(trace)
    import sglang
    import torch
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.layers.linear import ReplicatedLinear
    from sglang.srt.lora.lora_manager import LoRAManager
    from sglang.srt.lora.lora_registry import LoRARef
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    from transformers import LlamaConfig

    init_distributed_environment(
        backend="gloo", world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{free_port()}"
    )
    initialize_model_parallel(1, 1)
    config = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=LAYERS,
        vocab_size=128,
        architectures=["LlamaForCausalLM"],
    )

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.o_proj = ReplicatedLinear(HIDDEN, HIDDEN, bias=False)

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self_attn = Attention()

    class Inner(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer() for _ in range(LAYERS)])

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = Inner()
            self.config = config

    tmp = tempfile.mkdtemp()
    config.save_pretrained(os.path.join(tmp, "base"))
    slots = 3
    server_args = ServerArgs(
        model_path=os.path.join(tmp, "base"),
        device="cpu",
        enable_lora=True,
        max_lora_rank=RANK,
        lora_target_modules=["o_proj"],
        max_loras_per_batch=slots,
        lora_backend="triton",
    )
    set_global_server_args_for_scheduler(server_args)
    manager = LoRAManager(
        base_model=Model(),
        base_hf_config=config,
        max_loras_per_batch=slots,
        load_config=LoadConfig(),
        dtype=torch.float32,
        server_args=server_args,
        lora_backend="triton",
        max_lora_rank=RANK,
        target_modules=["o_proj"],
    )
    pool = manager.memory_pool
    steps, refs = [], {}

    def load_and_use(name: str, seed: int) -> None:
        write_adapter(os.path.join(tmp, name), seed)
        refs[name] = ref = LoRARef(lora_name=name, lora_path=os.path.join(tmp, name), pinned=False)
        assert manager.load_lora_adapter(ref).success
        manager.fetch_new_loras({ref.lora_id})
        steps.append({"step": f"load and use {name}", "slots": [str(u) for u in pool.buffer_id_to_uid]})

    def unload(name: str) -> None:
        assert manager.unload_lora_adapter(refs[name]).success
        steps.append({"step": f"unload {name}", "slots": [str(u) for u in pool.buffer_id_to_uid]})

    load_and_use("adapter-a", 1)
    unload("adapter-a")
    load_and_use("adapter-b", 2)
    unload("adapter-b")
    load_and_use("adapter-c", 3)
    uids = {name: ref.lora_id for name, ref in refs.items()}
    ghosts_at_end = {slot: uid for slot, uid in enumerate(pool.buffer_id_to_uid) if isinstance(uid, str) and uid not in manager.loras}
    map_source = getattr(probe.maps.get("sglang"), "source", None)
    runtime.deactivate()

    not_understood = {}
    if len(sys.argv) > 2:  # the same manager, its pool's slot list a tuple: the LoRA ledger turns off, SGLang goes on
        probe = runtime.activate(sys.argv[2])
        pool.buffer_id_to_uid = tuple(pool.buffer_id_to_uid)
        write_adapter(os.path.join(tmp, "adapter-d"), 4)
        ref = LoRARef(lora_name="adapter-d", lora_path=os.path.join(tmp, "adapter-d"), pinned=False)
        loaded = manager.load_lora_adapter(ref).success
        not_understood = {"loaded": loaded, "ledgers_off": sorted(probe.ledgers_off), "probe_on": probe.ledger_on}
        runtime.deactivate()

    print(
        "RESULT "
        + json.dumps(
            {
                "version": sglang.__version__,
                "map": map_source,
                "steps": steps,
                "uids": uids,
                "ghosts_at_end": ghosts_at_end,
                "remove_lora": hasattr(pool, "remove_lora"),
                "not_understood": not_understood,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
