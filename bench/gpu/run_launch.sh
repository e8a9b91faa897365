#!/bin/bash
# Issue #29 on the device machine: the GPU ledger's host time per hooked call, its kernels launched
# through Triton's Python launcher (mode triton), compiled through Triton's launcher (compiled),
# through the CUDA driver from the Python path (driver), and from the native fast path itself (c, the
# default) (kvdoctor/probe/ledgers/launch.py, csrc/launch.c).
# 1. tests/gpu/harness/kernels_check.py: the launch paths against the torch ledger, op for op, and host µs per call;
#    tests/gpu/harness/device_path_check.py: the native fast path against the Python path through SGLang's real allocator.
# 2. graph_decode.py at four step sizes, fresh processes alternating off and the modes, 2 rounds;
#    then launch_summary.py writes the table.
# Needs: .whl (SGLang 0.5.9 and the wheels it lacks there, tests/gpu/README.md), .carry/sgl_kernel;
# carry [".whl", ".carry"]. Builds the compiled host path here first. Writes 4 files into $OUT.
# SIZES="16x8192 8x4096" (layers x hidden) runs fewer step sizes, MODES="off driver c" fewer
# launch paths (noop: one tiny kernel a step, no probe; a suffix -wN, as in "c-w1", runs that path's
# kernels on N warps a program, KVDOCTOR_LEDGER_WARPS), ROUNDS=3 more rounds; SKIP_CHECK=1 skips
# step 1, SKIP_KERNELS_CHECK=1 its first half; STEP_FLAGS="--write-rows" gives every step SGLang's
# batched req_to_token write after its alloc (two hooked calls a step); CALL_COST="5 2000" runs hooked_call_cost.py after. All four sizes, four modes and two
# rounds take more than 10 minutes on an H200: split them.
set -u
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
SITE_059=${SITE_059:-/tmp/site}   # where SGLang 0.5.9's carried wheels are installed (tests/gpu/run.sh uses the same)
[ -d $SITE_059/sglang ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE_059 .whl/*.whl || exit 3
python3 setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1 || { echo "build failed"; tail -20 "$OUT/build.log"; }
export PYTHONPATH=$SITE_059:$PWD:$PWD/.carry PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
LOG=$OUT/launch.log
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $LOG
python3 -c "import torch,sys,triton;print('torch',torch.__version__,'python',sys.version.split()[0],'triton',triton.__version__)" 2>&1 | tee -a $LOG
ls kvdoctor/probe/native/_native*.so 2>&1 | tee -a $LOG
if [ -z "${SKIP_CHECK:-}" ] && [ -z "${SKIP_KERNELS_CHECK:-}" ]; then
  KVDOCTOR_LEDGER_LAUNCH=direct timeout 240 python3 tests/gpu/harness/kernels_check.py > /tmp/kc.log 2>&1
  echo "kernels_check rc=$?" | tee -a $LOG
  grep RESULT /tmp/kc.log | sed 's/^RESULT //' > "$OUT/kernels_check.json" || tail -20 /tmp/kc.log | tee -a $LOG
  cat "$OUT/kernels_check.json" | tee -a $LOG
fi
if [ -z "${SKIP_CHECK:-}" ]; then
  timeout 240 python3 tests/gpu/harness/device_path_check.py > /tmp/dp.log 2>&1
  echo "device_path_check rc=$?" | tee -a $LOG
  grep RESULT /tmp/dp.log | sed 's/^RESULT //' > "$OUT/device_path_check.json" || tail -20 /tmp/dp.log | tee -a $LOG
  cat "$OUT/device_path_check.json" | tee -a $LOG
fi
: >> "$OUT/graph_launch.jsonl"
for round in $(seq 1 ${ROUNDS:-2}); do
  for size in ${SIZES:-16x8192 8x4096 4x2048 2x1024}; do
    size=${size/x/ }
    set -- $size
    for mode in ${MODES:-off triton compiled direct}; do
      launch=${mode%-w*}; warps=${KVDOCTOR_LEDGER_WARPS:-4}; [ "$launch" != "$mode" ] && warps=${mode##*-w}
      flag="--probe"; [ $mode = off ] && flag=""; [ $mode = noop ] && flag="--noop-kernel"
      KVDOCTOR_LEDGER_WARPS=$warps KVDOCTOR_LEDGER_LAUNCH=$launch timeout 60 python3 bench/gpu/graph_decode.py $flag ${STEP_FLAGS:-} --steps 1000 --layers $1 --hidden $2 > /tmp/gd.log 2>&1
      rc=$?
      line=$(grep RESULT /tmp/gd.log | sed 's/^RESULT //')
      if [ -n "$line" ]; then echo "{\"round\": $round, \"mode\": \"$mode\", \"rc\": $rc, \"result\": $line}" >> "$OUT/graph_launch.jsonl"
      else echo "graph $mode $size rc=$rc" | tee -a $LOG; tail -5 /tmp/gd.log | tee -a $LOG; fi
    done
  done
done
python3 bench/gpu/launch_summary.py "$OUT/graph_launch.jsonl" | tee -a $LOG
if [ -n "${CALL_COST:-}" ]; then  # hooked_call_cost.py: host µs of one hooked call, off / driver / c
  timeout 300 python3 bench/gpu/hooked_call_cost.py $CALL_COST > /tmp/hc.log 2>&1
  echo "hooked_call_cost rc=$?" | tee -a $LOG
  grep RESULT /tmp/hc.log | sed 's/^RESULT //' > "$OUT/hooked_call_cost.json" || tail -20 /tmp/hc.log | tee -a $LOG
  cat "$OUT/hooked_call_cost.json" | tee -a $LOG
fi
