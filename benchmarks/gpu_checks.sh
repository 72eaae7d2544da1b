#!/usr/bin/env bash
# The GPU tests and the GPU benchmarks in one call, on one GPU (or two, mode `two`). Results land under $OUT:
# one log per step, the benchmarks' JSONs (each with the command that made it), plots when matplotlib is there.
#
#   bash benchmarks/gpu_checks.sh              # one GPU: the GPU tests, then the benchmarks (quick shapes)
#   bash benchmarks/gpu_checks.sh tests        # one GPU: every GPU test, the FSDP2 smoke run, each variant's kernels
#   bash benchmarks/gpu_checks.sh bench        # one GPU: attention CP1 rows, the ring's blocks, a transformers
#                                              # decoder, host time per layer (full shapes)
#   bash benchmarks/gpu_checks.sh bench quick  # the same, target rows only (GQA-8 16k/64k, long-tail thd, 16k
#                                              # decoder, 4096-document packs)
#   bash benchmarks/gpu_checks.sh two          # two GPUs: the 2-GPU tests, attention / decoder / host time at CP2
#   bash benchmarks/gpu_checks.sh sentinel     # one GPU: the sentinel's GPU tests, then a sampled step vs an
#                                              # unsampled one (transformers GQA decoder, 32k and 64k tokens)
#   PYTHON=.venv/bin/python bash benchmarks/gpu_checks.sh cpu-dry   # crash test of every benchmark step on CPU
#
# Extra arguments after the mode (and `quick`) go to bench_attention.py.
#
# Time: every step has its own limit, and the whole call a budget (CPSCOPE_GPU_BUDGET_S, default 570 s, under a
# 10-minute limit per call): a step gets what is left of it, a step that no longer fits is skipped and logged, and
# a step that fails or times out does not stop the next.
#
# Python: $PYTHON (default python3, e.g. a CUDA build of torch on the machine) with this checkout first on
# PYTHONPATH; `bash scripts/setup.sh` then PYTHON=.venv/bin/python uses the set-up environment instead.
# Optional pieces, used when present:
#   * wheels in $CPSCOPE_WHEELS (default .whl/): nvidia-cudnn-frontend (cuDNN packed blocks), transformers and its
#     dependencies, megatron-core; installed to /tmp/site, without their dependencies;
#   * TransformerEngine, when its parts were copied to /root/te (installed by /root/te/device-setup.sh); torch's
#     bundled cuDNN is then put first in LD_LIBRARY_PATH, so that TE, torch and cpscope share one cuDNN
#     (docs/benchmarks.md, "Ring attention"); without TE its tests skip and its columns read "-".
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error
OUT=${OUT:-/tmp/cpscope-gpu-out}; mkdir -p "$OUT"
LOG=$OUT/gpu_checks.log
PYTHON=${PYTHON:-python3}
BUDGET=${CPSCOPE_GPU_BUDGET_S:-570}
WHEELS=${CPSCOPE_WHEELS:-.whl}
mode=${1:-all}; shift || true
quick=${1:-}; [[ $quick == quick ]] && shift || quick=
[[ $mode == all ]] && quick=quick

step() {  # step NAME LIMIT_S CMD...: run within the budget, log everything, show the tail, never abort
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - SECONDS - 10))
  if (( left < 30 )); then
    echo "=== $name skipped: ${left}s of the ${BUDGET}s budget left" | tee -a "$LOG"
    return
  fi
  (( limit > left )) && limit=$left
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -v -i "warn" "$OUT/$name.log" | tail -n 30
  echo "=== $name rc=$rc in $((SECONDS - t0)) s" | tee -a "$LOG"
}

if [[ -f /root/te/core-name && ! -d /root/te/site/transformer_engine/pytorch ]]; then
  (time bash /root/te/device-setup.sh) 2>&1 | tail -n 5
fi
extra_path=
if [[ -d /root/te/site ]]; then
  extra_path=/root/te/site
  cudnn_dir=$("$PYTHON" -c "import os, nvidia.cudnn as c; print(os.path.join(list(c.__path__)[0], 'lib'))" \
    2>/dev/null)
  [[ -n $cudnn_dir ]] && export LD_LIBRARY_PATH=$cudnn_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
