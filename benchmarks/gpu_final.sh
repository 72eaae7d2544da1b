#!/usr/bin/env bash
# The GPU session in one call, on 2×H200 (device tool). Results land under $OUT.
# (Issue #8's session. Issue #14's GQA / transformers / host-time measurements: benchmarks/gpu_issue14.sh.)
#   bash benchmarks/gpu_final.sh            # every GPU test + the attention benchmark
#   bash benchmarks/gpu_final.sh te         # after TE's five parts were copied to /root/te (see
#                                           # ../shared/tools/te-gpu/README.md): install TE, the tests that need
#                                           # it, then the benchmark with TE CP2 p2p beside cpscope in the same run
#   bash benchmarks/gpu_final.sh bench      # benchmark only
#   bash benchmarks/gpu_final.sh measure    # attention GPU tests (incl. the cuDNN varlen route), the benchmark
#                                           # without TE plus the THD cuDNN experiment, and a profile of one step
# Extra arguments after the mode go to bench_attention.py.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/cpscope-gpu-out}; mkdir -p "$OUT"
mode=${1:-all}; shift || true
if [[ -f /root/te/core-name && ! -d /root/te/site/transformer_engine/pytorch ]]; then
  (time bash /root/te/device-setup.sh) 2>&1 | tail -n 5
fi
if [[ -d /root/te/site ]]; then
  export PYTHONPATH=/root/te/site
  # TE's core library pulls cuDNN sub-libraries by soname; the machine's system cuDNN (9.14 in
  # /usr/lib/x86_64-linux-gnu) then shadows torch's bundled 9.19 and torch refuses its cuDNN ("version
  # incompatibility") or, in older runs, silently fell back from cuDNN to flash SDPA for the baselines. Putting
  # torch's cuDNN folder first makes every library in the process use torch's cuDNN.
  cudnn_dir=$(python3 -c "import os, nvidia.cudnn as c; print(os.path.join(list(c.__path__)[0], 'lib'))" 2>/dev/null)
  [[ -n $cudnn_dir ]] && export LD_LIBRARY_PATH=$cudnn_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
# optional wheels carried in .whl/ (e.g. nvidia-cudnn-frontend for cuDNN packed blocks)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
LOG=$OUT/gpu.log
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader | tee -a "$LOG"
case $mode in
  all) timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 | tee -a "$LOG" | tail -n 25 ;;
  te) ;;  # the TE tests run after the benchmark (below), which matters most
  measure) timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider \
        tests/attention/test_gpu.py 2>&1 | tee -a "$LOG" | tail -n 12 ;;
esac
extra=("$@"); [[ $mode == measure ]] && extra+=(--no-te)
timeout 300 torchrun --nproc_per_node=2 benchmarks/bench_attention.py --baseline .device-in/torch_cp_baseline.py \
  --check --out "$OUT" "${extra[@]}" 2>&1 | grep -v Warning | tee -a "$LOG" | grep -v "^parity" | tail -n 30
if [[ $mode == te ]]; then
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/integrations/test_te_gpu.py tests/test_rope.py \
    2>&1 | tee "$OUT/gpu_tests_te.log" | tail -n 6
fi
if [[ $mode == measure ]]; then
  timeout 120 torchrun --nproc_per_node=2 benchmarks/profile_ring.py --cases bshd-16384 thd --show 150 \
    --out "$OUT" > "$OUT/profile.log" 2>&1; echo "profile rc=$?"
  grep -h "GPU span\|gaps\|by kernel\|host launch" "$OUT"/profile*.log | cut -c1-600
fi
