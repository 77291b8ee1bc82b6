"""megadlm_ext.nccl: clear refusal on CPU builds; 1-rank collectives on a GPU."""

import pytest
import torch

import megadlm_ext
from megadlm_ext import nccl


def test_cpu_build_refuses_nccl_ext_with_the_fix():
    if megadlm_ext.backend_info()["cuda"]:
        pytest.skip("CUDA build: the communicator is available")
    assert megadlm_ext.backend_info()["nccl"] is False
    assert nccl.available() is False
    with pytest.raises(RuntimeError, match=r"comm_backend='nccl_ext'.*comm_backend='torch'"):
        nccl.Communicator(bytes(128), 0, 1, 0)
    with pytest.raises(RuntimeError, match="nccl_ext"):
        nccl.unique_id()


def test_communicator_argument_checks():
    with pytest.raises(ValueError, match="128 bytes"):
        nccl.Communicator(b"short", 0, 1, 0)
    with pytest.raises(ValueError, match="rank=2"):
        nccl.Communicator(bytes(128), 2, 2, 0)


def test_loader_reports_every_candidate(monkeypatch, tmp_path):
    """The dlopen loader (built on every platform) refuses a non-library with the reason."""
    if not megadlm_ext.backend_info()["compiled"]:
        pytest.fail("megadlm_ext._C was not built")
    from megadlm_ext import _C

    if _C.nccl_loaded():
        pytest.skip("libnccl already loaded in this process")
    bogus = tmp_path / "libnccl.so.2"
    bogus.write_bytes(b"not an ELF file")
    ok, why = _C.nccl_load([str(bogus)])
    assert ok is False and str(bogus) in why


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_single_rank_collectives_equal_input(dtype):
    assert nccl.available(), "CUDA build without a loadable libnccl.so.2"
    dev = torch.cuda.current_device()
    with nccl.Communicator(nccl.unique_id(), 0, 1, dev) as comm:
        x = torch.randn(1000, device="cuda").to(dtype)
        for op in ("sum", "avg"):
            y = x.clone()
            comm.all_reduce(y, op=op)
            out = torch.empty_like(x)
            comm.reduce_scatter(out, x, op=op)
            gathered = torch.empty_like(x)
            comm.all_gather(gathered, x)
            torch.cuda.synchronize()
            assert torch.equal(y, x) and torch.equal(out, x) and torch.equal(gathered, x)
        with pytest.raises(ValueError):
            comm.all_reduce(torch.ones(3))  # a CPU tensor
    assert megadlm_ext.backend_info()["nccl"] is True