if ls "$WHEELS"/*.whl >/dev/null 2>&1 && [[ ! -d /tmp/site ]]; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$WHEELS"/*.whl 2>&1 |
    grep -v WARN
fi
[[ -d /tmp/site ]] && extra_path=/tmp/site${extra_path:+:$extra_path}
export PYTHONPATH=$PWD${extra_path:+:$extra_path}${PYTHONPATH:+:$PYTHONPATH}

[[ $mode != cpu-dry ]] && nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader | tee -a "$LOG"
"$PYTHON" -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python',
  sys.version.split()[0])" | tee -a "$LOG"
for m in transformers cudnn transformer_engine megatron.core triton; do
  "$PYTHON" -c "import $m as x; print('$m', getattr(x, '__version__', '?'))" 2>/dev/null | tee -a "$LOG" ||
    echo "$m: not importable" | tee -a "$LOG"
done

run_tests() {
  step gpu_tests 330 "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider tests
  step fsdp_smoke 100 "$PYTHON" -m torch.distributed.run --nproc_per_node=1 benchmarks/bench_hybrid_fsdp.py --smoke \
    --out "$OUT" --json hybrid_fsdp_smoke.json
  step variant_kernels 100 "$PYTHON" benchmarks/bench_variants.py --one-gpu --out "$OUT"
}

run_bench() {
  local attn=(--check --kernels --out "$OUT") hf=(--kernels --out "$OUT") host=(--out "$OUT")
  if [[ -n $quick ]]; then
    attn+=(--seqlens 16384 65536 --kv-heads 8 --packs longtail16)
    hf+=(--kv-heads 4 --tokens 16384)
    host+=(--docs 4096)
  fi
  step attention 240 "$PYTHON" benchmarks/bench_attention.py "${attn[@]}" "$@"
  step ring_blocks 120 "$PYTHON" benchmarks/bench_attention.py --blocks --no-rows --kernels --json attention_blocks.json \
    --out "$OUT" $([[ -n $quick ]] && echo --kv-heads 8 --blocks-seqlens 16384)
  step hf_decoder 120 "$PYTHON" benchmarks/bench_hf.py "${hf[@]}"
  step host_time 75 "$PYTHON" benchmarks/bench_host.py "${host[@]}" --tag gpu
}

case $mode in
  all) run_tests; run_bench "$@" ;;
  tests) run_tests ;;
  bench) run_bench "$@" ;;
  two)
    base=()
    for p in shared/tools/torch_cp_baseline.py ../shared/tools/torch_cp_baseline.py .device-in/torch_cp_baseline.py; do
      [[ -f $p ]] && base=(--baseline "$p") && break
    done
    attn=(--check --kernels --out "$OUT")
    [[ -n $quick ]] && attn+=(--seqlens 16384 65536 --kv-heads 8 --packs longtail16)
    step gpu_tests_2gpu 150 "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider tests/attention/test_gpu.py \
      tests/attention/test_variants_gpu.py
    step attention_cp2 240 "$PYTHON" -m torch.distributed.run --nproc_per_node=2 benchmarks/bench_attention.py \
      "${attn[@]}" "${base[@]}" --json attention_bench_cp2.json "$@"
    step hf_decoder_cp2 120 "$PYTHON" -m torch.distributed.run --nproc_per_node=2 benchmarks/bench_hf.py --kernels \
      --out "$OUT" --json hf_bench_cp2.json
    step host_time_cp2 75 "$PYTHON" -m torch.distributed.run --nproc_per_node=2 benchmarks/bench_host.py --out "$OUT" \
      --tag gpu_cp2
    ;;
  cpu-dry)  # tiny shapes, numbers meaningless: every benchmark step of this script runs
    step attention 300 "$PYTHON" benchmarks/bench_attention.py --device cpu --dry-run --check --kernels --out "$OUT"
    step ring_blocks 120 "$PYTHON" benchmarks/bench_attention.py --device cpu --dry-run --blocks --no-rows --kernels \
      --json attention_blocks.json --out "$OUT"
    step hf_decoder 150 "$PYTHON" benchmarks/bench_hf.py --device cpu --dry-run --out "$OUT"
    step host_time 90 "$PYTHON" benchmarks/bench_host.py --device cpu --dry-run --out "$OUT" --tag cpu_dry
    step sentinel_cost 90 "$PYTHON" benchmarks/bench_sentinel_gpu.py --tiny --out "$OUT"
    step attention_cp2 300 "$PYTHON" -m torch.distributed.run --nproc_per_node=2 benchmarks/bench_attention.py \
      --device cpu --dry-run --check --out "$OUT" --json attention_bench_cp2.json
    ;;
  sentinel)
    step sentinel_gpu_tests 200 "$PYTHON" -m pytest -q -s -m gpu -p no:cacheprovider tests/test_sentinel_gpu.py
    step sentinel_cost 300 "$PYTHON" benchmarks/bench_sentinel_gpu.py --out "$OUT"
    ;;
  *) echo "unknown mode '$mode' (all | tests | bench [quick] | two [quick] | sentinel | cpu-dry)"; exit 2 ;;
esac
if "$PYTHON" -c "import matplotlib" 2>/dev/null && ls "$OUT"/*.json >/dev/null 2>&1; then
  "$PYTHON" benchmarks/plot_results.py --in "$OUT" --out "$OUT" 2>&1 | tail -n 6
fi
ls -la "$OUT" | tee -a "$LOG"
