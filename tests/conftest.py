"""Shared pytest setup for the fbn_grad_tf suite.

* Quiets TensorFlow's C++ logging before anything imports TF.
* Makes tests/helpers.py importable as ``helpers`` (pytest's default "prepend" import mode
  already puts this directory on sys.path; the insert below keeps that true under
  ``--import-mode=importlib``).
* Fixtures for the CPU instruction-set paths of the core.
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import pytest  # noqa: E402

from fbn_grad_tf import core  # noqa: E402

ALL_ISAS = core.CPU_ISAS


def supported_isas():
    return [isa for isa in ALL_ISAS if core.cpu_supports(isa)]


@pytest.fixture(params=ALL_ISAS)
def isa(request):
    """Each CPU path of the core; skipped where this CPU lacks it."""
    from fbn_grad_tf import core
    if not core.cpu_supports(request.param):
        pytest.skip("CPU does not support the %s path" % request.param)
    return request.param



def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Prints the largest errors measured against TF and the float64 reference."""
    if config.getoption("verbose") <= 0 and not os.environ.get("FBN_TEST_REPORT_ERRORS"):
        return
    helpers = sys.modules.get("helpers")
    log = getattr(helpers, "ERROR_LOG", None)
    if not log:
        return
    tr = terminalreporter
    tr.section("fbn_grad_tf: largest measured errors")
    tr.write_line("(x_backprop: |diff| / max|x_backprop|; scale/offset_backprop: |diff| / "
                  "per-channel sum of |terms|)")
    for key in sorted(log):
        tr.write_line("  %-7s %-9s %-16s %.3g" % (key + (log[key],)))
