"""CP groups: the registry of pre-built groups and how they are planned and created.

* :mod:`~cpscope.groups._registry` — :func:`new_cp_groups`, :func:`hierarchical_cp_groups`, :func:`group_ranks`,
  :func:`clear_cp_group_cache`: every group a job needs, created collectively once, up front, and cached;
  :func:`lookup_hierarchical`: the cached pair or ``None``, never a collective (for consumers inside a forward).
* :mod:`~cpscope.groups._tp_cp` — :func:`new_tp_cp_groups`: with tensor parallelism, per CP size the CP group (one
  TP rank), the ``[tp, cp]`` group and the ``[tp, dp, cp]`` domain, created up front; :func:`lookup_tp_cp` in a forward.
* :mod:`~cpscope.groups._rank_blocks` — the pure block plan (which ranks form a group of each size).
* :mod:`~cpscope.groups._create` — creating one rank's own blocks through ``torch.distributed``.

Example::

    groups = cpscope.new_cp_groups([1, 2, 4])            # {1: None, 2: <pg>, 4: <pg>}
    inner, outer = cpscope.hierarchical_cp_groups(groups[4], 2)   # up front, on the 4 members
    cpscope.groups.lookup_hierarchical(groups[4], 2)               # later, in a forward: (inner, outer), no collective
    tp = cpscope.groups.new_tp_cp_groups([1, 2], tp_size=2)        # 4 ranks, TP2: tp[2].cp, tp[2].tp_cp, tp[2].tp_dp_cp
"""
from ._registry import clear_cp_group_cache, group_ranks, hierarchical_cp_groups, lookup_hierarchical, new_cp_groups
from ._tp_cp import TPCPGroups, lookup_tp_cp, new_tp_cp_groups

__all__ = ["new_cp_groups", "hierarchical_cp_groups", "lookup_hierarchical", "group_ranks", "clear_cp_group_cache",
           "new_tp_cp_groups", "lookup_tp_cp", "TPCPGroups"]
