"""The demo's real-SGLang workload with a fault planted, under `kvdoctor run`, then an end:
`abort` (SIGABRT, as a CUDA device-side assert ends a scheduler: no exit hook runs, nothing
buffered is written) or `exit` (a clean exit). Prints the planted counts first.

argv: MODE (abort | exit), PAGE_SIZE, FAULT (a kvdoctor.demo.workload fault).
"""

import json
import os
import sys
import warnings

warnings.filterwarnings("ignore")


def main() -> None:
    mode, page_size, fault = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    from kvdoctor.demo.workload import WorkloadConfig, run_workload

    result = run_workload(WorkloadConfig(page_size=page_size, fault=fault, conversations=4, turns=3))
    print(json.dumps({"planted": result.planted, "pid": os.getpid()}), flush=True)
    if mode == "abort":
        os.abort()


if __name__ == "__main__":
    main()
