"""setup.py's build-time checks, run in one subprocess (setup.py builds nothing for
`--version`, but its checks run): the supported torch range, the C++ standard taken from
torch's own CMake config, and the loud warning when a CUDA torch finds no nvcc."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = r"""
import os, re, runpy, sys
import torch

def run(version, cuda=None):
    torch.__version__, torch.version.cuda = version, cuda
    sys.argv = ["setup.py", "--version"]
    try:
        return runpy.run_path("setup.py", run_name="setup_check")
    except RuntimeError as exc:
        print("REFUSED:", exc)

real = torch.__version__
run("2.10.1+cpu")
ns = run(real)
cfg = open(os.path.join(os.path.dirname(torch.__file__), "share/cmake/Torch/TorchConfig.cmake")).read()
print("STD:", ns["_torch_cxx_std"](), "CMAKE:", re.search(r"CXX_STANDARD\s+(\d+)", cfg).group(1))
os.environ["PATH"] = "/usr/bin:/bin"  # no nvcc
os.environ.pop("CUDA_HOME", None)
os.environ.pop("MEGADLM_EXT_CUDA", None)
run("2.11.0+cu130", cuda="13.0")
"""


def test_setup_checks_torch_range_std_and_cuda_warning():
    r = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out, err = r.stdout, r.stderr
    assert "REFUSED: megadlms supports torch 2.11 to 2.13, but torch 2.10.1+cpu is installed" in out, out
    std, cmake = out.split("STD: ")[1].split(" CMAKE: ")
    assert std.strip() == f"['-std=c++{cmake.split()[0]}']", out
    # a CUDA torch with no nvcc: built CPU-only, but loudly
    assert "WARNING: torch 2.11.0+cu130 has CUDA 13.0 but neither nvcc nor CUDA_HOME" in err, err[-2000:]
    assert "WITHOUT its CUDA kernels" in err
