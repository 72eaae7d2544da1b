#!/usr/bin/env bash
# Issue #14's measurements in one device call. Results (JSON + logs) land under $OUT.
#
#   bash benchmarks/gpu_issue14.sh            # one H200 (default): everything that runs on one GPU, expected
#                                             # ~4-5 min, at most ~9.5 min (the step limits below)
#   bash benchmarks/gpu_issue14.sh two        # two H200s: the CP2 rows (attention, transformers, host) + the
#                                             # 2-GPU parity tests, expected ~5-6 min, at most ~9.5 min
#   bash benchmarks/gpu_issue14.sh one quick  # one GPU, 16k/64k GQA-8 rows and the 4096-document host rows only
#   PYTHON=.venv/bin/python bash benchmarks/gpu_issue14.sh cpu-dry   # crash test of every step on CPU
#
# One GPU, in this order (each step has its own timeout; a step that fails or times out does not stop the next):
#   1. bench_attention.py   CP1 rows: bshd 4k/16k/64k and thd 128k (16 long-tail / 64x2k / 512x256) x k/v heads
#                           32/8/4, cpscope vs SDPA (enable_gqa) / varlen_attn / TE, --check parity, --kernels
#                           (expected ~100-120 s without TE, ~150 s with; limit 240 s)
#   2. bench_attention.py --blocks --no-rows: the ring's CP2 blocks on one GPU (~80 s; limit 120 s)
#   3. bench_hf.py          Llama GQA decoder 16k/4k, 4 and 16 k/v heads, sdpa vs cpscope (~40 s; limit 120 s)
#   4. bench_host.py        host time per layer, 16/256/4096 documents, CP1 + CP2 (fake group) (~25 s; limit 75 s)
# Two GPUs: 2-GPU parity tests (limit 120 s), attention CP2 rows (~150 s; limit 240 s), transformers CP2 (limit
# 120 s), host CP2 (limit 75 s).
# Estimates from docs/benchmarks.md and issue #14's figures: e.g. a 64k GQA fwd+bwd of cpscope today ~0.4 s, timed
# 3 warm-ups + 5 (the per-measurement budget cuts 10 to 5), + its fp32 parity reference (~2-4 s); start-up of each
# Python process ~15 s.
#
# TE (optional): if its five parts were copied to /root/te (../shared/tools/te-gpu/README.md, ~5 min of device time
# on its own), it is installed / used and its rows appear; otherwise the TE columns read "-" and the output says
# "TE off (transformer_engine not importable)". Wheels in .whl/ (nvidia-cudnn-frontend for the cuDNN packed blocks;
# transformers and its dependencies if the machine lacks them) are installed to /tmp/site first.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error
OUT=${OUT:-/tmp/cpscope-gpu-out}; mkdir -p "$OUT"
mode=${1:-one}; shift || true
quick=${1:-}; [[ $quick == quick ]] && shift || quick=
LOG=$OUT/issue14.log
step() {  # step NAME LIMIT_S CMD...: run with a timeout, log everything, show the tail, never abort the script
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s): $*" | tee -a "$LOG"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -v -i "warning" "$OUT/$name.log" | tail -n 45
  echo "=== $name rc=$rc in $((SECONDS - t0)) s" | tee -a "$LOG"
}

if [[ -f /root/te/core-name && ! -d /root/te/site/transformer_engine/pytorch ]]; then
  (time bash /root/te/device-setup.sh) 2>&1 | tail -n 5
