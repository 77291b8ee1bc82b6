"""The NCCL communicator core against a fake libnccl (tests/ext/fake_nccl.cpp), on CPU.

The fake is compiled with g++ (once per session, tests/ext/conftest.py) and loaded through
the real dlopen loader; the communicator core (csrc/nccl/communicator.cpp) is driven through
_C._NcclTestCommunicator with the fake's host streams/events. Covers: the version check at
load, non-blocking init with its timeout and Ctrl-C, the watchdog (async error, a collective
that never completes, its device binding, CUDA-graph capture, the runtime unloading at
exit), abort and the waits after it, the stream/event ordering of a collective and its work
handle, close() bounded when a peer is dead, closing at interpreter exit, and destroy
without the GIL.
"""

import _thread
import ctypes
import signal
import subprocess
import sys
import threading
import time

import pytest

import megadlm_ext
from megadlm_ext import nccl

from .conftest import CXX

UID = bytes(128)
F32 = 7


@pytest.fixture(scope="module")
def fake(shims):
    """(ctypes handle of the fake, its path), loaded into megadlm_ext's NCCL loader."""
    if CXX is None:
        pytest.fail("no C++ compiler to build the fake libnccl (install g++)")
    from megadlm_ext import _C

    if megadlm_ext.backend_info()["cuda"]:
        # The loader keeps the first library it loads for the whole process: the fake
        # must not stand in for the real libnccl that the GPU tests use.
        pytest.skip("CUDA build: the real NCCL path is tested by the gpu tests (test_nccl*.py)")
    # built by tests/ext/conftest.py, in the background (NCCL 2.9.3 and 2.27.3)
    old, good = shims.path("libnccl_old.so.2"), shims.path("libnccl.so.2")
    if _C.nccl_loaded() and _C.nccl_path() != good:
        pytest.skip(f"another libnccl is already loaded in this process: {_C.nccl_path()}")
    ok, why = _C.nccl_load([old, good])
    # The too-old library is refused with the minimum named; the good one is taken.
    assert ok is True, why
    assert f"{old}: NCCL 2.9.3 is too old: megadlm_ext needs NCCL >= 2.14.0" in why
    assert _C.nccl_path() == good and _C.nccl_version() == 22703
    lib = ctypes.CDLL(good)  # same path: the very instance the loader opened
    lib.fake_stream_create.restype = ctypes.c_void_p
    lib.fake_stream_hold.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.fake_stream_capture.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.fake_log.restype = ctypes.c_char_p
    return lib, good


@pytest.fixture()
def lib(fake):
    fake[0].fake_reset()
    return fake[0]


def make(fake, lib, timeout=5.0, poll=0.01, device=0):
    comm_stream = lib.fake_stream_create()
    c = megadlm_ext._C._NcclTestCommunicator(UID, 0, 1, timeout, poll, fake[1], comm_stream, device)
    return c, comm_stream


def entries(lib, all_=False):
    """The fake's call log; without ``all_``, the watchdog thread's start is left out (its
    timing relative to the caller's calls is not fixed)."""
    return [e for e in lib.fake_log().decode().split(";") if e and (all_ or not e.startswith("thread_init"))]


