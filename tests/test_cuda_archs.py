"""The CUDA arch list: tools/cuda_archs.py parses it for setup.py and for CMakeLists.txt."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "cuda_archs.py"

_spec = importlib.util.spec_from_file_location("_test_cuda_archs", SCRIPT)
cuda_archs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cuda_archs)


@pytest.mark.parametrize("spec, names, gencode, cmake", [
    ("8.0;9.0", ["sm_80", "sm_90"],
     ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90"],
     ["80-real", "90-real"]),
    ("8.0 8.6 9.0+PTX", ["sm_80", "sm_86", "sm_90", "compute_90"],
     ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_86,code=sm_86",
      "-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_90,code=compute_90"],
     ["80-real", "86-real", "90"]),
    (" 9.0a, 10.0f+PTX ;", ["sm_90a", "sm_100f", "compute_100f"],
     ["-gencode=arch=compute_90a,code=sm_90a", "-gencode=arch=compute_100f,code=sm_100f",
      "-gencode=arch=compute_100f,code=compute_100f"],
     ["90a-real", "100f"]),
])
def test_parse(spec, names, gencode, cmake):
    archs = cuda_archs.parse(spec)
    assert cuda_archs.names(archs) == names
    assert cuda_archs.gencode_flags(archs) == gencode
    assert cuda_archs.cmake_archs(archs) == cmake


@pytest.mark.parametrize("spec, message", [
    ("Ampere", "cannot parse TORCH_CUDA_ARCH_LIST entry 'Ampere'"),
    ("8.0;9", "cannot parse TORCH_CUDA_ARCH_LIST entry '9'"),
    ("9.0+ptx", "cannot parse TORCH_CUDA_ARCH_LIST entry '9.0+ptx'"),
    (" ; ", "TORCH_CUDA_ARCH_LIST is empty"),
])
def test_parse_errors_name_the_variable(spec, message):
    with pytest.raises(cuda_archs.ArchError, match=re.escape(message)):
        cuda_archs.parse(spec)


def test_resolve(monkeypatch):
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    assert cuda_archs.resolve() == cuda_archs.resolve("") == cuda_archs.DEFAULT == "8.0;9.0"
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.6")
    assert cuda_archs.resolve() == cuda_archs.resolve("") == "8.6"
    assert cuda_archs.resolve("9.0+PTX") == "9.0+PTX"


def _cli(*args, env_archs=None):
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CUDA_ARCH_LIST"}
    if env_archs is not None:
        env["TORCH_CUDA_ARCH_LIST"] = env_archs
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True,
                          text=True, timeout=60)


def test_cmake_command_line():
    """What CMakeLists.txt reads: spec (for torch's CMake), names and CUDA_ARCHITECTURES."""
    run = _cli("--cmake", "8.0 9.0+PTX")
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["spec=8.0;9.0+PTX", "names=sm_80;sm_90;compute_90",
                                       "cmake=80-real;90"]
    # An empty BPCLIP_CUDA_ARCH_LIST: the environment, else the default.
    assert _cli("--cmake", "", env_archs="8.6").stdout.splitlines()[0] == "spec=8.6"
    assert _cli("--cmake", "").stdout.splitlines() == ["spec=8.0;9.0", "names=sm_80;sm_90",
                                                       "cmake=80-real;90-real"]
    bad = _cli("--cmake", "8.0;Ampere")
    assert bad.returncode == 1 and bad.stdout == ""
    assert "cannot parse TORCH_CUDA_ARCH_LIST entry 'Ampere'" in bad.stderr


@pytest.mark.slow
def test_setup_py_and_cmake_compile_the_same_archs(tmp_path):
    """setup.py's archs and CMake's (library + CUDA configured, not built) for one list."""
    spec = "8.0 8.6 9.0+PTX"
    names = cuda_archs.names(cuda_archs.parse(spec))
    env = {k: v for k, v in os.environ.items() if k not in ("BPCLIP_CPU_ONLY", "BPCLIP_FORCE_CUDA")}
    env["TORCH_CUDA_ARCH_LIST"] = spec
    setup = subprocess.run([sys.executable, str(ROOT / "setup.py"), "--name"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    assert setup.returncode == 0, setup.stderr[-3000:]
    if "CUDA build" not in setup.stdout:
        pytest.skip("setup.py would not build CUDA here (no toolkit or a CPU torch)")
    assert f"archs=[{','.join(names)}]" in setup.stdout
    if shutil.which("cmake") is None:
        pytest.skip("no cmake")

    import torch
    env["TORCH_CUDA_ARCH_LIST"] = "7.5"  # the cache variable below wins over the environment
    build = tmp_path / "cmake"
    cfg = subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(build),
         "-DBPCLIP_BUILD_LIBRARY=ON", "-DBPCLIP_CUDA=ON",
         f"-DBPCLIP_CUDA_ARCH_LIST={spec}", f"-DPython3_EXECUTABLE={sys.executable}",
         f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}"],
        env=env, capture_output=True, text=True, timeout=300)
    assert cfg.returncode == 0, cfg.stdout[-3000:] + cfg.stderr[-3000:]
    flags = (build / "CMakeFiles" / "bpclip_fast_C.dir" / "flags.make").read_text()
    assert f"-DBPCLIP_CUDA_ARCHS={','.join(names)} " in flags  # the C++ sources
    gencode = re.findall(r"--generate-code=arch=compute_(\w+),code=\[([\w,]+)\]", flags)
    gencode = sorted(set(gencode))
    assert gencode == [("80", "sm_80"), ("86", "sm_86"), ("90", "compute_90,sm_90")]
