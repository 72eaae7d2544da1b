#!/usr/bin/env bash
# Idempotent set-up of a virtual environment in .venv (CPSCOPE_VENV) for the tests, the demo and the benchmarks.
#
# Two paths:
#   * CPU (the default; CI): a fresh venv with the CPU build of torch 2.13.0 (pinned: an unpinned torch pulls a
#     multi-GB CUDA build), cpscope in editable mode with the test / HF / example extras, the hf-train extra when
#     pyproject.toml defines it, and, as an optional test dependency, megatron-core 0.19.2
#     (tests/integrations/test_megatron_core.py; skipped when it is not importable). CPSCOPE_NO_MEGATRON=1 skips it.
#   * System torch: when the Python that runs this ($PYTHON, default python3) already has a CUDA build of torch
#     (`torch.version.cuda` is not None), or CPSCOPE_SYSTEM_TORCH=1, the venv sees that Python's packages
#     (--system-site-packages) and torch is never installed; cpscope and what is missing of its extras are added,
#     and the optional GPU extras that can be installed: nvidia-cudnn-frontend (cuDNN packed blocks) and the triton
#     that this torch asks for, each from the wheel folder CPSCOPE_WHEELS and/or the package index when it is
#     reachable. What cannot be installed is skipped with a log line. Then `bash scripts/test.sh` runs the GPU
#     tests too. CPSCOPE_SYSTEM_TORCH=0 forces the CPU path.
# When the index is unreachable, cpscope is installed without build isolation (the machine's setuptools >= 77 builds
# it; without one the checkout goes on the path through a .pth file), so pip never tries to fetch a build backend.
# A finished set-up leaves $VENV/.cpscope-setup; it runs again when pyproject.toml is newer (delete the file to
# force).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${CPSCOPE_VENV:-.venv}
log() { echo "cpscope setup: $*"; }

system_torch=
case ${CPSCOPE_SYSTEM_TORCH:-auto} in
  1 | yes | true) system_torch=1 ;;
  0 | no | false) ;;
  auto | "")
    cuda=$("$PY" -c 'import torch; print(torch.version.cuda)' 2>/dev/null || true)
    [[ -n $cuda && $cuda != None ]] && system_torch=1 ;;
  *) echo "cpscope setup: CPSCOPE_SYSTEM_TORCH must be 1, 0 or auto, got '$CPSCOPE_SYSTEM_TORCH'" >&2; exit 2 ;;
esac

# A venv made for the other path cannot serve this one (it sees, or hides, the system packages): make it anew.
if [[ -f $VENV/pyvenv.cfg ]]; then
  sees_system=$(grep -qiE '^include-system-site-packages *= *true' "$VENV/pyvenv.cfg" && echo 1 || true)
  if [[ $sees_system != "$system_torch" ]]; then
    if [[ ! -f $VENV/.cpscope-setup ]]; then
      echo "cpscope setup: $VENV was not made by this script for this path; remove it or set CPSCOPE_VENV" >&2
      exit 2
    fi
    log "making $VENV anew (system torch: ${system_torch:-no})"
    rm -rf "$VENV"
  fi
fi

