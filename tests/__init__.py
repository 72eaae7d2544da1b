from tests import _core_only

if _core_only.enabled():  # CPSCOPE_CORE_ONLY=1: the optional packages are hidden (tests/_core_only.py)
    _core_only.install()
