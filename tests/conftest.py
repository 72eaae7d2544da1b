import os
import random

import pytest

from tests.distributed import shutdown_pools


@pytest.fixture(scope="session", autouse=True)
def _rank_pools():
    yield
    shutdown_pools()


@pytest.fixture(autouse=True)
def _backward_read_check_back_on():
    yield
    from cpscope import backward_check

    backward_check.set_backward_read_check(True)  # the default; a test that opted out must not leak it
    assert backward_check.backward_read_check_enabled(), "a test left an allow_scope_reads_in_backward() active"


def pytest_collection_modifyitems(config, items):
    if os.environ.get("CPSCOPE_REACHES_OPTIONAL", "") not in ("", "0"):  # only the tests that can change without
        from tests._core_only import reaches_optional                     # the optional packages (fast CI pass)

        kept = [item for item in items if reaches_optional(item)]
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept
    seed = os.environ.get("CPSCOPE_TEST_SHUFFLE")
    if seed:  # run the tests in a random order (the suite must not depend on it): the seed makes it reproducible
        random.Random(int(seed)).shuffle(items)
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:  # pragma: no cover
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_report_header(config):
    lines = []
    if os.environ.get("CPSCOPE_TEST_SHUFFLE"):
        lines.append(f"cpscope: tests in a random order, CPSCOPE_TEST_SHUFFLE={os.environ['CPSCOPE_TEST_SHUFFLE']}")
    if os.environ.get("CPSCOPE_CORE_ONLY", "") not in ("", "0"):
        lines.append("cpscope: core only (optional packages hidden: tests/_core_only.py)")
    return lines
