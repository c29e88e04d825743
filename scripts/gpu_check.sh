#!/usr/bin/env bash
# The GPU measurements in docs/gpu.md, in one run from the repository root on a CUDA machine with torch,
# triton and transformers installed (it installs this checkout editable, without dependencies or network).
# Writes under ${OUT:-runs/gpu}: log.txt, kernels_bf16/fp32.json (Triton vs torch, scripts/gpu_kernels.py),
# throughput.json (eval needle at batch 1/4/8), attention.json/.png, decode.json/.png, generate.json.
# Each step has its own time limit, so that one failing step leaves the others' results.
set -u
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
TMP=$(mktemp -d)
LP="python3 -m longpatch"
step() { local limit=$1; shift; echo "=== $* (limit ${limit}s)"; local t0=$SECONDS
  timeout "$limit" "$@"; echo "=== rc=$? in $((SECONDS - t0))s"; }
{
  nvidia-smi -L
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name())"
  step 120 python3 scripts/gpu_kernels.py --device cuda --n 4100 --head-dims 128 --dtypes bfloat16 --grad-n 0 \
    --out "$TMP/kb"
  cp "$TMP/kb/results.json" "$OUT/kernels_bf16.json"
  step 300 python3 scripts/gpu_kernels.py --device cuda --n 4100 --head-dims 64 --dtypes float32 --grad-n 1024 \
    --out "$TMP/kf"
  cp "$TMP/kf/results.json" "$OUT/kernels_fp32.json"
  step 120 python3 scripts/batch_throughput.py --batch-sizes 1,4,8 --rounds 2 --out "$OUT/throughput.json"
  step 120 $LP bench attention --device cuda --dtype bfloat16 --methods hyper,moba,nsa,sparse --heads 32 \
    --kv-heads 8 --head-dim 128 --seq-lens 8192,16384,32768,65536,131072 --mode causal --repeats 5 \
    --out "$TMP/attn"
  cp "$TMP/attn/attention_bench.json" "$OUT/attention.json"; cp "$TMP/attn/attention_bench.png" "$OUT/attention.png"
  step 50 $LP bench decode --device cuda --dtype bfloat16 --methods moba,nsa,sparse --heads 32 --kv-heads 8 \
    --head-dim 128 --cache-lens 32768,131072 --repeats 50 --out "$TMP/dec"
  cp "$TMP/dec/decode_bench.json" "$OUT/decode.json"; cp "$TMP/dec/decode_bench.png" "$OUT/decode.png"
  step 70 $LP bench generate --model demo --config demo-moba,demo-nsa,demo-sparse --layers 4 --contexts 32768 \
    --new-tokens 32 --out "$TMP/gen"
  cp "$TMP/gen/results.json" "$OUT/generate.json"
} 2>&1 | tee "$OUT/log.txt"
