#!/bin/bash
# Runs every GPU check in one command on the device machine (see bench/gpu/README.md).
# Needs: .whl (SGLang 0.5.9 and the wheels it lacks there), .carry/sgl_kernel (the import-only stand-in).
# Writes at most 8 files into $OUT.
set -u
PART=${1:-all}   # A: HiCache + last_loc, B: CUDA-graph timing, all: both
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
T0=$(date +%s)
[ -d /tmp/site/sglang ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD:$PWD/.carry PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
W=/tmp/gpuwork; mkdir -p $W
LOG=$OUT/log.txt
say() { echo "== $(( $(date +%s) - T0 ))s $*" | tee -a $LOG; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a $LOG
python3 -c "import torch,sys;print('torch',torch.__version__,'python',sys.version.split()[0])" | tee -a $LOG
HSEC=${HSEC:-75}

if [ $PART != B ]; then
# 1. sglang#19332: the two HiCache runs side by side (separate processes; RSS is per process)
say "hicache no fix + clone-host-indices (${HSEC}s each, concurrent)"
timeout 240 python3 bench/gpu/hicache_19332.py --seconds $HSEC --trace $W/hicache_nofix.trace.json --out $W/hicache_nofix.json > $W/hicache_nofix.log 2>&1 &
P1=$!
timeout 240 python3 bench/gpu/hicache_19332.py --seconds $HSEC --fix clone-host-indices --trace $W/hicache_fix.trace.json --out $W/hicache_fix.json > $W/hicache_fix.log 2>&1 &
P2=$!

# 2. last_loc (meanwhile): warm the JIT kernel cache, then each case under compute-sanitizer memcheck
say "last_loc"
export PYTORCH_NO_CUDA_MEMORY_CACHING=1   # each tensor its own cudaMalloc, so memcheck sees the buffer's end
timeout 150 python3 bench/gpu/last_loc.py --case oor --fix clamp-last-loc --trace $W/warm.trace.json > $W/ll_warm.log 2>&1
echo "warm rc=$?" >> $LOG; grep -E "RESULT|Error|error" $W/ll_warm.log | tail -5 >> $LOG
for c in "oor nofix" "oor clamp-last-loc" "oor harness" "stale nofix" "stale recompute-last-loc"; do
  set -- $c; case_=$1; mode=$2
  extra=""; [ "$mode" = harness ] && extra="--harness-clamp"
  [ "$mode" != nofix ] && [ "$mode" != harness ] && extra="--fix $mode"
  name=ll_${case_}_${mode}
  say "$name"
  timeout 100 compute-sanitizer --tool memcheck --print-limit 20 python3 bench/gpu/last_loc.py --case $case_ $extra --trace $W/$name.trace.json --out $W/$name.json > $W/$name.log 2>&1
  echo "$name rc=$?" | tee -a $LOG
  grep -E "ERROR SUMMARY|Invalid __global__|RESULT|out of bounds|device-side assert|Address 0x" $W/$name.log | head -8 >> $LOG
done
unset PYTORCH_NO_CUDA_MEMORY_CACHING
wait $P1 $P2
say "hicache done"
grep -E "built|RESULT|Traceback|Error" $W/hicache_nofix.log | cut -c1-1500 >> $LOG
grep -E "built|RESULT|Traceback|Error" $W/hicache_fix.log | cut -c1-1500 >> $LOG
tail -5 $W/hicache_nofix.log >> $LOG

fi
if [ $PART != A ]; then
# 3. CUDA-graph decode loop, alone on the machine: fresh processes alternating without/with the probe
say "graph decode"
for i in 1 2 3; do
  for m in off on; do
    flag=""; [ $m = on ] && flag="--probe --trace $W/graph_$i.trace.json"
    timeout 100 python3 bench/gpu/graph_decode.py $flag --out $W/graph_${m}_$i.json > $W/graph_${m}_$i.log 2>&1
    echo "graph $m $i rc=$?" >> $LOG; grep RESULT $W/graph_${m}_$i.log >> $LOG || tail -5 $W/graph_${m}_$i.log >> $LOG
  done
done
fi
say "pack"
python3 - <<'PY' >> $LOG 2>&1
import glob, json, os
W="/tmp/gpuwork"; OUT=os.environ["OUT"]
ll = {os.path.basename(p)[:-5]: json.load(open(p)) for p in sorted(glob.glob(W+"/ll_*.json")) if not p.endswith(".trace.json")}
json.dump(ll, open(OUT+"/last_loc.json","w"), indent=1)
g = {os.path.basename(p)[:-5]: json.load(open(p)) for p in sorted(glob.glob(W+"/graph_*_*.json")) if not p.endswith(".trace.json")}
json.dump(g, open(OUT+"/graph.json","w"), indent=1)
print("packed", list(ll), list(g))
PY
for n in hicache_nofix hicache_fix; do [ -f $W/$n.json ] && cp $W/$n.json $OUT/; done
# traces: the two HiCache traces (cut to 5 MB) and the small ones in one archive
for n in hicache_nofix hicache_fix; do [ -f $W/$n.trace.json ] && head -c 5000000 $W/$n.trace.json > $W/$n.cut.trace.json; done
tar czf $OUT/traces_and_logs_$PART.tar.gz -C $W $(cd $W && ls *.trace.json *.log 2>/dev/null | grep -v -E "^hicache_(nofix|fix)\.trace\.json$") 2>>$LOG
ls -la $OUT | tee -a $LOG
say "end"
