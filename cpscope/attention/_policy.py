"""One kernel policy: the process-wide choices that steer which kernels run, as one immutable value.

Defaults are what cpscope runs; tests and benchmarks change a field for a block of code with
:func:`use_kernel_policy` (or install a whole policy with :func:`set_kernel_policy`). Nothing reads an environment
variable, and the policy is read per block, never cached by a call: a change applies from the next block on (graphs
already built keep how they were built).

Example::

    with use_kernel_policy(varlen="flash"):        # packed blocks on flash-attention-2 for this benchmark row
        out = cpscope.context_parallel_attention(q, k, v, qkv_format="thd", cu_seqlens=cu)
    kernel_policy().dense_cudnn                     # True
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from dataclasses import dataclass
from typing import Any, Iterator

__all__ = ["KernelPolicy", "kernel_policy", "set_kernel_policy", "use_kernel_policy"]

_VARLEN = ("auto", "cudnn", "flash")
_FIXED_FORMS = ("ordered", "mapping")
_CONSTANTS = ("host", "runtime")
_FLEX = ("auto", "first", "off")


@dataclass(frozen=True)
class KernelPolicy:
    """Which kernels run.

    Attributes:
        dense_cudnn: dense blocks on cuDNN (aten's cuDNN attention, the frontend's graphs with a window or softcap)
            — else on flash-attention-2 (benchmarks compare the two).
        varlen: packed blocks on ``"cudnn"`` (the frontend's ragged graphs; raises where it is missing), ``"flash"``
            (aten's flash-attention-2 varlen kernels) or ``"auto"`` (cuDNN where available).
        dense_as_varlen: ``bshd`` / ``sbhd`` run as packed blocks (each batch row one document), so that CPU tests
            cover the packed route on dense inputs.
        triton_on_cpu: the Triton kernels (merges, RoPE) take CPU tensors too, for Triton's interpreter
            (``TRITON_INTERPRET=1``; tests only).
        bucket_batch: packed cuDNN graphs round the number of sequences up to a power of two (fewer distinct graphs
            over a stream of packs; results identical).
        ordered_execute: the frontend's ordered ``execute`` where it exists (host time; else the mapping form).
        fixed_form: how graphs with host scalars (a softcap's constants) execute: ``"ordered"`` or ``"mapping"``.
        cudnn_constants: a score modifier's constants as pass-by-value host tensors (``"host"``) or the frontend's
            runtime scalars (``"runtime"``).
        flex: FlexAttention's place in the router's table: ``"auto"`` (where its row lists it, on CUDA), ``"first"``
            (first in every row that lists it, on any device: the CPU runs its eager math — tests and benchmarks) or
            ``"off"``.
        defer_builds: a packed block whose cuDNN graph is not built and whose graph key was not seen before runs on
            the next route of its row for this call (flash-attention-2, where it takes the block's dtype; never
            FlexAttention nor the exact math) and its key is remembered; the second block with that key builds the
            graph and runs on cuDNN. Recurring pack shapes get cuDNN, one-off shapes never pay a build (tens of
            ms each). Forward and backward decide apart (their graphs differ); only under ``varlen="auto"``.
            **Off by default: its speed over a stream of new packs has not been measured on a GPU yet** (CPU
            tests prove the routing and the numbers; ``benchmarks/bench_pack_stream.py`` has the
            ``cpscope_defer`` row for the next GPU run). :mod:`cpscope.attention._kernels.deferral` keeps the
            keys seen.
    """

    dense_cudnn: bool = True
    varlen: str = "auto"
    dense_as_varlen: bool = False
    triton_on_cpu: bool = False
    bucket_batch: bool = True
    ordered_execute: bool = True
    fixed_form: str = "ordered"
    cudnn_constants: str = "host"
    flex: str = "auto"
    defer_builds: bool = False

    def __post_init__(self) -> None:
        for name, value, allowed in (("varlen", self.varlen, _VARLEN), ("fixed_form", self.fixed_form, _FIXED_FORMS),
                                     ("cudnn_constants", self.cudnn_constants, _CONSTANTS),
                                     ("flex", self.flex, _FLEX)):
            if value not in allowed:
                raise ValueError(f"KernelPolicy.{name} must be one of {allowed}, got {value!r}")


_lock = threading.Lock()
_policy = KernelPolicy()


def kernel_policy() -> KernelPolicy:
    """The policy in force."""
    return _policy


def set_kernel_policy(policy: KernelPolicy) -> KernelPolicy:
    """Install ``policy`` process-wide; returns the previous one."""
    global _policy
    if not isinstance(policy, KernelPolicy):
        raise ValueError(f"set_kernel_policy takes a KernelPolicy, got {type(policy).__name__}")
    with _lock:
        old, _policy = _policy, policy
    return old


@contextlib.contextmanager
def use_kernel_policy(**changes: Any) -> Iterator[KernelPolicy]:
    """The policy in force with ``changes`` (fields of :class:`KernelPolicy`) inside the block, restored after.

    Example::

        with use_kernel_policy(dense_cudnn=False):
            out, lse = block_forward(q, k, v, scale=0.125, causal=True)     # flash-attention-2
    """
    new = dataclasses.replace(_policy, **changes)
    old = set_kernel_policy(new)
    try:
        yield new
    finally:
        set_kernel_policy(old)
