"""The detector registry: one detector per module, each reading only the events it names in
`consumes`. Every analysis, live (`watch`) or recorded (`replay`, `run`, `gate`, `demo`), runs
the detectors `all_detectors()` returns, so the two can never disagree."""

from __future__ import annotations

from kvdoctor.analysis.detectors.base import Detector
from kvdoctor.analysis.detectors.connector_held import ConnectorHeldDetector
from kvdoctor.analysis.detectors.container_growth import ContainerGrowthDetector
from kvdoctor.analysis.detectors.double_alloc import DoubleAllocDetector
from kvdoctor.analysis.detectors.double_free import DoubleFreeDetector
from kvdoctor.analysis.detectors.graph_replay import GraphReplayDuringLoadDetector
from kvdoctor.analysis.detectors.host_growth_attribution import HostGrowthAttributionDetector
from kvdoctor.analysis.detectors.index_out_of_range import IndexOutOfRangeDetector
from kvdoctor.analysis.detectors.l3_store import L3StoreDetector
from kvdoctor.analysis.detectors.lora_ghost_uid import LoraGhostUidDetector
from kvdoctor.analysis.detectors.mamba_orphan_slots import MambaOrphanSlotsDetector
from kvdoctor.analysis.detectors.memory_classes import MemoryClassGrowthDetector
from kvdoctor.analysis.detectors.memory_growth import MemoryGrowthDetector
from kvdoctor.analysis.detectors.metadata_rows import (
    MetadataDoubleFreeDetector,
    MetadataIndexOutOfRangeDetector,
    MetadataRowsLeakedDetector,
)
from kvdoctor.analysis.detectors.mm_features_held import MmFeaturesHeldDetector
from kvdoctor.analysis.detectors.orphan_slots import OrphanSlotsDetector
from kvdoctor.analysis.detectors.pd_transfer_freed import PdTransferFreedDetector
from kvdoctor.analysis.detectors.pd_transfer_stuck import PdTransferStuckDetector
from kvdoctor.analysis.detectors.probe_health import ProbeHealthDetector
from kvdoctor.analysis.detectors.refcount_disagrees import RefcountDisagreesDetector
from kvdoctor.analysis.detectors.request_rows import RequestRowsLeakedDetector
from kvdoctor.analysis.detectors.retained_view import RetainedViewDetector
from kvdoctor.analysis.detectors.stale_last_loc import StaleLastLocDetector
from kvdoctor.analysis.detectors.swa_freed_live import SwaFreedLiveDetector
from kvdoctor.analysis.detectors.tree_misuse import LockUnderflowDetector, UseAfterFreeDetector
from kvdoctor.analysis.growth import GrowthParams


def all_detectors(*, growth_params: GrowthParams | None = None, host_memory_limit_bytes: int | None = None) -> list[Detector]:
    """A fresh instance of every detector, in reporting order.

    `growth_params` tunes the memory growth test; `host_memory_limit_bytes` is the limit the time
    to OOM is measured against when the trace records none (only the caller knows the machine).
    """
    return [
        DoubleFreeDetector(),
        DoubleAllocDetector(),
        StaleLastLocDetector(),
        IndexOutOfRangeDetector(),
        UseAfterFreeDetector(),
        LockUnderflowDetector(),
        GraphReplayDuringLoadDetector(),
        RefcountDisagreesDetector(),
        LoraGhostUidDetector(),
        MambaOrphanSlotsDetector(),
        SwaFreedLiveDetector(),
        PdTransferFreedDetector(),
        PdTransferStuckDetector(),
        MetadataDoubleFreeDetector(),
        MetadataIndexOutOfRangeDetector(),
        MetadataRowsLeakedDetector(),
        RequestRowsLeakedDetector(),
        OrphanSlotsDetector(),
        ConnectorHeldDetector(),
        MmFeaturesHeldDetector(),
        ContainerGrowthDetector(),
        ProbeHealthDetector(),
        MemoryGrowthDetector(growth_params, host_memory_limit_bytes=host_memory_limit_bytes),
        MemoryClassGrowthDetector(growth_params),
        RetainedViewDetector(),
        L3StoreDetector(),
        HostGrowthAttributionDetector(),
    ]
