#!/usr/bin/env bash
# The GPU measurements in docs/gpu.md, in one run from the repository root on a CUDA machine with torch,
# triton and transformers installed (it installs this checkout editable, without dependencies or network).
# Writes under ${OUT:-runs/gpu}: log.txt, kernels_bf16/fp32.json (Triton vs torch, scripts/gpu_kernels.py),
# throughput.json (eval needle at batch 1/4/8), attention.json/.png, decode.json/.png, generate.json.
# Each step has its own time limit, so that one failing step leaves the others' results.
#
# flex (the default: `bash scripts/gpu_check.sh`, about 6 minutes): backend flex against the torch path on
# the GPU (scripts/gpu_flex_check.py -> flex_check.json), FlexAttention vs SDPA vs the
# Triton kernels (prefill at 32k/131k, decode at 131k, NSA's peak memory, compile times:
# scripts/gpu_flex.py -> flex.json), the kernels vs their twins in bf16 (kernels_bf16.json) and
# Llama-3.1-8B's architecture with random weights end to end at 32k/64k/128k, unpatched and every layer
# on MoBA's query-aware selection (e2e_llama8b.json). `bash scripts/gpu_check.sh all`: the earlier set
# below as well (about 12 more minutes). DRY_RUN=1 runs the flex steps tiny on the CPU (no GPU, no
# install): flex on the compiled CPU path, a 2-layer llama, no kernels.
# Needles (`bash scripts/gpu_check.sh needles`; about 4 minutes on an H100): the 32k passkey and code needle
# grids (40 prompts each) of demo-moba-32k and demo-nsa-32k on the GPU path (backend auto: flex), every
# layer, exact beside them, compared prompt by prompt with the CPU's records in docs/img/heldout
# (scripts/needle_agreement.py -> needle_agreement_{passkey,code}.json); TRIALS=2 halves it (20 prompts each).
# DRY_RUN=1: one 1024-token prompt. `bash scripts/gpu_check.sh flex+needles`: both in one call (SKIP_KERNELS=1
# leaves out the kernels' bf16 check, e.g. when an earlier call of the lease measured it).
# FLEX_LIMIT, E2E_LIMIT, NEEDLE_LIMIT: the steps' time limits in seconds (200, 170, 240 per template).
# `bash scripts/gpu_check.sh selection` (about 6.5 minutes on an H100, at most 8.4 with its step limits): the
# query-aware selections' GPU form against the CPU code (gpu_flex_check.py without the demo logits), the flex
# table (gpu_flex.py), a decode step's profile (gpu_decode_profile.py), the needles (TRIALS, default
# 2; their agreements, not their records) and Llama-3.1-8B's architecture at 128k only.
# `bash scripts/gpu_check.sh scoring` (about 3 minutes on an H200): `bench attention` of the hybrid selections at
# demo-moba-32k's and demo-nsa-32k's params, 32k and 131k, beside SDPA (scoring_moba.json, scoring_nsa.json), and
# the antidiagonal scoring alone, its Triton kernel against the torch form, 32k to 262k (scoring_kernel.json).
# `bash scripts/gpu_check.sh prefill` (about 7 minutes): the same at 32k, 131k and 262k (prefill_moba.json,
# prefill_nsa.json, scoring_kernel.json) and Llama-3.1-8B's architecture with llama-3.1-8b-moba-hybrid, TTFT at
# 128k and 256k beside the unpatched model (prefill_llama8b.json).
# `bash scripts/gpu_check.sh decode` (about 7 minutes): a decode step's profile with the graph-safe and compiled
# steps and the split-K kernel's bandwidth (decode_profile.json), `bench decode --steps eager,graph,compiled` of
# MoBA and NSA at the shipped configs' params beside SDPA at 131k (decode_moba.json, decode_nsa.json), and
# Llama-3.1-8B's architecture at 128k with `bench generate --compile`, unpatched and llama-3.1-8b-moba-hybrid
# (decode_llama8b.json).
# `bash scripts/gpu_check.sh million` (at most 9 minutes with its step limits): Llama-3.1-8B's architecture with
# random weights, every layer on llama-3.1-8b-moba-hybrid (topk 32: its budget raised with the length), prompts
# of 128k, 256k and 512k tokens, then 1M, prefilled in chunks of 32k (--prefill-chunk) into the 8-bit KV cache
# (--cache int8), the unpatched model beside it up to 256k (million_llama8b.json, million_big_llama8b.json:
# TTFT, decode ms/token, peak GPU memory and the cache's MiB per row).
# `bash scripts/gpu_check.sh figures` (DEADLINE seconds, default 540; PARTS, default "decode prefill", any of
# decode, prefill, llama): the decode suite's profile and `bench decode` at 131k, the prefill suite's hybrid calls
# (MoBA 32k-262k, NSA 32k-131k) and scoring kernel, and Llama-3.1-8B's compiled decode at 128k, in one call
# that ends by the deadline; `decode` is PARTS="decode llama" of it.
set -u
OUT=${OUT:-runs/gpu}
SUITE=${1:-flex}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ "${DRY_RUN:-0}" = 1 ]; then
  PY=${PYTHON:-python}