def _until(cond, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def sid(ptr):
    return str(ptr % 100000)


def test_collective_orders_streams_and_wait_is_device_side(fake, lib):
    comm, cs = make(fake, lib)
    compute = lib.fake_stream_create()
    send, recv = (ctypes.c_float * 4)(1, 2, 3, 4), (ctypes.c_float * 4)()
    work = comm.all_reduce(ctypes.addressof(send), ctypes.addressof(recv), 4, F32, 0, compute)
    assert list(recv) == [1, 2, 3, 4]
    work.wait()
    assert work.is_completed() is True
    c, s = sid(compute), sid(cs)
    # record on the compute stream, comm stream waits on it, NCCL runs on the comm
    # stream, completion recorded there; wait() = compute stream waits (no host sync).
    assert entries(lib) == [
        "init:blocking=0",
        f"record:{c}",
        f"wait:{s}<-{c}",
        f"allreduce:{s}",
        f"record:{s}",
        f"wait:{c}<-{s}",
    ]
    comm.close()
    assert (lib.fake_finalizes(), lib.fake_destroys(), lib.fake_aborts()) == (1, 1, 0)
    with pytest.raises(megadlm_ext._C.NcclError, match="closed"):
        comm.all_reduce(0, 0, 0, F32, 0, compute)
    del work
    assert lib.fake_events_live() == 0  # every event destroyed


def test_init_waits_for_slow_ranks_then_succeeds(fake, lib):
    lib.fake_set_init_polls(5)
    comm, _ = make(fake, lib)
    assert comm.error() == ""
    comm.close()


def test_init_timeout_aborts_with_a_clear_error(fake, lib):
    lib.fake_set_init_polls(-1)  # the other ranks never join
    t0 = time.monotonic()
    with pytest.raises(
        nccl.NcclTimeoutError, match=r"timed out after 0\.3 s on rank 0 of 1.*distributed-timeout"
    ):
        make(fake, lib, timeout=0.3)
    assert time.monotonic() - t0 < 3.0
    assert lib.fake_aborts() == 1
    assert issubclass(nccl.NcclTimeoutError, RuntimeError)


def test_init_is_interruptible(fake, lib):
    lib.fake_set_init_polls(-1)
    # Python's own Ctrl-C handler, whatever the launcher left: a process started in the
    # background by a shell without job control inherits SIGINT ignored, Python then installs
    # no handler, and interrupt_main does nothing (the init would wait out its 30 s).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.2, _thread.interrupt_main).start()
        with pytest.raises(KeyboardInterrupt):
            make(fake, lib, timeout=30.0)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert lib.fake_aborts() == 1


def test_watchdog_aborts_on_async_error_naming_rank_and_collective(fake, lib):
    comm, _ = make(fake, lib)
    compute = lib.fake_stream_create()
    buf = (ctypes.c_float * 8)()
    comm.all_reduce(ctypes.addressof(buf), ctypes.addressof(buf), 8, F32, 4, compute).wait()
    lib.fake_set_async_error(3)  # ncclInternalError, e.g. a peer died
    deadline = time.monotonic() + 5
    while lib.fake_aborts() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert lib.fake_aborts() == 1
    with pytest.raises(
        nccl.NcclError, match=r"rank 0 of 1.*internal error.*all_reduce #1 \(8 elements, float32\)"
    ):
        comm.all_reduce(ctypes.addressof(buf), ctypes.addressof(buf), 8, F32, 0, compute)
    comm.close()  # already aborted: no destroy on a freed communicator
    assert lib.fake_destroys() == 0 and lib.fake_aborts() == 1


def test_watchdog_times_out_a_collective_that_never_completes(fake, lib):
    comm, cs = make(fake, lib, timeout=0.3)
    lib.fake_stream_hold(cs, 1)  # the collective is queued but never finishes
    compute = lib.fake_stream_create()
    buf = (ctypes.c_float * 2)()
    work = comm.all_gather(ctypes.addressof(buf), ctypes.addressof(buf), 2, F32, compute)
    assert work.is_completed() is False
    deadline = time.monotonic() + 5
    while comm.error() == "" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "all_gather #1 (2 elements, float32) did not complete within 0.3 s on rank 0 of 1" in comm.error()
    assert lib.fake_aborts() == 1
    with pytest.raises(nccl.NcclError, match="did not complete"):
        work.wait()
    comm.close()


def test_explicit_abort(fake, lib):
    comm, _ = make(fake, lib)
    comm.abort("rank 1 raised: non-finite gradients")
    assert lib.fake_aborts() == 1
    with pytest.raises(nccl.NcclError, match="non-finite gradients"):
        comm.all_reduce(0, 0, 0, F32, 0, lib.fake_stream_create())
    comm.close()


def test_close_releases_the_gil(fake, lib):
    comm, _ = make(fake, lib)
    lib.fake_set_block_destroy(1)
    # ncclCommDestroy blocks until this Python thread unblocks it: only possible if
    # close() released the GIL.
    threading.Timer(0.1, lib.fake_unblock_destroy).start()
    comm.close()
    assert lib.fake_destroy_timed_out() == 0
    assert lib.fake_destroys() == 1


def test_watchdog_binds_to_the_communicators_device(fake, lib):
    comm, _ = make(fake, lib, device=3)
    # the watchdog thread (not the constructing one) sets device 3 before any CUDA call
    assert _until(lambda: "thread_init:3:other-thread" in entries(lib, all_=True)), entries(lib, True)
    comm.close()


def test_wait_after_an_async_error_raises_before_the_watchdog_polls(fake, lib):
    comm, _ = make(fake, lib, poll=30.0)  # the watchdog will not look again within the test
    compute = lib.fake_stream_create()
    buf = (ctypes.c_float * 4)()
    work = comm.all_reduce(ctypes.addressof(buf), ctypes.addressof(buf), 4, F32, 0, compute)
    lib.fake_set_async_error(3)  # a peer died after the collective was issued
    with pytest.raises(nccl.NcclError, match=r"seen by wait\(\).*internal error.*all_reduce #1"):
        work.wait()
    assert lib.fake_aborts() == 1
    with pytest.raises(nccl.NcclError, match="seen by wait"):  # and every later wait
        work.wait()
    comm.close()


def test_abort_without_a_reason_still_makes_waits_raise(fake, lib):
    comm, _ = make(fake, lib)
    compute = lib.fake_stream_create()
    buf = (ctypes.c_float * 4)()
    work = comm.all_reduce(ctypes.addressof(buf), ctypes.addressof(buf), 4, F32, 0, compute)
    comm.abort("")
    assert comm.error() == "the NCCL communicator was aborted on rank 0 of 1"
    with pytest.raises(nccl.NcclError, match="aborted on rank 0 of 1"):
        work.wait()
    with pytest.raises(nccl.NcclError, match="aborted on rank 0 of 1"):
        work.is_completed()
    comm.close()


def test_close_is_bounded_when_a_peer_is_dead(fake, lib):
    # (a) the flush never finishes: close() gives up after its grace and aborts
    comm, _ = make(fake, lib, timeout=600.0)
    lib.fake_set_finalize_polls(-1)
    t0 = time.monotonic()
    comm.close(grace_s=0.3)
    assert time.monotonic() - t0 < 3.0
    assert (lib.fake_finalizes(), lib.fake_aborts(), lib.fake_destroys()) == (1, 1, 0)
    assert "ncclCommFinalize did not finish within the 0.3 s grace of close() on rank 0 of 1" in comm.error()
    # (b) a collective still in flight (its peer never joined it): abort, no flush at all
    lib.fake_reset()
    comm, cs = make(fake, lib, timeout=600.0)
    lib.fake_stream_hold(cs, 1)
    buf = (ctypes.c_float * 2)()
    comm.all_reduce(ctypes.addressof(buf), ctypes.addressof(buf), 2, F32, 0, lib.fake_stream_create())
    t0 = time.monotonic()
    comm.close(grace_s=0.3)
    assert time.monotonic() - t0 < 3.0
    assert (lib.fake_finalizes(), lib.fake_aborts()) == (0, 1)
    assert "all_reduce #1 (2 elements, float32) was still in flight" in comm.error()


def test_runtime_unloading_at_exit_is_not_a_communicator_failure(fake, lib):
    comm, cs = make(fake, lib)
    lib.fake_stream_hold(cs, 1)  # a collective pending when the process exits
    buf = (ctypes.c_float * 2)()
    comm.all_reduce(ctypes.addressof(buf), ctypes.addressof(buf), 2, F32, 0, lib.fake_stream_create())
    lib.fake_set_query_error(4)  # cudaErrorCudartUnloading from the event query
    assert _until(lambda: comm.error() != "")
    assert "CUDA runtime is shutting down" in comm.error()
    comm.close()  # NCCL is left alone: no abort, no finalize, no destroy
    assert (lib.fake_aborts(), lib.fake_finalizes(), lib.fake_destroys()) == (0, 0, 0)


def test_watchdog_does_not_query_work_captured_into_a_graph(fake, lib):
    comm, cs = make(fake, lib, timeout=0.3)
    compute = lib.fake_stream_create()
    lib.fake_stream_capture(compute, 1)  # torch.cuda.graph capture on the caller's stream
    buf = (ctypes.c_float * 2)()
    work = comm.all_reduce(ctypes.addressof(buf), ctypes.addressof(buf), 2, F32, 0, compute)
    work.wait()  # device-side wait: legal under capture
    # The fake fails a query of a captured event (as CUDA does): a watchdog query would
    # abort. Several polls and more than the timeout later, nothing failed.
    time.sleep(0.6)
    assert comm.error() == "" and lib.fake_aborts() == 0
    with pytest.raises(nccl.NcclError, match="captured into a CUDA graph"):
        work.is_completed()
    lib.fake_stream_capture(compute, 0)
    lib.fake_stream_capture(cs, 0)  # capture ended
    comm.all_reduce(ctypes.addressof(buf), ctypes.addressof(buf), 2, F32, 0, compute).wait()
    comm.close()
    assert (lib.fake_destroys(), lib.fake_aborts()) == (1, 0)


def test_communicators_are_closed_at_interpreter_exit(fake):
    """megadlm_ext.nccl closes the communicators still open when Python exits (bounded), so
    NCCL is flushed and destroyed before the CUDA runtime unloads."""
    code = f"""
import atexit, ctypes
lib = ctypes.CDLL({fake[1]!r})
lib.fake_stream_create.restype = ctypes.c_void_p
# registered before megadlm_ext.nccl is imported, so it runs after nccl's exit hook
atexit.register(lambda: print("at exit:", lib.fake_finalizes(), lib.fake_destroys(), lib.fake_aborts()))
from megadlm_ext import _C, nccl
assert _C.nccl_load([{fake[1]!r}])[0]
comm = _C._NcclTestCommunicator(bytes(128), 0, 1, 600.0, 0.01, {fake[1]!r}, lib.fake_stream_create())
nccl.close_at_exit(comm)
keep = comm  # still referenced at exit
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "at exit: 1 1 0" in r.stdout, r.stdout + r.stderr[-2000:]


def test_slow_collectives_stay_stream_ordered(fake, lib):
    """Issue 21 audit of the nccl_ext handshake with a slow collective (comm stream held):
    launches return at once and nothing reports complete early; ``wait()`` does not block
    the host but orders the compute stream after the collective (device side), so a kernel
    queued after it cannot read the buffer in flight; a later collective starts only after
    the compute work queued before it."""
    comm, cs = make(fake, lib)
    lib.fake_stream_hold(cs, 1)
    compute = lib.fake_stream_create()
    send, recv = (ctypes.c_float * 4)(1, 2, 3, 4), (ctypes.c_float * 4)()
    first = comm.all_reduce(ctypes.addressof(send), ctypes.addressof(recv), 4, F32, 0, compute)
    second = comm.all_gather(ctypes.addressof(send), ctypes.addressof(recv), 4, F32, compute)
    assert (first.is_completed(), second.is_completed()) == (False, False)
    t0 = time.monotonic()
    first.wait()
    assert time.monotonic() - t0 < 1.0  # device-side: the host is not held by the slow stream
    assert first.is_completed() is False
    c, s = sid(compute), sid(cs)
    assert entries(lib)[1:] == [
        f"record:{c}",
        f"wait:{s}<-{c}",
        f"allreduce:{s}",
        f"record:{s}",
        f"record:{c}",
        f"wait:{s}<-{c}",
        f"allgather:{s}",
        f"record:{s}",
        f"wait:{c}<-{s}",
    ]
    lib.fake_stream_hold(cs, 0)
    assert (first.is_completed(), second.is_completed()) == (True, True)
    second.wait()
    comm.close()