stamp=$VENV/.cpscope-setup
# pip warns about every local index folder a package is missing from; keep real errors, drop that noise.
quiet_pip() { "$VENV/bin/python" -m pip install -q "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
has_extra() { sed -n '/^\[project.optional-dependencies\]/,/^\[/p' pyproject.toml | grep -qE "^$1 *="; }

setup_cpu() {
  if [[ ! -x $VENV/bin/python ]]; then
    "$PY" -m venv "$VENV"
  fi
  echo "cpscope: setting up $VENV (torch 2.13.0 CPU build, cpscope editable, test + HF extras, megatron-core 0.19.2)..."
  quiet_pip "torch==2.13.0"
  quiet_pip -e ".[test,hf,examples]"
  if has_extra hf-train; then
    quiet_pip -e ".[hf-train]"
  fi
  if [[ -z ${CPSCOPE_NO_MEGATRON:-} ]]; then
    # 0.19.2 declares Python >= 3.12; its cp311 wheel works on 3.11. --no-deps: its runtime deps are the
    # megatron-test extra (numpy, packaging, triton); nothing else of its dependency tree is needed.
    quiet_pip -e ".[megatron-test]"
    quiet_pip --no-deps --ignore-requires-python "megatron-core==0.19.2"
  fi
}

# ---- system torch -------------------------------------------------------------------------------------------
pip_src=()  # where packages may come from: the wheel folder, and the index only when it answers

index_reachable() {
  "$VENV/bin/python" - <<'EOF'
import os, subprocess, sys, urllib.request
url = os.environ.get("PIP_INDEX_URL")
if not url:
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.strip().endswith(".index-url"):
            url = value.strip().strip("'\"")
            break
url = url or "https://pypi.org/simple"
if url.startswith("file://"):
    sys.exit(0 if os.path.isdir(url[len("file://"):]) else 1)
try:
    urllib.request.urlopen(url.rstrip("/") + "/pip/", timeout=5)
except Exception:
    sys.exit(1)
EOF
}

try_pip() {  # try_pip WHAT PIP-ARGS...: install, or log that WHAT was skipped
  local what=$1; shift
  if quiet_pip ${pip_src[@]+"${pip_src[@]}"} "$@"; then
    log "installed $what"
  else
    log "skipped $what (not installable from ${CPSCOPE_WHEELS:-the index}${offline:+, index unreachable})"
    return 1
  fi
}

importable() { "$VENV/bin/python" -c "import $1" >/dev/null 2>&1; }

add_path() {  # add_path NAME DIR...: a .pth file in the venv's site-packages
  local site; site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  printf '%s\n' "${@:2}" > "$site/$1.pth"
}

setup_system() {
  if [[ ! -x $VENV/bin/python ]]; then
    # --without-pip when this Python lacks ensurepip: the system pip, seen through the system site-packages, works.
    "$PY" -m venv --system-site-packages "$VENV" 2>/dev/null || "$PY" -m venv --system-site-packages --without-pip "$VENV"
  fi
  local cuda
  cuda=$("$PY" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda)' 2>/dev/null) || {
    echo "cpscope setup: CPSCOPE_SYSTEM_TORCH=1 but $PY cannot import torch" >&2; exit 2; }
  if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    # $PY is itself a venv: --system-site-packages sees its base interpreter, not its packages. Point at them.
    mapfile -t site_dirs < <("$PY" -c "import site, sysconfig; p = sysconfig.get_paths(); print('\n'.join(dict.fromkeys(
        [p['purelib'], p['platlib']] + site.getsitepackages())))")
    add_path cpscope-system-torch "${site_dirs[@]}"
    "$VENV/bin/python" -c "import torch" || { echo "cpscope setup: $VENV does not see $PY's torch" >&2; exit 2; }
  fi
  echo "cpscope: setting up $VENV on this machine's torch ($cuda), cpscope editable, what is missing of the extras..."
  if [[ -n ${CPSCOPE_WHEELS:-} ]]; then
    if [[ -d $CPSCOPE_WHEELS ]]; then pip_src+=(--find-links "$CPSCOPE_WHEELS"); else log "CPSCOPE_WHEELS=$CPSCOPE_WHEELS is not a folder"; fi
  fi
  offline=
  if ! index_reachable; then
    offline=1
    pip_src+=(--no-index)
    log "package index unreachable: local wheels only"
  fi
  # Offline, pip cannot fetch the build backend for an isolated build: build with this machine's setuptools, or,
  # without a recent one, put the checkout on the path (no build at all).
  local build=() editable=1
  if [[ -n $offline ]]; then
    if "$VENV/bin/python" -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" \
        >/dev/null 2>&1; then
      build=(--no-build-isolation)
    else
      editable=
      log "no setuptools >= 77 here and the index unreachable: cpscope is not built"
    fi
  fi
  # cpscope itself; torch>=2.11 is satisfied by the system torch, so pip leaves it alone.
  if [[ -z $editable ]] ||
      ! try_pip "cpscope (editable) with its test, HF and example extras" ${build[@]+"${build[@]}"} -e ".[test,hf,examples]"; then
    if [[ -z $editable ]] ||
        ! try_pip "cpscope (editable), without its extras" ${build[@]+"${build[@]}"} --no-deps -e .; then
      add_path cpscope-checkout "$PWD"; log "cpscope from this checkout through a .pth file"
    fi
    for m in pytest hypothesis numpy tqdm transformers; do
      importable "$m" || try_pip "$m" "$m" || true
    done
  fi
  if [[ -n $editable ]] && has_extra hf-train; then
    try_pip "the hf-train extra" ${build[@]+"${build[@]}"} -e ".[hf-train]" || true
  fi
  # --no-deps: cpscope uses its graph API only; its CUTLASS DSL dependency (for other kernels) is often not there.
  importable cudnn || try_pip "nvidia-cudnn-frontend" --no-deps "nvidia-cudnn-frontend>=1.14" || true
  if ! importable triton; then
    # only the triton this torch build asks for: another version breaks its compiled kernels
    local want
    want=$("$VENV/bin/python" -c "import importlib.metadata as m, re
print(next((re.split(';', r)[0].replace(' ', '') for r in (m.requires('torch') or []) if r.startswith('triton')), ''))")
    if [[ -n $want ]]; then try_pip "$want" "$want" || true; else log "skipped triton (this torch does not ask for one)"; fi
  fi
  if [[ -z ${CPSCOPE_NO_MEGATRON:-} ]] && ! importable megatron.core; then
    for m in numpy packaging; do importable "$m" || try_pip "$m" "$m" || true; done
    try_pip "megatron-core 0.19.2" --no-deps --ignore-requires-python "megatron-core==0.19.2" || true
  fi
  importable pytest || log "pytest is not importable: scripts/test.sh cannot run (put its wheel in CPSCOPE_WHEELS)"
}

if [[ ! -f $stamp || pyproject.toml -nt $stamp ]]; then
  set -o pipefail
  if [[ -n $system_torch ]]; then setup_system; else setup_cpu; fi
  touch "$stamp"
fi
