"""Which megatron-core releases :func:`~cpscope.integrations.megatron.enable_runtime_cp` supports.

The adapter relies on megatron-core internals (the signatures of ``GPTModel.forward``, ``Attention.forward`` and
``TEDotProductAttention.forward``, the ``pg_collection.cp`` the attention hands to RoPE, ``RotaryEmbedding``'s
table layout), so it names the releases it was checked against and refuses the others instead of guessing.

Example::

    from cpscope.integrations.megatron import SUPPORTED_MEGATRON_CORE, megatron_core_version
    assert megatron_core_version() in SUPPORTED_MEGATRON_CORE      # RuntimeError from enable_runtime_cp otherwise
"""
from __future__ import annotations

__all__ = ["SUPPORTED_MEGATRON_CORE", "megatron_core_version", "check_megatron_core"]

#: megatron-core releases whose sources this adapter was written and tested against (``tests/integrations/
#: test_megatron_core.py`` runs the real package). 0.19.2 still passes the static ``pg_collection.cp`` to RoPE
#: (Megatron-LM PR #6821 is not in it) and creates ``TEDotProductAttention``'s CP stream only for static CP > 1.
SUPPORTED_MEGATRON_CORE: tuple[str, ...] = ("0.19.2",)


def megatron_core_version() -> str:
    """The installed megatron-core release, e.g. ``"0.19.2"`` (without the ``+<git hash>`` local suffix that
    ``megatron.core.__version__`` gains when the package sits inside a git checkout).

    Raises:
        ImportError: megatron-core is not importable.

    Example:

        >>> from cpscope.integrations.megatron import megatron_core_version
        >>> megatron_core_version()   # doctest: +SKIP
        '0.19.2'
    """
    from megatron.core import package_info

    major, minor, patch, pre = package_info.VERSION
    return f"{major}.{minor}.{patch}{pre}"


def check_megatron_core() -> str:
    """Return the installed megatron-core version; raise if it is not one of :data:`SUPPORTED_MEGATRON_CORE`.

    Raises:
        ImportError: megatron-core is not importable (it is an optional dependency of cpscope).
        RuntimeError: another release is installed.
    """
    try:
        version = megatron_core_version()
    except ImportError as e:
        raise ImportError(
            "cpscope.integrations.megatron.enable_runtime_cp needs megatron-core "
            f"({' or '.join(SUPPORTED_MEGATRON_CORE)}); it is not importable: {e}"
        ) from e
    if version not in SUPPORTED_MEGATRON_CORE:
        raise RuntimeError(
            f"cpscope's Megatron adapter supports megatron-core {', '.join(SUPPORTED_MEGATRON_CORE)}; found {version}. "
            "It patches the CP consumers of those releases only (their attention, RoPE and TE attention "
            "internals); install megatron-core==" + SUPPORTED_MEGATRON_CORE[-1]
        )
    return version
