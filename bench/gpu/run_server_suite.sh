#!/bin/bash
# Issue #47 on the device machine: a whole SGLang 0.5.23 server under `kvdoctor run`, in the cases of
# bench/gpu/server_suite.py. Needs .carry/server (bench/gpu/server_pack.sh makes it here; carry
# [".carry/server"]). CASES (comma-separated, the first one starts alone) picks the cases.
# $OUT receives summary.json, summary.md (both after every case: a run stopped at the device's limit
# keeps what it finished), suite.log, build.log and traces.tar.gz (each case's kvdoctor trace,
# replay, planted faults, bench results, server log and CPU by thread).
set -u
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
C=$PWD/.carry/server
export SITE=/tmp/site23
T0=$(date +%s)
if [ ! -d $SITE/sglang ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE $C/whl/*.whl > "$OUT/build.log" 2>&1 || { tail -20 "$OUT/build.log"; exit 3; }
  tar xJf $C/sglang-0.5.23.tar.xz -C $SITE || exit 3
fi
# kvdoctor as packed (the commit in src/COMMIT), its native path built for this python
[ -n "$(ls $C/src/kvdoctor/probe/native/_native*.so 2>/dev/null)" ] || (cd $C/src && python3 setup.py -q build_ext --inplace) >> "$OUT/build.log" 2>&1 || echo "native path build failed (pure-Python path)" | tee -a "$OUT/build.log"
export KVDOCTOR_SRC=$C/src SERVER_CARRY=$C PYTHONPATH=$SITE:$C/src PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
echo "install $(( $(date +%s) - T0 )) s; kvdoctor $(cat $C/src/COMMIT)" | tee -a "$OUT/build.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/build.log"
python3 -c "import torch,sys,sglang,triton;print('torch',torch.__version__,'python',sys.version.split()[0],'sglang',sglang.__version__,'triton',triton.__version__)" 2>&1 | tee -a "$OUT/build.log"
python3 -c "from kvdoctor.probe.maps.loader import available_maps as m; print(len(m('sglang')), 'SGLang maps')" 2>&1 | tee -a "$OUT/build.log"
W=/tmp/suite-$(date +%H%M%S)
SUITE_COPY_TO="$OUT" timeout ${SUITE_TIMEOUT:-540} python3 bench/gpu/server_suite.py --out $W --cases "${CASES:-clean-p1,clean-p16,clean-noradix,clean-chunked,fault-leak,fault-safety}" ${SUITE_ARGS:-}
rc=$?
echo "suite rc=$rc after $(( $(date +%s) - T0 )) s" | tee -a "$OUT/build.log"
cp $W/summary.json $W/summary.md $W/suite.log "$OUT/" 2>/dev/null
(cd $W && tar czf "$OUT/traces.tar.gz" --exclude='*.tmp' */*.kvtrace.json */replay.json */fault*.json */bench.jsonl */server.log */threads-*.json */memcheck-*.log 2>/dev/null)
ls -la "$OUT"
exit $rc