fi
if [[ -d /root/te/site ]]; then
  export PYTHONPATH=/root/te/site
  # torch's bundled cuDNN first: TE would otherwise load the system cuDNN and shadow it (docs/benchmarks.md §2)
  cudnn_dir=$(python3 -c "import os, nvidia.cudnn as c; print(os.path.join(list(c.__path__)[0], 'lib'))" 2>/dev/null)
  [[ -n $cudnn_dir ]] && export LD_LIBRARY_PATH=$cudnn_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>&1 |
    grep -v WARN
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[[ $mode != cpu-dry ]] && nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader | tee -a "$LOG"
PYTHON=${PYTHON:-python3}
"$PYTHON" -c "import torch, sys; print('torch', torch.__version__, 'python', sys.version.split()[0])" | tee -a "$LOG"
"$PYTHON" -c "import transformers; print('transformers', transformers.__version__)" 2>&1 | tail -n 1 | tee -a "$LOG"
"$PYTHON" -c "import cudnn; print('cudnn frontend', cudnn.__version__)" 2>&1 | tail -n 1 | tee -a "$LOG"

attn=(--check --kernels --out "$OUT")
hf=(--kernels --out "$OUT")
host=(--out "$OUT")
if [[ -n $quick ]]; then
  attn+=(--seqlens 16384 65536 --kv-heads 8 --packs longtail16)
  hf+=(--kv-heads 4 --tokens 16384)
  host+=(--docs 4096)
fi
case $mode in
  one)
    step attention 240 python3 benchmarks/bench_attention.py "${attn[@]}" "$@"
    step blocks 120 python3 benchmarks/bench_attention.py --blocks --no-rows --kernels --json attention_blocks.json \
      --out "$OUT" $([[ -n $quick ]] && echo --kv-heads 8 --blocks-seqlens 16384)
    step hf 120 python3 benchmarks/bench_hf.py "${hf[@]}"
    step host 75 python3 benchmarks/bench_host.py "${host[@]}" --tag gpu
    ;;
  two)
    base=()
    for p in shared/tools/torch_cp_baseline.py ../shared/tools/torch_cp_baseline.py .device-in/torch_cp_baseline.py; do
      [[ -f $p ]] && base=(--baseline "$p") && break
    done
    step gpu_tests 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/attention/test_gpu.py
    step attention_cp2 240 torchrun --nproc_per_node=2 benchmarks/bench_attention.py "${attn[@]}" "${base[@]}" \
      --json attention_bench_cp2.json "$@"
    step hf_cp2 120 torchrun --nproc_per_node=2 benchmarks/bench_hf.py "${hf[@]}" --json hf_bench_cp2.json
    step host_cp2 75 torchrun --nproc_per_node=2 benchmarks/bench_host.py "${host[@]}" --tag gpu_cp2
    ;;
  cpu-dry)  # crash test of this script's steps on a CPU machine (tiny shapes; numbers meaningless)
    PY=${PYTHON:-python3}
    step attention 300 "$PY" benchmarks/bench_attention.py --device cpu --dry-run --check --kernels --out "$OUT"
    step blocks 120 "$PY" benchmarks/bench_attention.py --device cpu --dry-run --blocks --no-rows --kernels \
      --json attention_blocks.json --out "$OUT"
    step hf 150 "$PY" benchmarks/bench_hf.py --device cpu --dry-run --out "$OUT"
    step host 90 "$PY" benchmarks/bench_host.py --device cpu --dry-run --out "$OUT" --tag cpu_dry
    step attention_cp2 300 "$PY" -m torch.distributed.run --nproc_per_node=2 benchmarks/bench_attention.py \
      --device cpu --dry-run --check --out "$OUT" --json attention_bench_cp2.json
    step hf_cp2 150 "$PY" -m torch.distributed.run --nproc_per_node=2 benchmarks/bench_hf.py --device cpu --dry-run \
      --out "$OUT" --json hf_bench_cp2.json
    step host_cp2 90 "$PY" -m torch.distributed.run --nproc_per_node=2 benchmarks/bench_host.py --device cpu \
      --dry-run --out "$OUT" --tag cpu_dry_cp2
    ;;
  *) echo "unknown mode '$mode' (one | two | cpu-dry)"; exit 2 ;;
esac
ls -la "$OUT" | tee -a "$LOG"
