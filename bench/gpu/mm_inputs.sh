#!/bin/bash
# Issue #25's multimodal row on a GPU: tests/support/mm_inputs_cases.py with the batch on cuda
# (KVDOCTOR_MM_DEVICE=cuda), SGLang 0.5.7 (keeps a finished request's pixel values) and 0.5.8 (clears
# them at finish), each in its own process with its own SGLang; then mm_inputs_summary.py judges both.
# Needs: .whl (the packages the machine lacks, as for run_all.sh, and those the scheduler's imports
# need: soundfile cffi pycparser distro fastapi opentelemetry-api python-multipart setproctitle),
# .carry/mm/sglang-0.5.7-*.whl and sglang-0.5.8-*.whl (pure Python, `pip download --no-deps`);
# the import-only sgl_kernel stand-in comes from tests/support. Carry [".whl", ".carry"].
# Writes into $OUT: mm_inputs_<release>.json (verdict, memory, syncs, counts, findings),
# mm_inputs_<release>.trace.json, mm_inputs.log.
set -u
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
RELEASES=${RELEASES:-"0.5.7:held 0.5.8:clears"}
LOG=$OUT/mm_inputs.log
[ -d /tmp/site/pydantic ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
python3 setup.py -q build_ext --inplace > /tmp/mm_build.log 2>&1 || { echo "compiled hot path not built (pure Python)"; tail -3 /tmp/mm_build.log; } | tee -a $LOG
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a $LOG
python3 -c "import torch,sys,triton;print('torch',torch.__version__,'python',sys.version.split()[0],'triton',triton.__version__)" 2>&1 | tee -a $LOG
ls kvdoctor/probe/_hotpath*.so 2>&1 | tee -a $LOG
export PYTHONUNBUFFERED=1 KVDOCTOR_MM_DEVICE=cuda KVDOCTOR_MM_HELD_AGE_S=3600
for pair in $RELEASES; do
  v=${pair%%:*}
  [ -d /tmp/sg-$v/sglang ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/sg-$v .carry/mm/sglang-$v-*.whl || exit 3
  rm -f "$OUT/mm_inputs_$v.trace.json"
  start=$(date +%s.%N)
  PYTHONPATH=/tmp/sg-$v:/tmp/site:$PWD/tests/support:$PWD timeout 300 python3 tests/support/mm_inputs_cases.py "$OUT/mm_inputs_$v.trace.json" > "$OUT/mm_inputs_$v.result" 2> /tmp/mm_$v.err
  rc=$?
  echo "sglang $v rc=$rc $(python3 -c "print(round($(date +%s.%N)-$start,1))") s" | tee -a $LOG
  [ $rc = 0 ] || tail -40 /tmp/mm_$v.err | tee -a $LOG
done
PYTHONPATH=$PWD python3 bench/gpu/mm_inputs_summary.py "$OUT" $RELEASES 2>&1 | tee -a $LOG
rc=${PIPESTATUS[0]}
rm -f "$OUT"/mm_inputs_*.result
echo "summary rc=$rc" | tee -a $LOG
exit $rc