else
  PY=python3
  $PY -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
fi
TMP=$(mktemp -d)
LP="$PY -m longpatch"
# DEADLINE (seconds from the start): no step runs past it, whatever its own limit (a lease's suites)
step() { local limit=$1; shift
  if [ -n "${DEADLINE:-}" ]; then
    local left=$((DEADLINE - SECONDS)); [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 10 ]; then echo "=== skipped (deadline): $*"; return; fi
  fi
  echo "=== $* (limit ${limit}s)"; local t0=$SECONDS
  timeout "$limit" "$@"; echo "=== rc=$? in $((SECONDS - t0))s"; }
flex() {
  if [ "${DRY_RUN:-0}" = 1 ]; then
    step 300 $PY scripts/gpu_flex_check.py --device cpu --lengths 1100 --demo-len 600 --out "$OUT/flex_check.json"
    step 600 $PY scripts/gpu_flex.py --dry-run --repeats 2 --out "$OUT/flex.json"
    export LONGPATCH_ARCH_OVERRIDES='{"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}'
    CTX=512,1024; SEL="--set chunk_size=64 --set topk=4"
  else
    $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name())"
    # correctness before speed: flex against the torch path on the GPU (cases, the demo model's logits)
    step 90 $PY scripts/gpu_flex_check.py --lengths 4100 --demo-len 8192 --out "$OUT/flex_check.json"
    # recompiles logged: on an H100 the first moba/nsa calls at 32k took 3.7/5.0 s after the warm-up (why?)
    TORCH_LOGS=recompiles step ${FLEX_LIMIT:-200} $PY scripts/gpu_flex.py --out "$OUT/flex.json"
    [ "${SKIP_KERNELS:-0}" = 1 ] || step 120 $PY scripts/gpu_kernels.py --device cuda --n 4100 --head-dims 128 --dtypes bfloat16 --grad-n 0 \
      --out "$TMP/kb"
    [ "${SKIP_KERNELS:-0}" = 1 ] || cp "$TMP/kb/results.json" "$OUT/kernels_bf16.json"
    CTX=32768,65536,131072; SEL="--set chunk_size=256 --set topk=16"
  fi
  # every layer on MoBA's query-aware selection (backend auto: flex on CUDA), beside the unpatched model
  step ${E2E_LIMIT:-170} $LP bench generate --model llama-3.1-8b --random-weights --method moba --set selection=estimate \
    $SEL --set mass=0.9 --set local_blocks=1 --layers all --contexts $CTX --new-tokens 8 --no-plots \
    --no-progress --out "$TMP/e2e"
  cp "$TMP/e2e/results.json" "$OUT/e2e_llama8b.json"
}
needles() {
  local G="--model demo --config demo-moba-32k,demo-nsa-32k --layer-counts 0,all --no-progress"
  if [ "${DRY_RUN:-0}" = 1 ]; then G="$G --lengths 1024 --depths 0.5 --trials 1"
  else G="$G --lengths 32768 --depths 0.05:0.95:0.1 --trials ${TRIALS:-4}"; fi
  for t in passkey code; do
    step ${NEEDLE_LIMIT:-240} $LP eval needle $G --template $t --out "$TMP/needle_$t"
    # exact's CPU records, then the configs' records since their decode step last changed (it changed their answers)
    $PY scripts/needle_agreement.py --reference docs/img/heldout/grid_$t/records.jsonl \
      docs/img/heldout/rerun/seed0_$t/records.jsonl --other "$TMP/needle_$t/records.jsonl" --out "$OUT/needle_agreement_$t.json"
    echo "=== agreement rc=$?"
    [ "${KEEP_RECORDS:-1}" = 0 ] || cp "$TMP/needle_$t/records.jsonl" "$OUT/needle_$t.records.jsonl"
  done
}
selection() {
  if [ "${DRY_RUN:-0}" = 1 ]; then
    step 300 $PY scripts/gpu_flex_check.py --device cpu --lengths 1100 --demo-len 0 --out "$OUT/flex_check.json"
    step 600 $PY scripts/gpu_flex.py --dry-run --repeats 2 --out "$OUT/flex.json"
  else
    step ${CHECK_LIMIT:-90} $PY scripts/gpu_flex_check.py --lengths 4100 --demo-len 0 --out "$OUT/flex_check.json"
    TORCH_LOGS=recompiles step ${FLEX_LIMIT:-110} $PY scripts/gpu_flex.py --out "$OUT/flex.json"
  fi
  # where a decode step's time goes (launches, syncs, kernels); the dry run: tiny, on the CPU
  step ${PROFILE_LIMIT:-45} $PY scripts/gpu_decode_profile.py $([ "${DRY_RUN:-0}" = 1 ] && echo --dry-run --steps 3) \
    --out "$OUT/decode_profile.json"
  # at most 8 files come back from a lease: the agreements, not the needle records
  KEEP_RECORDS=0 TRIALS=${TRIALS:-2} NEEDLE_LIMIT=${NEEDLE_LIMIT:-90} needles
  [ "${DRY_RUN:-0}" = 1 ] || step ${E2E_LIMIT:-70} $LP bench generate --model llama-3.1-8b --random-weights --method moba \
    --set selection=estimate --set chunk_size=256 --set topk=16 --set mass=0.9 --set local_blocks=1 --layers all \
    --contexts 131072 --new-tokens 8 --no-plots --no-progress --out "$TMP/e2e"
  [ "${DRY_RUN:-0}" = 1 ] || cp "$TMP/e2e/results.json" "$OUT/e2e_llama8b.json"
}
hybrid_attention() {
  # bench attention of the hybrid selections at the shipped configs' params (MoBA, NSA) against SDPA at lengths
  # $1, with the error on inputs whose dominant key sits n/3 back; $2: the files' prefix
  local M="--device cuda --dtype bfloat16 --heads 32 --kv-heads 8 --head-dim 128 --mode causal --repeats 5 --no-memory"
  local L=$1 LN=${3:-$1}
  if [ "${DRY_RUN:-0}" = 1 ]; then M="--heads 4 --kv-heads 2 --head-dim 64 --mode causal --repeats 1 --no-memory"; L=4096; LN=4096; fi
  local H="--set selection=hybrid --set mass=0.9 --set estimate_queries=64 --set score_stride=16"
  step ${SCORING_LIMIT:-150} $LP bench attention $M --seq-lens $L --methods moba $H --set chunk_size=256 --set topk=16 \
    --set local_blocks=1 --out "$TMP/moba"
  cp "$TMP/moba/attention_bench.json" "$OUT/$2_moba.json"
  step ${SCORING_LIMIT:-150} $LP bench attention $M --seq-lens $LN --methods nsa $H --set compress_block=32 \
    --set compress_stride=16 --set select_block=256 --set num_selected=16 --set window=256 --set init_blocks=1 \
    --set local_blocks=2 --set 'gates=[0.0, 0.9, 0.1]' --out "$TMP/nsa"
  cp "$TMP/nsa/attention_bench.json" "$OUT/$2_nsa.json"
}
scoring_kernel() {
  # the antidiagonal scoring alone: its Triton kernel against the torch form's score rows (median ms)
  local DEV=cuda DT=bfloat16 H=32 HK=8 D=128 NS=32768,131072,262144
  if [ "${DRY_RUN:-0}" = 1 ]; then DEV=cpu DT=float32 H=2 HK=1 D=16 NS=512; export TRITON_INTERPRET=1; fi
  step ${SCORING_LIMIT:-150} $PY -c "
import json, time, torch
from longpatch.methods import selection
dev, dt = torch.device('$DEV'), getattr(torch, '$DT')
rows = []
for n in [int(x) for x in '$NS'.split(',')]:
    q = torch.randn(1, $H, n, $D, device=dev, dtype=dt); k = torch.randn(1, $HK, n, $D, device=dev, dtype=dt)
    row, outs = {'n': n}, []
    for name, flag in (('torch_form_ms', False), ('kernel_ms', True)):
        selection.FUSED_SCORES = flag
        f = (lambda: selection.antidiagonal_scores(q, k, 256, 16, $D ** -0.5)) if dev.type == 'cuda' else \\
            (lambda: (selection.antidiagonal_scores_fused if flag else selection.antidiagonal_scores)(q, k, 256, 16, $D ** -0.5))
        f(); ts = []
        for _ in range(5):
            if dev.type == 'cuda': torch.cuda.synchronize()
            t = time.perf_counter(); f()
            if dev.type == 'cuda': torch.cuda.synchronize()
            ts.append((time.perf_counter() - t) * 1e3)
        row[name] = sorted(ts)[2]
        if n <= 32768: outs.append(f())
    if len(outs) == 2:  # the kernel against the torch form on the GPU: score rows, and each row's top 16 blocks
        a, b = outs
        both = torch.isfinite(a) & torch.isfinite(b)  # causal: the blocks after the query's are masked in both
        row['max_abs_diff'] = float(torch.where(both, a - b, 0).abs().max()); t = min(16, a.shape[-1])
        row['masked_alike'] = bool((torch.isfinite(a) == torch.isfinite(b)).all())
        ta, tb = a.topk(t, -1).indices, b.topk(t, -1).indices
        row['top16_overlap'] = float((ta.unsqueeze(-1) == tb.unsqueeze(-2)).any(-1).float().mean())
    print(row, flush=True); rows.append(row)
json.dump(rows, open('$OUT/scoring_kernel.json', 'w'), indent=1)
"
}
scoring() {
  hybrid_attention 32768,131072 scoring
  scoring_kernel
}
prefill() {
  # the prefill figures: the hybrid selections at 32k-262k beside SDPA, the scoring kernel, and Llama-3.1-8B's
  # architecture (random weights) with llama-3.1-8b-moba-hybrid at 128k and 256k beside the unpatched model
  hybrid_attention 32768,131072,262144 prefill
  scoring_kernel
  local CTX=131072,262144 SEL=""
  if [ "${DRY_RUN:-0}" = 1 ]; then
    export LONGPATCH_ARCH_OVERRIDES='{"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}'
    CTX=512,1024; SEL="--set chunk_size=64 --set topk=4"
  fi
  step ${E2E_LIMIT:-200} $LP bench generate --model llama-3.1-8b --random-weights --config llama-3.1-8b-moba-hybrid \
    $SEL --contexts $CTX --new-tokens 2 --repeats 1 --no-plots --no-progress --out "$TMP/e2e"
  cp "$TMP/e2e/results.json" "$OUT/prefill_llama8b.json"
}
decode() {
  # the decode figures: PARTS="decode llama" of figures() below, with no deadline of its own
  DEADLINE=${DEADLINE:-100000} PARTS="decode llama" figures
}
decode_llama() {
  local CTX=131072 SEL=""
  if [ "${DRY_RUN:-0}" = 1 ]; then
    export LONGPATCH_ARCH_OVERRIDES='{"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}'
    CTX=1024; SEL="--set chunk_size=64 --set topk=4"
  fi
  # recompiles logged: a second generation (the timed one after the warm-up) must reuse the compiled step
  TORCH_LOGS=recompiles step ${E2E_LIMIT:-220} $LP bench generate --model llama-3.1-8b --random-weights \
    --config llama-3.1-8b-moba-hybrid $SEL --contexts $CTX --new-tokens 16 --repeats 1 --compile --no-plots \
    --no-progress --out "$TMP/e2e"
  cp "$TMP/e2e/results.json" "$OUT/decode_llama8b.json"
}
figures() {
  # the GPU figures of one call (DEADLINE, default 540 s: no step runs past it): PARTS (default
  # "decode prefill") picks them. decode: the decode step's profile and the split-K kernel's bandwidth, bench
  # decode of MoBA and NSA at 131k (eager, graph-safe, compiled) beside SDPA; prefill: the hybrid selections at
  # 32k-262k beside SDPA and the scoring kernel against its torch form; llama: Llama-3.1-8B's architecture at
  # 128k, unpatched and llama-3.1-8b-moba-hybrid, TTFT and the compiled static-cache decode step
  DEADLINE=${DEADLINE:-540}
  local PARTS=${PARTS:-decode prefill}
  local DRY="" M="--device cuda --dtype bfloat16 --heads 32 --kv-heads 8 --head-dim 128 --cache-lens 131072 --repeats 50"
  if [ "${DRY_RUN:-0}" = 1 ]; then DRY="--dry-run --steps 3"; M="--heads 4 --kv-heads 2 --head-dim 32 --cache-lens 8192 --repeats 3"; fi
  if [[ " $PARTS " == *" decode "* ]]; then
    step ${PROFILE_LIMIT:-130} $PY scripts/gpu_decode_profile.py $DRY --out "$OUT/decode_profile.json"
    local H="--set selection=hybrid --set mass=0.9 --set estimate_queries=64 --set score_stride=16 --set decode_page=4"
    H="$H --set decode_topk=16 --steps eager,graph,compiled --no-errors"
    step ${DECODE_LIMIT:-80} $LP bench decode $M --methods moba $H --set chunk_size=256 --set topk=16 \
      --set local_blocks=1 --out "$TMP/dmoba"
    cp "$TMP/dmoba/decode_bench.json" "$OUT/decode_moba.json"
    step ${DECODE_LIMIT:-80} $LP bench decode $M --methods nsa $H --set compress_block=32 --set compress_stride=16 \
      --set select_block=256 --set num_selected=16 --set window=256 --set init_blocks=1 --set local_blocks=2 \
      --set 'gates=[0.0, 0.9, 0.1]' --out "$TMP/dnsa"
    cp "$TMP/dnsa/decode_bench.json" "$OUT/decode_nsa.json"
  fi
  if [[ " $PARTS " == *" prefill "* ]]; then
    SCORING_LIMIT=${SCORING_LIMIT:-110} hybrid_attention 32768,131072,262144 prefill 32768,131072
    SCORING_LIMIT=60 scoring_kernel
  fi
  if [[ " $PARTS " == *" llama "* ]]; then decode_llama; fi
}
million() {
  # 128k-512k, then 1M alone (each its own record: a row cut off by the limit loses only itself); the 8-bit KV
  # cache (MILLION_CACHE, default int8; "growing" for bf16); the unpatched model up to 256k (UNPATCHED_UP_TO)
  local CTX=${MILLION_CTX:-131072,262144,524288} BIG=${MILLION_BIG:-1048576} SEL="--set topk=32" CHUNK=32768
  local UP=${UNPATCHED_UP_TO:-262144}
  if [ "${DRY_RUN:-0}" = 1 ]; then
    export LONGPATCH_ARCH_OVERRIDES='{"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}'
    CTX=1024,2048; BIG=4096; SEL="--set chunk_size=64 --set topk=4"; CHUNK=512; UP=1024
  fi
  local G="--model llama-3.1-8b --random-weights --config llama-3.1-8b-moba-hybrid $SEL --prefill-chunk $CHUNK"
  G="$G --cache ${MILLION_CACHE:-int8} --unpatched-up-to $UP --new-tokens 8 --repeats 1 --no-plots --no-progress"
  step ${E2E_LIMIT:-300} $LP bench generate $G --contexts $CTX --out "$TMP/million"
  cp "$TMP/million/results.json" "$OUT/million_llama8b.json"
  step ${BIG_LIMIT:-240} $LP bench generate $G --contexts $BIG --warmup 0 --out "$TMP/million_big"
  cp "$TMP/million_big/results.json" "$OUT/million_big_llama8b.json"
}
if [ "$SUITE" = figures ]; then figures 2>&1 | tee "$OUT/log.txt"; exit; fi
if [ "$SUITE" = million ]; then million 2>&1 | tee "$OUT/log.txt"; exit; fi
if [ "$SUITE" = decode ]; then decode 2>&1 | tee "$OUT/log.txt"; exit; fi
if [ "$SUITE" = scoring ]; then scoring 2>&1 | tee "$OUT/log.txt"; exit; fi
if [ "$SUITE" = prefill ]; then prefill 2>&1 | tee "$OUT/log.txt"; exit; fi
if [ "$SUITE" = selection ]; then selection 2>&1 | tee "$OUT/log.txt"; exit; fi
if [ "$SUITE" = flex ]; then flex 2>&1 | tee "$OUT/log.txt"; exit; fi
if [ "$SUITE" = needles ]; then needles 2>&1 | tee "$OUT/log.txt"; exit; fi
if [ "$SUITE" = flex+needles ]; then { flex; needles; } 2>&1 | tee "$OUT/log.txt"; exit; fi
{
  flex  # the bf16 kernel check included
  nvidia-smi -L
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
