#!/bin/bash
# Issue #31's EAGLE item on the device machine: SGLang 0.5.23's EAGLE v2 decode step on CUDA
# (bench/gpu/eagle_last_loc.py), each case plain and under compute-sanitizer memcheck.
# Needs, all in .carry/ (carry: [".carry"]), as for run_graph_runner_23.sh: sglang-0.5.23.tar.xz,
# whl23/, sgl_kernel/ (README.md says how to make them). Writes into $OUT: one JSON per run
# (eagle_<case>_<mode>_<plain|memcheck>.json), eagle_last_loc_summary.json, eagle_last_loc.log and a
# tarball of the traces and the runs' logs. Exit 0 only when every run shows what it must.
# `bash bench/gpu/run_eagle_last_loc.sh [all|plain|memcheck]` (default all; about 1 min plain and a few
# under memcheck on an H100 is the estimate, not a measurement: split it if it nears a 10-minute limit).
set -u
TOOLS=${1:-all}; [ "$TOOLS" = all ] && TOOLS="plain memcheck"
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
SITE=${SITE:-/tmp/site23}
ARGS=${EAGLE_ARGS:-}   # e.g. --cpu: a dry run of this script's plumbing on a machine without a GPU
if [ ! -d $SITE/sglang ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE .carry/whl23/*.whl || exit 3
  tar xJf .carry/sglang-0.5.23.tar.xz -C $SITE || exit 3
fi
export PYTHONPATH=$SITE:$PWD:$PWD/.carry PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
W=/tmp/eagle31; mkdir -p $W
LOG=$OUT/eagle_last_loc.log
T0=$(date +%s)
say() { echo "== $(( $(date +%s) - T0 ))s $*" | tee -a $LOG; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $LOG
python3 -c "import torch,sys,sglang;print('torch',torch.__version__,'python',sys.version.split()[0],'sglang',sglang.__version__)" 2>&1 | tee -a $LOG
compute-sanitizer --version 2>&1 | tail -1 | tee -a $LOG

# Warm-up (not judged): Triton and the JIT store_cache compile on first use, which memcheck would slow.
say "warm-up"
timeout 300 python3 bench/gpu/eagle_last_loc.py $ARGS --case clean --traces $W/warm --out $W/warm.json > $W/warm.log 2>&1
echo "warm-up rc=$?" | tee -a $LOG; grep -E "^RESULT|Error" $W/warm.log | cut -c1-600 | tail -3 >> $LOG

FAIL=0
# case, fix ("-" for none); each plain, then under memcheck
for run in "clean -" "reused-row -" "oor -" "oor clamp-last-loc"; do
  set -- $run; case_=$1; fix=$2
  extra=""; [ "$fix" != - ] && extra="--fix $fix"
  mode=$([ "$fix" = - ] && echo nofix || echo $fix)
  for tool in $TOOLS; do
    name=eagle_${case_}_${mode}_${tool}
    say "$name"
    rm -rf $W/$name $W/$name.json
    if [ $tool = memcheck ]; then
      # each tensor its own cudaMalloc, so memcheck sees the KV buffer's end
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 300 compute-sanitizer --tool memcheck --print-limit 20 \
        python3 bench/gpu/eagle_last_loc.py $ARGS --case $case_ $extra --traces $W/$name --out $W/$name.json > $W/$name.log 2>&1
    else
      timeout 180 python3 bench/gpu/eagle_last_loc.py $ARGS --case $case_ $extra --traces $W/$name --out $W/$name.json > $W/$name.log 2>&1
    fi
    rc=$?
    errors=$(grep -oE "ERROR SUMMARY: [0-9]+ error" $W/$name.log | grep -oE "[0-9]+" | tail -1)
    echo "$name rc=$rc memcheck_errors=${errors:--}" | tee -a $LOG
    grep -E "^step 0|kv write failed|ERROR SUMMARY|Invalid __global__|Traceback|Error:" $W/$name.log | cut -c1-400 | head -8 >> $LOG
    # what each run must show: the script's verdict (its JSON), and memcheck's count
    python3 - "$W/$name.json" "$case_" "$fix" "$tool" "$rc" "${errors:-}" >> $LOG 2>&1 <<'PY'
import json, sys
path, case, fix, tool, rc, errors = sys.argv[1:]
try:
    out = json.load(open(path))
except (OSError, ValueError) as exc:
    print(f"UNEXPECTED {path}: no JSON ({exc})"); sys.exit(1)
res = out["cases"][case]
verdict = dict(res.get("verdict") or {})
if out.get("partial"):  # the process died after step 0's check: judge what it named before the write
    kinds = {f["kind"] for f in res["findings"]}
    verdict = {"named_before_the_write": ("index_out_of_range" if case == "oor" else "stale_last_loc") in kinds}
if tool == "memcheck":
    n = int(errors) if errors else -1
    # oor without a fix: the verify's write past the KV buffer is an illegal access; every other run is clean
    verdict["memcheck"] = n > 0 if (case == "oor" and fix == "-") else n == 0
if not (case == "oor" and fix == "-"):
    verdict["rc0"] = rc == "0"
bad = [k for k, v in verdict.items() if not v]
print(("UNEXPECTED " if bad else "as expected ") + json.dumps(verdict) + (f" failed: {bad}" if bad else ""))
sys.exit(1 if bad else 0)
PY
    [ $? -eq 0 ] || FAIL=1
    cp $W/$name.json $OUT/ 2>/dev/null
  done
done

say "pack"
python3 - "$OUT" <<'PY' >> $LOG 2>&1
import glob, json, os, sys
out = sys.argv[1]
summary = {}
for path in sorted(glob.glob(os.path.join(out, "eagle_*.json"))):
    name = os.path.basename(path)[:-5]
    d = json.load(open(path))
    for case, r in d["cases"].items():
        summary[name] = {
            "partial": bool(d.get("partial")),
            "verdict": r.get("verdict"),
            "findings": {f["kind"]: f["count"] for f in r.get("findings", [])},
            "first_violation": (r.get("violations") or [None])[0],
            "step0": (r.get("steps") or [None])[0],
            "kv_write_error": r.get("kv_write_error"),
            "device": r.get("device"),
            "alloc_extend_impl": r.get("alloc_extend_impl"),
            "set_kv_buffer_impl": r.get("set_kv_buffer_impl"),
        }
json.dump(summary, open(os.path.join(out, "eagle_last_loc_summary.json"), "w"), indent=1, default=str)
print("summary of", len(summary), "runs")
PY
tar czf $OUT/eagle_last_loc_traces_and_logs.tar.gz -C $W . 2>>$LOG
echo "eagle_last_loc FAIL=$FAIL" | tee -a $LOG
say "end"
exit $FAIL
