#!/bin/bash
# Third GPU pass: HiCache with HiRadixCache's own insert/reset in the map (no false orphans).
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
[ -d /tmp/site/sglang ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site:$PWD:$PWD/.carry PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
W=/tmp/gpuwork3; mkdir -p $W; LOG=$OUT/log3.txt
for fix in none clone-host-indices; do
  flag=""; [ $fix != none ] && flag="--fix $fix"
  timeout 200 python3 bench/gpu/hicache_19332.py --seconds ${HSEC:-40} $flag --trace $W/hc_$fix.trace.json --out $W/hc_$fix.json > $W/hc_$fix.log 2>&1 &
done
wait
for fix in none clone-host-indices; do
  grep -E "RESULT|Traceback|Error" $W/hc_$fix.log | cut -c1-900 >> $LOG
  python3 -m kvdoctor.cli replay $W/hc_$fix.trace.json --format json > $OUT/hc3_$fix.replay.json 2>>$LOG
  python3 -m kvdoctor.cli replay $W/hc_$fix.trace.json --format html -o $OUT/hc3_$fix.replay.html 2>>$LOG
  python3 -c "import json; r=json.load(open('$OUT/hc3_$fix.replay.json')); print('$fix findings:', [(f['kind'], f['count']) for f in r['findings']])" >> $LOG
done
cp $W/hc_none.json $OUT/hc3_none.json; cp $W/hc_clone-host-indices.json $OUT/hc3_fix.json
cat $LOG
