#!/bin/bash
# Issue #31 on the device machine: SGLang 0.5.23's DecodeCudaGraphRunner.execute during a HiCache load
# (bench/gpu/graph_runner_23.py; README.md says how to make what travels).
# Needs, all in .carry/ (carry: [".carry"]): sglang-0.5.23.tar.xz (SGLang 0.5.23's package), whl23/ (the
# wheels the machine lacks for it), sgl_kernel/ (the import-only stand-in). Writes 3 files into $OUT.
set -u
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
SITE=/tmp/site23
if [ ! -d $SITE/sglang ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE .carry/whl23/*.whl || exit 3
  tar xJf .carry/sglang-0.5.23.tar.xz -C $SITE || exit 3
fi
export PYTHONPATH=$SITE:$PWD:$PWD/.carry PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
W=/tmp/graph23; mkdir -p $W
LOG=$OUT/graph_runner_23.log
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $LOG
python3 -c "import torch,sys,sglang;print('torch',torch.__version__,'python',sys.version.split()[0],'sglang',sglang.__version__)" 2>&1 | tee -a $LOG
timeout 500 python3 bench/gpu/graph_runner_23.py --traces $W --out $OUT/graph_runner_23.json >> $LOG 2>&1
rc=$?
echo "graph_runner_23 rc=$rc" | tee -a $LOG
tar czf $OUT/graph_runner_23_traces.tar.gz -C $W . 2>>$LOG
exit $rc
