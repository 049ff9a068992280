"""Kernel micro-benchmarks (pytest-benchmark):  pytest bench --benchmark-only [--bench-device cuda]
[--bench-sizes-mb 1,32,512,1024] [--bench-threads N]. At the end a table gives each kernel's GB/s next
to a plain copy of the same bytes measured in the same run and to the same computation composed of
torch ops."""

from __future__ import annotations

import pytest
import torch

RESULTS: list[dict] = []  # filled by bench/test_kernels.py


def pytest_addoption(parser):
    g = parser.getgroup("bpclip_fast kernel benchmarks")
    g.addoption("--bench-device", default="cpu", help="cpu or cuda (default cpu)")
    g.addoption("--bench-sizes-mb", default="1,32,512,1024",
                help="comma-separated data sizes in MB (fp32 elements x 4 bytes); default 1,32,512,1024")
    g.addoption("--bench-threads", type=int, default=None, help="torch.set_num_threads for the CPU runs")


def pytest_configure(config):
    threads = config.getoption("--bench-threads", default=None)
    if threads:
        torch.set_num_threads(threads)


def pytest_generate_tests(metafunc):
    if "size_mb" in metafunc.fixturenames:
        sizes = [int(s) for s in metafunc.config.getoption("--bench-sizes-mb").split(",") if s]
        metafunc.parametrize("size_mb", sizes, ids=[f"{s}MB" for s in sizes])


@pytest.fixture(scope="session")
def device(request):
    dev = request.config.getoption("--bench-device")
    if dev == "cuda" and not torch.cuda.is_available():
        pytest.skip("--bench-device cuda needs a GPU")
    return dev


def pytest_terminal_summary(terminalreporter):
    if not RESULTS:
        return
    w = terminalreporter.write_line
    w("")
    w("kernel bandwidth (GB/s = minimum bytes the op must move / median time; limit = a copy of the same bytes)")
    w(f"{'size':>7} {'kernel':34} {'median ms':>10} {'GB/s':>8} {'% of copy':>10} {'torch ops GB/s':>15}")
    by_key = {(r["size_mb"], r["name"]): r for r in RESULTS}
    for r in RESULTS:
        if r["name"].startswith("copy") or r["name"].startswith("torch:"):
            continue
        copy = by_key.get((r["size_mb"], r["limit"]))
        torch_ref = by_key.get((r["size_mb"], "torch: " + r["name"]))
        pct = f"{100 * r['gbps'] / copy['gbps']:9.0f}%" if copy else "-"
        tref = f"{torch_ref['gbps']:15.2f}" if torch_ref else f"{'-':>15}"
        w(f"{r['size_mb']:>5}MB {r['name']:34} {r['ms']:10.2f} {r['gbps']:8.2f} {pct:>10} {tref}")
    for r in RESULTS:
        if r["name"].startswith("copy"):
            w(f"{r['size_mb']:>5}MB {r['name']:34} {r['ms']:10.2f} {r['gbps']:8.2f}")


@pytest.fixture
def benchmark(benchmark):
    # pytest-benchmark's fixture, carrying the list the summary table reads.
    benchmark._bpclip_results = RESULTS
    return benchmark
