import sys

import pytest
import torch

import bpclip_fast

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def pytest_configure(config):
    # make_private's one-time dynamo setting on a torch before 2.14 warns once per process
    # (compiled.require_parameter_guards, tested on its own in test_compile.py): made here, so that a
    # test asserting make_private's own warnings sees only those, whatever runs first in a worker.
    import warnings

    from bpclip_fast import compiled

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled.require_parameter_guards()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(scope="module")
def one_thread():
    """For modules of tiny problems: intra-op threads only add overhead (10-40x on a busy 2-core box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_report_header(config):
    info = bpclip_fast.build_info()
    return (f"bpclip_fast: cuda_compiled={info['cuda_compiled']} archs={info['cuda_archs']} "
            f"cuda_available={info['cuda_available']} torch={info['torch_version']}")


def pytest_terminal_summary(terminalreporter):
    harness = sys.modules.get("harness")  # tests/emulator/harness.py, if the emulator tests ran
    if harness is not None and harness.SESSION:
        terminalreporter.write_line(harness.summary(harness.SESSION[0]))
