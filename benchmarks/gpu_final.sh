#!/usr/bin/env bash
# The GPU session in one call, on 2×H200 (device tool), after TransformerEngine's five parts were copied to /root/te
# (see ../shared/tools/te-gpu/README.md): installs TE if needed, runs every GPU test (attention parity, RoPE incl.
# TE's fused path, autograd threads, the TE DotProductAttention wrapper) and the attention benchmark with PyTorch's
# context_parallel and TE CP2 p2p beside cpscope in the same run. Results land under $OUT.
#   bash benchmarks/gpu_final.sh            # tests + benchmark
#   bash benchmarks/gpu_final.sh te         # only the tests that need TE, then the benchmark
#   bash benchmarks/gpu_final.sh bench      # benchmark only
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/cpscope-gpu-out}; mkdir -p "$OUT"
if [[ -f /root/te/core-name && ! -d /root/te/site/transformer_engine/pytorch ]]; then
  (time bash /root/te/device-setup.sh) 2>&1 | tail -n 5
fi
[[ -d /root/te/site ]] && export PYTHONPATH=/root/te/site
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
case ${1:-all} in
  all) timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -n 25 ;;
  te) timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/integrations/test_te_gpu.py tests/test_rope.py \
        2>&1 | tee "$OUT/gpu_tests.log" | tail -n 25 ;;
esac
timeout 300 torchrun --nproc_per_node=2 benchmarks/bench_attention.py --baseline .device-in/torch_cp_baseline.py \
  --check --out "$OUT" 2>&1 | tee "$OUT/bench_attention.log" | grep -v Warning | tail -n 30
