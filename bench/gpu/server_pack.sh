#!/bin/bash
# Makes what a whole SGLang 0.5.23 server needs on the device machine, in .carry/server/ (ignored;
# carry [".carry/server"]), for bench/gpu/run_server_suite.sh. Run here, from the repository root,
# after .ci/setup-tests (it reads .venv). About 55 MB; the device takes 64 MiB a call, the working
# tree included.
#   sglang-0.5.23.tar.xz  SGLang's installed package from .venv (its tests, benchmarks other than
#                         bench_serving's and the multimodal generator left out)
#   whl/                  cp312 wheels of the packages the device lacks (versions .venv holds;
#                         transformers at SGLang's pin)
#   standins/             the smallest stand-ins (bench/gpu/README.md lists each, with why and what
#                         of SGLang it replaces): sgl_kernel (import-only, tests/support/sgl_kernel,
#                         with the torch bodies of bench/gpu/server_standins/ for the few names a
#                         server calls) and cutlass (inert)
#   src/                  kvdoctor, its maps (probes/), setup.py and tests/support at HEAD (git archive), its commit in COMMIT
#   model/                the tests' tiny Llama (.venv/sglang-tiny-model)
#   model-8b/             its tokenizer with a Llama-3-8B-shaped config: served with --load-format
#                         dummy (random weights made on the GPU), a decode step of a few ms
set -eu
cd "$(dirname "$0")/../.."
SP=.venv/lib/python3.11/site-packages
D=.carry/server
mkdir -p $D/whl $D/standins
grep -qx '/.carry/' .gitignore || echo '/.carry/' >> .git/info/exclude
if [ ! -f $D/sglang-0.5.23.tar.xz ]; then
  tar cf - -C $SP --exclude=__pycache__ --exclude=sglang/multimodal_gen --exclude=sglang/test \
    --exclude=sglang/jit_kernel/tests --exclude=sglang/kernels/tests sglang sglang-0.5.23.dist-info \
    | xz -T2 -6 > $D/sglang-0.5.23.tar.xz.tmp
  mv $D/sglang-0.5.23.tar.xz.tmp $D/sglang-0.5.23.tar.xz
fi
# bench/gpu/README.md's list for 0.5.23 plus what a whole server imports (GPU-SERVER notes, 2026-12-01)
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_5_x86_64 --platform any -d $D/whl \
  annotated-types==0.8.0 apache-tvm-ffi==0.1.11 cffi==2.1.1 compressed-tensors==0.20.0 dill==0.4.1 distro==1.9.0 \
  gguf==0.19.0 httpcore2==2.16.2 httpx2==2.16.2 ipython==9.18.1 loguru==0.7.3 msgspec==0.22.0 openai==2.8.0 \
  opentelemetry-api==1.45.2 orjson==3.13.0 partial-json-parser==0.2.1.1.post7 pybase64==1.5.1 pydantic==2.14.3 \
  pydantic_core==2.50.4 python-multipart==0.0.34 pyzmq==27.3.0 sniffio==1.3.1 soundfile==0.14.0 starlette==1.10.0 \
  traitlets==5.16.1 transformers==5.19.0 truststore==0.10.5 typing-inspection==0.4.5 xgrammar==0.2.8 zstandard==0.25.0 \
  fastapi==0.165.0 uvicorn==0.54.0 interegular==0.3.3 setproctitle==1.3.8 jiter==0.19.0 pycparser==3.12 \
  watchfiles==1.3.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
  tzdata==2026.6 multiprocess==0.70.19 datasets==5.2.0
# stand-ins
rm -rf $D/standins/sgl_kernel $D/standins/cutlass
cp -r tests/support/sgl_kernel $D/standins/sgl_kernel
rm -rf $D/standins/sgl_kernel/__pycache__
S=bench/gpu/server_standins
{ echo; echo "# --- bench/gpu/server_standins/sgl_kernel_bodies.py: the names a server calls ---"; cat $S/sgl_kernel_bodies.py; } >> $D/standins/sgl_kernel/__init__.py
cp $S/sgl_kernel_utils.py $D/standins/sgl_kernel/utils.py
cat $S/sgl_kernel_kvcacheio_direct.py >> $D/standins/sgl_kernel/kvcacheio.py
cp -r $S/cutlass $D/standins/cutlass
# kvdoctor and the tests' server clients and planted faults as committed (HEAD), not the working
# tree: the suite judges a commit
rm -rf $D/src && mkdir -p $D/src
git archive HEAD kvdoctor probes setup.py pyproject.toml tests/support | tar x -C $D/src
git rev-parse HEAD > $D/src/COMMIT
# models
rm -rf $D/model $D/model-8b
cp -r .venv/sglang-tiny-model $D/model
mkdir -p $D/model-8b
cp .venv/sglang-tiny-model/tokenizer* .venv/sglang-tiny-model/chat_template.jinja $D/model-8b/ 2>/dev/null || true
.venv/bin/python - "$D" <<'PY'
import json, sys
d = sys.argv[1]
tiny = json.load(open(f"{d}/model/config.json"))
cfg = dict(tiny)
cfg.update(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
           num_key_value_heads=8, head_dim=128, vocab_size=32000, max_position_embeddings=4096, rope_theta=500000.0)
json.dump(cfg, open(f"{d}/model-8b/config.json", "w"), indent=1)
PY
du -sh $D $D/* | sed 's/^/  /'
