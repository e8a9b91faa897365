#!/bin/bash
# Issue #31 on the device machine: SGLang 0.5.9's CudaGraphRunner.replay during a HiCache load
# (bench/gpu/graph_runner_59.py; README.md says how to make what travels).
# Needs: .whl (SGLang 0.5.9 and the wheels it lacks there, as for run_all.sh), .carry/sgl_kernel (the
# import-only stand-in); carry: [".whl", ".carry"]. Writes 3 files into $OUT.
set -u
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
[ -d /tmp/site/sglang ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD:$PWD/.carry PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
W=/tmp/graph59; mkdir -p $W
LOG=$OUT/graph_runner_59.log
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $LOG
python3 -c "import torch,sys,sglang;print('torch',torch.__version__,'python',sys.version.split()[0],'sglang',sglang.__version__)" 2>&1 | tee -a $LOG
timeout 400 python3 bench/gpu/graph_runner_59.py --traces $W --out $OUT/graph_runner_59.json >> $LOG 2>&1
rc=$?
echo "graph_runner_59 rc=$rc" | tee -a $LOG
tar czf $OUT/graph_runner_59_traces.tar.gz -C $W . 2>>$LOG
exit $rc
