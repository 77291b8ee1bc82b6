"""setup.py's build-time checks, run in this process (setup.py builds nothing for
`--version`, but its checks run; a subprocess would only import torch again): the supported
torch range, the C++ standard taken from torch's own CMake config, and the loud warning when
a CUDA torch finds no nvcc."""

import os
import re
import runpy

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(monkeypatch, version, cuda=None):
    """setup.py --version as if torch were ``version`` (CUDA ``cuda``); its namespace, or the
    RuntimeError it refused with."""
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr("sys.argv", ["setup.py", "--version"])
    try:
        return runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="setup_check")
    except RuntimeError as exc:
        return exc


def test_setup_checks_torch_range_std_and_cuda_warning(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    real = torch.__version__
    refused = _run(monkeypatch, "2.10.1+cpu")
    assert isinstance(refused, RuntimeError)
    assert "megadlms supports torch 2.11 to 2.13, but torch 2.10.1+cpu is installed" in str(refused)
    ns = _run(monkeypatch, real)
    cfg = os.path.join(os.path.dirname(torch.__file__), "share/cmake/Torch/TorchConfig.cmake")
    cmake = re.search(r"CXX_STANDARD\s+(\d+)", open(cfg).read()).group(1)
    assert ns["_torch_cxx_std"]() == [f"-std=c++{cmake}"]
    # a CUDA torch with no nvcc: built CPU-only, but loudly
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("MEGADLM_EXT_CUDA", raising=False)
    capsys.readouterr()
    assert not isinstance(_run(monkeypatch, "2.11.0+cu130", cuda="13.0"), RuntimeError)
    err = capsys.readouterr().err
    assert "WARNING: torch 2.11.0+cu130 has CUDA 13.0 but neither nvcc nor CUDA_HOME" in err, err[-2000:]
    assert "WITHOUT its CUDA kernels" in err
