#!/usr/bin/env bash
# Session 3's one-GPU checks in one device call (after TE's five parts were copied to /root/te, see
# ../shared/tools/te-gpu/README.md; without them the TE tests skip). Carry .whl (nvidia-cudnn-frontend,
# megatron-core 0.19.2 cp312). Results under $OUT.
#   bash benchmarks/gpu_session3.sh tests     # every GPU test that runs on one GPU + FSDP2 smoke + variant kernels
#   bash benchmarks/gpu_session3.sh bench     # issue #14's measurements (benchmarks/gpu_issue14.sh one)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/cpscope-gpu-out}; mkdir -p "$OUT"
mode=${1:-tests}
if [[ -f /root/te/core-name && ! -d /root/te/site/transformer_engine/pytorch ]]; then
  (time bash /root/te/device-setup.sh) 2>&1 | tail -n 5
fi
extra=
if [[ -d /root/te/site ]]; then
  extra=/root/te/site
  cudnn_dir=$(python3 -c "import os, nvidia.cudnn as c; print(os.path.join(list(c.__path__)[0], 'lib'))" 2>/dev/null)
  [[ -n $cudnn_dir ]] && export LD_LIBRARY_PATH=$cudnn_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
if ls .whl/*.whl >/dev/null 2>&1 && [[ ! -d /tmp/site/cudnn ]]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>&1 | grep -v WARN
fi
export PYTHONPATH=$PWD:/tmp/site${extra:+:$extra}
case $mode in
  tests)
    timeout 330 python3 -m pytest -q -m gpu -p no:cacheprovider tests/attention/test_gpu.py tests/test_rope.py \
      tests/test_autograd.py tests/attention/test_variants_gpu.py tests/integrations/test_te_gpu.py \
      tests/integrations/test_megatron_core_gpu.py tests/test_sentinel_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | grep -v -i warn | tail -n 30
    timeout 100 torchrun --nproc_per_node=1 benchmarks/bench_hybrid_fsdp.py --smoke --out "$OUT/hfsdp" 2>&1 |
      tee "$OUT/fsdp_smoke.log" | grep -v -i warn | tail -n 12
    timeout 100 python3 benchmarks/bench_variants.py --one-gpu --out "$OUT" 2>&1 | tee "$OUT/variants_one_gpu.log" |
      grep -v -i warn | tail -n 12
    ;;
  bench) bash benchmarks/gpu_issue14.sh one ;;
esac
ls "$OUT"
