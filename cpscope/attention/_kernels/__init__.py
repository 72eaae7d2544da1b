"""The block kernels: the only kernel entry of the attention algorithms (ring, halo, all-gather, Ulysses,
hierarchical).

:func:`block_forward` / :func:`block_backward` run one block (:mod:`.block` says what a block is) on the kernel that
one router chooses (:mod:`.router`: a decision table per kind of block → cuDNN / flash / flex / exact, refusals
remembered), steered by one :class:`KernelPolicy` (:mod:`.._policy`). The kernels: the exact tiled math (:mod:`.exact`),
PyTorch's own (:mod:`.aten`), FlexAttention's compiled kernels (:mod:`.flex`: block masks and the softcap as a score
modifier; :func:`run_whole` runs a one-block call through its own autograd), and cuDNN frontend graphs (:mod:`.cudnn_frontend`: the machinery both graph families
share; :mod:`.cudnn_thd` packed, :mod:`.cudnn_dense` dense; :mod:`.cudnn_mods` the band and softcap as cuDNN takes
them).

Example::

    from cpscope.attention._kernels import block_backward, block_forward, routing_table
    out, lse = block_forward(q, k, v, scale=d ** -0.5, causal=True)            # dense, CPU or CUDA
    dq, dk, dv = block_backward(dout, q, k, v, out, lse, scale=d ** -0.5, causal=True)
    routing_table()        # {'dense': ('cudnn', 'aten cuDNN attention'), ..., 'packed-softcap': ('exact', ...)}
"""
from .block import Placeholders, Varlen, Window, acc_dtype
from .._policy import KernelPolicy, kernel_policy, set_kernel_policy, use_kernel_policy
from .router import block_backward, block_forward, choose, fallbacks, routing_table, run_whole

__all__ = ["block_forward", "block_backward", "acc_dtype", "Varlen", "Window", "Placeholders", "choose",
           "fallbacks", "run_whole", "routing_table", "KernelPolicy", "kernel_policy", "set_kernel_policy",
           "use_kernel_policy"]
