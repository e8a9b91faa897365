#!/bin/bash
# The GPU tests in one command, on the GPU machine, from the repository root:
#   bash tests/gpu/run.sh [pytest arguments, e.g. -k eagle]
# Installs what travels (tests/gpu/README.md says how to make it; each only when carried and not yet
# installed) into the folders the tests look in, builds the native path in place, then runs
# `python3 -m pytest tests/gpu -m gpu`. A release not carried is not installed, and its tests skip
# saying so. With $OUT set, pytest's JUnit XML and this script's log go there.
#   .whl/*.whl                     SGLang 0.5.9 and the packages the machine lacks -> $SITE_059 (/tmp/site)
#   .carry/sglang-0.5.23.tar.xz    SGLang 0.5.23's installed package, with .carry/whl23/*.whl -> $SITE_0523 (/tmp/site23)
#   .carry/mm/sglang-0.5.{7,8}-*   the multimodal releases -> $SITE_057, $SITE_058 (/tmp/sg-0.5.7, /tmp/sg-0.5.8)
#   .whl/{pytest,pluggy,iniconfig,packaging}-*.whl   pytest, where the machine's Python has none -> /tmp/gpu-tests-pytest
set -u
cd "$(dirname "$0")/../.."
export SITE_059=${SITE_059:-/tmp/site} SITE_0523=${SITE_0523:-/tmp/site23}
export SITE_057=${SITE_057:-/tmp/sg-0.5.7} SITE_058=${SITE_058:-/tmp/sg-0.5.8}
LOG=${OUT:+$OUT/gpu-tests.log}; LOG=${LOG:-/dev/null}
[ -n "${OUT:-}" ] && mkdir -p "$OUT"
say() { echo "run.sh: $*" | tee -a "$LOG"; }
install() {  # install DIR WHEEL...: into DIR, offline, as they are
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$@" > /dev/null || say "pip install into $1 failed"
}
shopt -s nullglob
wheels=(.whl/*.whl)
if [ ${#wheels[@]} -gt 0 ] && [ ! -d "$SITE_059/sglang" ]; then say "installing .whl/ into $SITE_059"; install "$SITE_059" "${wheels[@]}"; fi
if [ -f .carry/sglang-0.5.23.tar.xz ] && [ ! -d "$SITE_0523/sglang" ]; then
  say "installing SGLang 0.5.23 into $SITE_0523"
  install "$SITE_0523" .carry/whl23/*.whl && tar xJf .carry/sglang-0.5.23.tar.xz -C "$SITE_0523"
fi
for v in 0.5.7 0.5.8; do
  var=SITE_${v//./}; dir=${!var}; mm=(.carry/mm/sglang-$v-*.whl)
  if [ ${#mm[@]} -gt 0 ] && [ ! -d "$dir/sglang" ]; then say "installing SGLang $v into $dir"; install "$dir" "${mm[@]}"; fi
done
if ! python3 -c "import pytest" 2> /dev/null; then
  say "pytest from .whl/ into /tmp/gpu-tests-pytest"
  install /tmp/gpu-tests-pytest .whl/pytest-*.whl .whl/pluggy-*.whl .whl/iniconfig-*.whl .whl/packaging-*.whl
  export PYTHONPATH=/tmp/gpu-tests-pytest${PYTHONPATH:+:$PYTHONPATH}
fi
python3 setup.py -q build_ext --inplace > /tmp/gpu-tests-build.log 2>&1 || say "the native path did not build: $(tail -1 /tmp/gpu-tests-build.log)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG"
python3 -m pytest tests/gpu -m gpu -rs -p no:cacheprovider ${OUT:+--junitxml "$OUT/gpu-tests.xml"} "$@" 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"
