#!/bin/bash
# The second GPU pass: the ledger's Triton kernels (equivalence with the torch path, cost per call),
# the CUDA-graph decode loop with them (a tiny step and a larger one), and a HiCache run checking
# that loaded-back pages are tree-held (no false orphans).
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
[ -d /tmp/site/sglang ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD:$PWD/.carry PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
W=/tmp/gpuwork; mkdir -p $W; LOG=$OUT/log2.txt
echo "== kernels" | tee -a $LOG
timeout 180 python3 bench/gpu/kernels_check.py > $W/kernels.log 2>&1; echo "rc=$?" >> $LOG
grep RESULT $W/kernels.log >> $LOG || tail -20 $W/kernels.log >> $LOG
timeout 200 python3 bench/gpu/hicache_19332.py --seconds ${HSEC:-40} --trace $W/hc.trace.json --out $W/hc.json > $W/hc.log 2>&1 &
HC=$!
for size in "2048 4" "8192 16"; do
  set -- $size
  for i in 1 2; do
    for m in off on; do
      flag=""; [ $m = on ] && flag="--probe --trace $W/g_${1}_$i.trace.json"
      timeout 120 python3 bench/gpu/graph_decode.py --hidden $1 --layers $2 --steps 1500 $flag --out $W/g_${1}_${m}_$i.json > $W/g_${1}_${m}_$i.log 2>&1
      echo "graph hidden=$1 $m $i rc=$?" >> $LOG; grep RESULT $W/g_${1}_${m}_$i.log >> $LOG || tail -8 $W/g_${1}_${m}_$i.log >> $LOG
    done
  done
done
wait $HC
echo "== hicache rc done" >> $LOG
grep -E "RESULT|Traceback|Error" $W/hc.log | cut -c1-1200 >> $LOG
python3 -m kvdoctor.cli replay $W/hc.trace.json --format json > $W/hc.replay.json 2>>$LOG
python3 - >> $LOG <<'PY'
import json
r = json.load(open("/tmp/gpuwork/hc.replay.json"))
print("hicache findings:", [(f["kind"], f["count"]) for f in r["findings"]])
PY
cp $W/hc.replay.json $OUT/ 2>/dev/null
tar czf $OUT/check2.tar.gz -C $W $(cd $W && ls g_*.json kernels.log hc.json hc.log 2>/dev/null)
ls -la $OUT
