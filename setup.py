"""Build script for bpclip_fast (PyTorch C++/CUDA extension ``bpclip_fast._C``).

CUDA or CPU-only is decided from the toolkit (nvcc) and the torch build
(``torch.version.cuda``), never from ``torch.cuda.is_available()``: a CUDA
extension compiles and links on a machine without a GPU.

Environment switches
--------------------
BPCLIP_CPU_ONLY=1       build the CPU-only extension even when CUDA could be built.
BPCLIP_FORCE_CUDA=1     fail loudly if the CUDA extension cannot be built.
TORCH_CUDA_ARCH_LIST    e.g. "8.0;9.0" (default), "8.0 8.6 9.0+PTX"; sm_XX names only
                        (no named archs like "Ampere"). Default and parser: tools/cuda_archs.py,
                        which CMakeLists.txt runs too.
CUDA_HOME / CUDA_PATH   the toolkit; otherwise found from nvcc on PATH or /usr/local/cuda.
MAX_JOBS                parallel compile jobs for ninja (default 2).
BPCLIP_DEBUG=1          keep host debug info (-g); the default is -g0 (half the compile time).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))
os.chdir(ROOT)  # sources are globbed relative to the repo root
CSRC = os.path.join("csrc")  # relative paths keep the build log short and setuptools happy


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _log(msg: str) -> None:
    print(f"bpclip_fast setup: {msg}", flush=True)


# ---------------------------------------------------------------------------
# CUDA toolkit discovery (must happen BEFORE importing torch.utils.cpp_extension,
# which reads CUDA_HOME once at import time).
# ---------------------------------------------------------------------------
def _is_toolkit(path: str | None) -> bool:
    return bool(path) and os.path.isfile(os.path.join(path, "bin", "nvcc")) and (
        os.path.isfile(os.path.join(path, "include", "cuda_runtime.h"))
        or bool(glob.glob(os.path.join(path, "targets", "*", "include", "cuda_runtime.h")))
    )


def _find_cuda_home() -> str | None:
    for var in ("CUDA_HOME", "CUDA_PATH"):
        val = os.environ.get(var)
        if val:
            if _is_toolkit(val):
                return val
            _log(f"warning: {var}={val} is not a CUDA toolkit (no bin/nvcc + cuda_runtime.h); ignoring it")
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        # nvcc on PATH may be a wrapper script (e.g. /usr/local/bin/nvcc), so
        # dirname(dirname(nvcc)) is only a guess; it is validated below.
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates += ["/usr/local/cuda"]
    for cand in candidates:
        if _is_toolkit(cand):
            return cand
    return None


def _nvcc_version(cuda_home: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--version"],
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _load_cuda_archs():
    """tools/cuda_archs.py: the arch list's default and parser, shared with CMakeLists.txt.

    Loaded by path: setup.py also runs under pip's build backend, where the repo root need not be
    on sys.path.
    """
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "_bpclip_cuda_archs", os.path.join(ROOT, "tools", "cuda_archs.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cuda_archs = _load_cuda_archs()


def _parse_archs(spec: str) -> tuple[list[str], list[str]]:
    """'8.0;9.0+PTX' -> (gencode flags, ['sm_80', 'sm_90', 'compute_90'])."""
    try:
        archs = cuda_archs.parse(spec)
    except cuda_archs.ArchError as e:
        raise SystemExit(f"bpclip_fast setup: {e}") from None
    return cuda_archs.gencode_flags(archs), cuda_archs.names(archs)


def _extra_cuda_includes(cuda_home: str, cuda_major: int) -> list[str]:
    """cuBLAS/cuSPARSE headers that ATen's CUDA headers include.

    Some toolkits (like the one on our build machines) ship without them; the
    nvidia-* wheels that torch depends on carry them under
    site-packages/nvidia/cu<major>/include (CUDA 13) or nvidia/<lib>/include
    (CUDA 12 wheels). Only added when the toolkit lacks them.
    """
    needed = ("cublas_v2.h", "cusparse.h")
    tk_dirs = [os.path.join(cuda_home, "include")] + glob.glob(
        os.path.join(cuda_home, "targets", "*", "include"))
    missing = [h for h in needed if not any(os.path.isfile(os.path.join(d, h)) for d in tk_dirs)]
    if not missing:
        return []
    roots: list[str] = []
    try:
        import nvidia  # namespace package installed by the nvidia-* wheels
        roots += list(getattr(nvidia, "__path__", []))
    except ImportError:
        pass
    import site
    import sysconfig
    for sp in [sysconfig.get_paths().get("platlib"), sysconfig.get_paths().get("purelib")] + \
            (site.getsitepackages() if hasattr(site, "getsitepackages") else []):
        if sp:
            roots.append(os.path.join(sp, "nvidia"))
    dirs: list[str] = []
    for root in dict.fromkeys(roots):
        cands = [os.path.join(root, f"cu{cuda_major}", "include")]
        cands += sorted(glob.glob(os.path.join(root, "*", "include")))
        for d in cands:
            if any(os.path.isfile(os.path.join(d, h)) for h in missing) and d not in dirs:
                dirs.append(d)
    still = [h for h in missing if not any(os.path.isfile(os.path.join(d, h)) for d in dirs)]
    if still:
        raise RuntimeError(
            f"CUDA toolkit {cuda_home} lacks {', '.join(still)} and no nvidia-* wheel in "
            "site-packages provides them (pip install nvidia-cublas nvidia-cusparse, or a full toolkit)")
    return dirs


def _decide_cuda() -> tuple[bool, str, str | None]:
    """Returns (with_cuda, reason, cuda_home)."""
    import torch

    force = _flag("BPCLIP_FORCE_CUDA")
    if _flag("BPCLIP_CPU_ONLY"):
        if force:
            raise SystemExit("bpclip_fast setup: BPCLIP_CPU_ONLY=1 and BPCLIP_FORCE_CUDA=1 contradict each other")
        return False, "BPCLIP_CPU_ONLY=1", None

    def no(reason: str):
        if force:
            raise SystemExit(f"bpclip_fast setup: BPCLIP_FORCE_CUDA=1 but CUDA cannot be built: {reason}")
        return False, reason, None

    if torch.version.cuda is None:
        return no(f"torch {torch.__version__} is not a CUDA build")
    cuda_home = _find_cuda_home()
    if cuda_home is None:
        return no("no CUDA toolkit found (set CUDA_HOME or put nvcc on PATH)")
    ver = _nvcc_version(cuda_home)
    if ver is None:
        return no(f"cannot run {cuda_home}/bin/nvcc --version")
    torch_major = int(torch.version.cuda.split(".")[0])
    if ver[0] != torch_major:
        return no(f"nvcc {ver[0]}.{ver[1]} ({cuda_home}) does not match torch's CUDA {torch.version.cuda}")
    return True, f"nvcc {ver[0]}.{ver[1]} at {cuda_home}, torch CUDA {torch.version.cuda}", cuda_home


WITH_CUDA, REASON, CUDA_HOME_DIR = _decide_cuda()
if WITH_CUDA:
    os.environ["CUDA_HOME"] = CUDA_HOME_DIR  # read by torch.utils.cpp_extension at import
    ARCH_SPEC = cuda_archs.resolve()  # $TORCH_CUDA_ARCH_LIST, else cuda_archs.DEFAULT
    GENCODE, ARCH_NAMES = _parse_archs(ARCH_SPEC)
else:
    GENCODE, ARCH_NAMES = [], []
os.environ.setdefault("MAX_JOBS", "2")

import torch  # noqa: E402
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension  # noqa: E402

ARCHS_DEF = ",".join(ARCH_NAMES)  # comma-separated: ninja runs commands through a shell
_log(("CUDA build" if WITH_CUDA else "CPU-only build")
     + f" ({REASON}); archs=[{ARCHS_DEF}]; torch {torch.__version__}; MAX_JOBS={os.environ['MAX_JOBS']}")


def _sources(pattern: str) -> list[str]:
    return sorted(glob.glob(os.path.join(CSRC, pattern)))


sources = _sources("*.cpp") + _sources(os.path.join("cpu", "*.cpp"))
if WITH_CUDA:
    sources += _sources(os.path.join("cuda", "*.cu"))
if not sources:
    raise SystemExit("bpclip_fast setup: no sources found under csrc/")

with_cuda_def = ["-DBPCLIP_WITH_CUDA"] if WITH_CUDA else []
cxx_defines = [f"-DBPCLIP_CUDA_ARCHS={ARCHS_DEF}"] + with_cuda_def
# nvcc splits -D values at commas (-DX=a,b defines X=a AND b=1, and `sm_90` as a macro then breaks
# <nv/target>); a backslash escapes the comma for nvcc. torch shlex-quotes every flag it writes
# to build.ninja, so the backslash reaches nvcc intact.
nvcc_defines = [f"-DBPCLIP_CUDA_ARCHS={ARCHS_DEF.replace(',', chr(92) + ',')}"] + with_cuda_def
# torch >= 2.10 headers require C++20 (ATen.h: "#error C++20 or later").
# -O3 enables GCC's auto-vectoriser; no -march=native: the binary must run on any x86-64.
# -fno-math-errno only stops libm calls from setting errno (lets sqrt inline/vectorise);
# results are unchanged (this is NOT -ffast-math). -fno-trapping-math only drops the assumption
# that a float op may trap, so GCC can if-convert the branch-free Box-Muller loop of the CPU
# noise kernel and vectorise it (measured 0.23 -> 0.55 GB/s for 29M fp32 draws); values are unchanged.
# -g0 cancels the -g that Python's sysconfig CFLAGS put first: debug info for the ATen headers
# doubles compile time (measured 38 s -> 19 s for one kernel file). BPCLIP_DEBUG=1 keeps it.
debug_flags = ["-g"] if _flag("BPCLIP_DEBUG") else ["-g0"]
# -ffp-contract=off: GCC would otherwise fuse a*b+c in the AVX-512 clones (csrc/cpu/vector_clones.h),
# so machines with and without AVX-512 would round differently (and the noise would differ).
# -fopenmp: ATen's at::parallel_for is header code that runs the loop on the calling thread unless
# the including file is compiled with OpenMP; without it every CPU kernel used one core
# (measured: philox_noise_ on 29M elements 133 ms on 1 or 2 threads). At run time the extension
# binds to the libgomp.so.1 that libtorch_cpu has already loaded, so there is one thread pool.
cxx_flags = ["-O3", "-std=c++20", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off",
             "-fopenmp"] + debug_flags + cxx_defines
link_flags = ["-fopenmp"]
nvcc_flags = [
    "-O3", "-std=c++20", "-lineinfo",
    "--expt-relaxed-constexpr", "--extended-lambda",
    # no --use_fast_math: the privacy noise needs IEEE-exact log/sin/cos/sqrt/div.
    "-Xcompiler", "-fno-math-errno", "-Xcompiler", "-fno-trapping-math",
] + GENCODE + nvcc_defines

include_dirs = [os.path.join(ROOT, "csrc", "include"), os.path.join(ROOT, "csrc")]

if WITH_CUDA:
    ext = CUDAExtension(
        name="bpclip_fast._C",
        sources=sources,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
        extra_link_args=link_flags,
    )
    # Appended AFTER torch's own include dirs (which contain $CUDA_HOME/include), so the
    # toolkit's cuda_runtime.h etc. win and the wheel dir only supplies what is missing.
    extra = _extra_cuda_includes(CUDA_HOME_DIR, int(torch.version.cuda.split(".")[0]))
    if extra:
        _log("adding nvidia wheel include dir(s) for cuBLAS/cuSPARSE headers: " + ", ".join(extra))
    ext.include_dirs = list(ext.include_dirs) + extra
else:
    ext = CppExtension(
        name="bpclip_fast._C",
        sources=sources,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=link_flags,
    )

BUILD_TEMP = os.path.join(ROOT, "build", "ext-cuda" if WITH_CUDA else "ext-cpu")


class BuildExt(BuildExtension.with_options(use_ninja=True)):
    """torch's BuildExtension with a persistent object dir.

    ninja then recompiles only what changed, whether called as `setup.py build_ext --inplace`
    or through `pip install -e .` (which otherwise builds in a fresh temporary directory).
    """

    def finalize_options(self):
        super().finalize_options()
        self.build_temp = BUILD_TEMP


setup(
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExt},
)
