"""Nothing optional is imported by the core: ``import cpscope`` and a CPU workload work with TransformerEngine,
transformers, TRL and megatron-core made unimportable, and never even try to import them.

Each check runs in a fresh interpreter whose ``sys.meta_path`` starts with a blocker: importing one of the optional
packages raises ``ModuleNotFoundError`` and is recorded, so a guarded ``try: import ...`` in the core shows up too.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

BLOCKER = textwrap.dedent(
    """
    import sys
    BLOCKED = ("transformer_engine", "transformers", "trl", "megatron")
    tried = []

    class Blocker:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                tried.append(name)
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
            return None

    sys.meta_path.insert(0, Blocker())
    """
)


def _run(body: str) -> None:
    code = BLOCKER + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_import_cpscope_and_a_cpu_workload_import_no_optional_package():
    _run(
        """
        import torch
        import cpscope
        import cpscope.integrations, cpscope.integrations.te, cpscope.integrations.megatron  # lazy by contract

        x = torch.randn(1, 8, 2, 4)
        freqs = cpscope.rotary_freqs(4, 8)
        y = cpscope.apply_rotary_pos_emb(x, freqs, qkv_format="bshd")
        out = cpscope.context_parallel_attention(y, y, y, qkv_format="bshd", causal=True)
        t = cpscope.apply_rotary_pos_emb(x[0], freqs, qkv_format="thd", cu_seqlens=[0, 4, 8])
        assert out.shape == x.shape and t.shape == x[0].shape
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
        assert not tried and not loaded, (tried, loaded)

        # The blocker works, and the adapter that needs transformers says so.
        try:
            import cpscope.integrations.hf
        except ImportError as e:
            assert "transformers" in str(e), e
        else:
            raise AssertionError("cpscope.integrations.hf imported without transformers")
        assert tried and all(m.split(".")[0] == "transformers" for m in tried), tried
        """
    )
