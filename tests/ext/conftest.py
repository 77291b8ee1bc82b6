"""The g++-built shims of tests/ext (the CUDA-kernel and cuBLAS emulations, the fake libnccl):
each is compiled once per session, and all of them start together in the background at the
first tests/ext test, so a module finds its library built (or almost) instead of compiling
in its turn while the second core idles."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CXX = shutil.which("g++") or shutil.which("c++")
CUDA_INCLUDE = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include")
_INC = ["-I", os.path.join(ROOT, "csrc", "include")]
_SO = ["-std=c++17", "-shared", "-fPIC"]
_FAKE = [*_SO, "-O1", os.path.join(ROOT, "tests", "ext", "fake_nccl.cpp")]

# library name -> (the test module that loads it, g++ arguments before -o)
SHIMS = {
    "cuda_emu.so": (
        "test_cuda_emulation.py",
        [*_SO, "-O2", "-fno-strict-aliasing", "-ffp-contract=off", "-Wno-unknown-pragmas", *_INC,
         os.path.join(ROOT, "tests", "ext", "cuda_emu.cpp")],
    ),
    "adam_emu.so": (
        "test_adam_emulation.py",
        [*_SO, "-O2", "-fno-strict-aliasing", "-ffp-contract=off", "-Wno-unknown-pragmas", *_INC,
         os.path.join(ROOT, "tests", "ext", "adam_emu.cpp")],
    ),
    "fused_emu.so": (
        "test_fused_emulation.py",
        [*_SO, "-O2", "-fno-strict-aliasing", "-ffp-contract=off", "-Wno-unknown-pragmas", *_INC,
         os.path.join(ROOT, "tests", "ext", "fused_emu.cpp")],
    ),
    "cublas_emu.so": (
        "test_grouped_gemm.py",
        [*_SO, "-O1", "-x", "c++", *_INC, "-I", os.path.join(ROOT, "csrc", "cuda"), "-I", CUDA_INCLUDE,
         os.path.join(ROOT, "tests", "ext", "cublas_emu.cpp")],
    ),
    "libnccl_old.so.2": ("test_nccl_fake.py", [*_FAKE, "-DFAKE_VERSION=20903"]),
    "libnccl.so.2": ("test_nccl_fake.py", [*_FAKE, "-DFAKE_VERSION=22703"]),
}  # fmt: skip


def cublas_headers() -> bool:
    """The cuBLAS emulation needs the CUDA runtime headers (library_types.h), not a GPU."""
    return os.path.exists(os.path.join(CUDA_INCLUDE, "library_types.h"))


class Shims:
    """Background g++ builds into one folder, each started at most once."""

    def __init__(self, folder):
        self.folder, self.procs = folder, {}

    def start(self, name: str) -> None:
        if name not in self.procs:
            out, log = self.folder / name, open(self.folder / f"{name}.log", "w")
            cmd = [CXX, *SHIMS[name][1], "-o", str(out)]
            self.procs[name] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log)

    def path(self, name: str) -> str:
        """The built library's path: waits for its build (bounded); a failed build raises."""
        self.start(name)
        proc, log = self.procs[name]
        if proc.wait(timeout=300) != 0:
            log.flush()
            raise RuntimeError(
                f"g++ failed to build {name}:\n{(self.folder / f'{name}.log').read_text()[-3000:]}"
            )
        return str(self.folder / name)

    def close(self) -> None:
        for proc, log in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            log.close()


@pytest.fixture(scope="session")
def shims(tmp_path_factory):
    """The session's :class:`Shims` (the modules' fixtures take their library from it)."""
    built = Shims(tmp_path_factory.mktemp("shims"))
    yield built
    built.close()


@pytest.fixture(scope="session", autouse=True)
def _start_shims(request, shims):
    """Starts the builds of the selected modules' libraries at the first tests/ext test."""
    if CXX is None:
        return
    modules = {item.path.name for item in request.session.items}
    for name, (module, _) in SHIMS.items():
        if module in modules and (name != "cublas_emu.so" or cublas_headers()):
            shims.start(name)
