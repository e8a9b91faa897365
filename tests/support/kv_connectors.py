"""KV connectors for vLLM 0.28+ that move no data and only exercise who frees a finished request's
blocks, through vLLM's public `KVConnectorBase_V1` API. Loaded by module path:

    KVTransferConfig(kv_connector="NeverFreeConnector", kv_connector_module_path="kv_connectors", kv_role="kv_both")

- `DelayedFreeConnector`: keeps every finished request's blocks (`request_finished` returns True)
  and reports the request in `finished_sending` a few engine steps later: a correct delayed free,
  as a producer that waits for its consumer to read the KV does;
- `NeverFreeConnector`: keeps them and never reports (lookup pins never released, a consumer that
  never reads: vllm#35931, LMCache#2017, vllm#41269);
- `LateFreeConnector`: keeps them and reports them sent only once `LateFreeConnector.release` is
  set (the engine core runs in the test's own process, so the test decides when: past the deadline);
- `NeverReceiveConnector`: announces the prompt's whole blocks as loadable asynchronously, so the
  scheduler allocates them and parks the request waiting for remote KV, and never reports the load
  done; an aborted request then keeps its blocks (vllm#46283).
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata


class _NoMetadata(KVConnectorMetadata):
    pass


class _NoTransferConnector(KVConnectorBase_V1):
    """Loads nothing, saves nothing. `steps_until_sent` (None: never) is how many worker steps
    after a request finished it is reported in `finished_sending`."""

    steps_until_sent: int | None = None
    keeps_finished_blocks = True

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.steps_left: dict[str, int] = {}  # worker side: request id -> steps until reported sent

    # scheduler side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        return None

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return _NoMetadata()

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if not self.keeps_finished_blocks or not block_ids:
            return False, None
        return True, None  # the blocks are ours until get_finished reports the request sent

    # worker side

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.steps_until_sent is None:
            return None, None
        for rid in finished_req_ids:
            self.steps_left.setdefault(rid, self.steps_until_sent)
        sent = set()
        for rid in list(self.steps_left):
            self.steps_left[rid] -= 1
            if self.steps_left[rid] <= 0:
                del self.steps_left[rid]
                sent.add(rid)
        return sent or None, None


class DelayedFreeConnector(_NoTransferConnector):
    steps_until_sent = 3


class NeverFreeConnector(_NoTransferConnector):
    steps_until_sent = None


class LateFreeConnector(_NoTransferConnector):
    release = False  # set by the test once the probe has called the holds overdue

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self.steps_left.update(dict.fromkeys(finished_req_ids, 0))
        if not LateFreeConnector.release or not self.steps_left:
            return None, None
        sent = set(self.steps_left)
        self.steps_left.clear()
        return sent, None


class NeverReceiveConnector(_NoTransferConnector):
    keeps_finished_blocks = False

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        block_size = self._vllm_config.cache_config.block_size
        whole_blocks = (request.num_prompt_tokens - num_computed_tokens - 1) // block_size * block_size
        return (whole_blocks, True) if whole_blocks > 0 else (0, False)
