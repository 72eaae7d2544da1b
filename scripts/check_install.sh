#!/usr/bin/env bash
# CI: prove the install a user makes. Builds the sdist and, from it, the wheel; checks what they carry (LICENSE in
# both, no tests in the sdist); installs the wheel with its declared dependencies only into a fresh venv that holds
# torch==2.13.0 (the CPU build, from the machine's wheels); from outside the checkout, imports every public module
# (an optional adapter whose package is absent must raise an ImportError naming its extra), runs a CP1 attention and
# RoPE, the command line (`python -m cpscope --help`, `env`, `plan --help`) and the README quick start as written:
# the code block under `<!-- quickstart: examples/quickstart.py -->` in README.md must equal that file, and it runs
# with `torchrun --nproc-per-node 2` on gloo.
#
#   bash scripts/check_install.sh          # $PYTHON (default python3) makes the venvs; CPSCOPE_CHECK_DIR keeps them
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
W=${CPSCOPE_CHECK_DIR:-$(mktemp -d -t cpscope-install-XXXXXX)}
[[ -n ${CPSCOPE_CHECK_DIR:-} ]] || trap 'rm -rf "$W"' EXIT
log() { echo "check_install: $*"; }
fail() { echo "check_install: FAILED: $*" >&2; exit 1; }
# pip warns about every local index folder a package is missing from; keep real errors, drop that noise.
pipq() { "$1/bin/python" -m pip install -q "${@:2}" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
start=$SECONDS

# ---- build: the sdist from the checkout, the wheel from the sdist (so the sdist is complete) ---------------------
rm -rf "$W/build" "$W/dist" "$W/venv"
"$PY" -m venv "$W/build"
pipq "$W/build" "setuptools>=77"
mkdir -p "$W/dist"
sdist=$(cd "$ROOT" && "$W/build/bin/python" -c \
  "import sys; from setuptools import build_meta as b; print(b.build_sdist(sys.argv[1]))" "$W/dist" | tail -n 1)
rm -rf "$ROOT/cpscope.egg-info"
"$W/build/bin/python" -m pip wheel -q --no-deps --no-build-isolation -w "$W/dist" "$W/dist/$sdist" >/dev/null
wheel=$(cd "$W/dist" && ls cpscope-*.whl)
log "built $sdist and $wheel ($((SECONDS - start)) s)"

"$W/build/bin/python" - "$W/dist/$sdist" "$W/dist/$wheel" "$ROOT/LICENSE" <<'EOF'
import sys, tarfile, zipfile
sdist, wheel, license_path = sys.argv[1:]
text = open(license_path, "rb").read()
assert b"Apache License" in text and b"Version 2.0, January 2004" in text, "LICENSE is not the Apache-2.0 text"
with tarfile.open(sdist) as t:
    names = t.getnames()
    root = names[0].split("/")[0]
    lic = [n for n in names if n == f"{root}/LICENSE"]
    assert lic and t.extractfile(lic[0]).read() == text, f"sdist: no LICENSE (or another text) in {sdist}"
    tests = [n for n in names if "/tests/" in n or n.endswith("conftest.py")]
    assert not tests, f"sdist carries tests: {tests[:5]}"
    for want in ("README.md", "CHANGELOG.md", "pyproject.toml", "cpscope/__init__.py"):
        assert f"{root}/{want}" in names, f"sdist lacks {want}"
with zipfile.ZipFile(wheel) as z:
    names = z.namelist()
    lic = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    assert lic and z.read(lic[0]) == text, f"wheel: no LICENSE in {wheel}"
    meta = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in meta, "wheel METADATA: no License-Expression"
    assert not [n for n in names if n.startswith(("tests/", "examples/", "benchmarks/", "scripts/"))], names
    assert "cpscope/py.typed" in names
print(f"check_install: LICENSE in sdist and wheel, no tests in the sdist ({len(names)} files in the wheel)")
EOF

# ---- a fresh venv: torch (pinned CPU build from local disk), then the wheel with its declared dependencies ------
"$PY" -m venv "$W/venv"
V=$W/venv/bin/python
pipq "$W/venv" "torch==2.13.0"
pipq "$W/venv" "$W/dist/$wheel"
"$V" -m pip check >/dev/null || fail "pip check: $("$V" -m pip check)"
log "installed torch 2.13.0 and the wheel ($((SECONDS - start)) s)"

cd "$W"  # never the checkout's cpscope from here on
"$V" - <<'EOF'
import importlib, os, pkgutil, re
import torch
import cpscope

assert "site-packages" in cpscope.__file__, f"not the installed cpscope: {cpscope.__file__}"
# The optional adapters: a module that needs an absent package raises an ImportError that names the extra.
EXTRAS = {"transformers": "hf", "trl": "hf-train", "transformer_engine": "te", "megatron": "megatron",
          "fla": "linear", "cudnn": "cudnn"}
public = ["cpscope"] + sorted(
    m.name for m in pkgutil.walk_packages(cpscope.__path__, "cpscope.", onerror=lambda name: None)
    if not any(p.startswith("_") for p in m.name.split(".")[1:]))
imported, refused = [], []
for name in public:
    try:
        importlib.import_module(name)
        imported.append(name)
    except ImportError as e:
        missing = (e.name or "").split(".")[0]
        if isinstance(e.__cause__, ImportError):
            missing = (e.__cause__.name or "").split(".")[0]
        extra = EXTRAS.get(missing)
        if extra is None:
            raise AssertionError(f"{name}: {e!r} (a declared dependency is missing?)") from e
        if f"cpscope[{extra}]" not in str(e):
            raise AssertionError(f"{name}: the ImportError does not name the extra cpscope[{extra}]: {e}") from e
        refused.append(f"{name} ({missing}: cpscope[{extra}])")
print(f"check_install: imported {len(imported)} public modules; refused with the extra named: {refused}")

# CP1 attention and RoPE (no process group) against a plain reference.
torch.manual_seed(0)
q, k, v = (torch.randn(2, 64, 4, 16, dtype=torch.float64) for _ in range(3))
freqs = cpscope.rotary_freqs(16, 64, device="cpu").double()
qr = cpscope.apply_rotary_pos_emb(q, freqs, qkv_format="bshd")
ang = freqs[:64, 0, 0]  # [s, d]
rot = torch.cat([-q[..., 8:], q[..., :8]], dim=-1)
ref_rope = q * ang.cos()[None, :, None] + rot * ang.sin()[None, :, None]
assert torch.allclose(qr, ref_rope, atol=1e-12), "RoPE"
out = cpscope.context_parallel_attention(qr, k, v, qkv_format="bshd", causal=True)
ref = torch.nn.functional.scaled_dot_product_attention(
    qr.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
assert torch.allclose(out, ref, atol=1e-10), "attention"
print(f"check_install: CP1 attention and RoPE equal the reference (cpscope {cpscope.__version__})")
EOF

"$V" -m cpscope --help
"$V" -m cpscope env
"$V" -m cpscope plan --help
log "command line answered"

# ---- the README quick start, as written --------------------------------------------------------------------------
"$V" - "$ROOT/README.md" "$ROOT/examples/quickstart.py" "$W/quickstart.py" <<'EOF'
import re, sys
readme, example, out = sys.argv[1:]
text = open(readme, encoding="utf-8").read()
m = re.search(r"<!-- quickstart: examples/quickstart.py -->\s*```python\n(.*?)```", text, re.S)
assert m, "README.md: no ```python block under <!-- quickstart: examples/quickstart.py -->"
code = m.group(1)
assert code == open(example, encoding="utf-8").read(), "README's quick start differs from examples/quickstart.py"
open(out, "w", encoding="utf-8").write(code)
EOF
if ! OMP_NUM_THREADS=1 timeout 300 "$W/venv/bin/torchrun" --nproc-per-node 2 "$W/quickstart.py" >"$W/quickstart.log" 2>&1
then
  cat "$W/quickstart.log" >&2
  fail "the README quick start"
fi
grep "^rank" "$W/quickstart.log" || true
log "README quick start ran as written; all checks passed in $((SECONDS - start)) s"
