"""megadlm_ext.TensorTable on the CPU: every op on a table gives bitwise the list's result,
through both routes and across them; the same refusals; validate(); matches(); lifetime
(a table outlives its list and keeps its tensors alive, survives interpreter exit, can be
collected in a cycle); the per-table cache (nothing rebuilt on a known flat buffer)."""

import gc
import re
import statistics
import subprocess
import sys
import threading
import time
import weakref

import pytest
import torch

import megadlm_ext
from megadlm_ext import reference

from .helpers import DTYPES, ROUTES, expect_accumulate, expect_flatten, packed_offsets, random_list, route

LISTS = {  # name -> (dtypes of the tensors, flat buffer dtype)
    "fp32": ((torch.float32,), torch.float32),
    "bf16->fp32": ((torch.bfloat16,), torch.float32),
    "fp16->bf16": ((torch.float16,), torch.bfloat16),
    "mixed->fp16": (DTYPES, torch.float16),
    "mixed->fp32": (DTYPES, torch.float32),
}


def _case(kind: str, gaps: bool, seed: int = 0, n: int = 40):
    dtypes, flat_dtype = LISTS[kind]
    g = torch.Generator().manual_seed(seed)
    ts = random_list(g, n, 300, dtypes)
    offs, numel = packed_offsets(ts, [i % 5 for i in range(n)] if gaps else None)
    return ts, (offs if gaps else None), numel, flat_dtype


def _run_all(ts, make, offsets, numel, flat_dtype):
    """Every op on ``make(copies of ts)`` (the list itself, or a table of it, then with
    ``offsets`` None); the results."""
    work = [t.clone() for t in ts]  # the in-place ops act on copies
    args = make(work)
    kw = {"offsets": offsets}
    out = {}
    out["flatten_new"] = megadlm_ext.flatten(args, scale=0.5, **kw)
    out["flatten_dtype"] = megadlm_ext.flatten(args, dtype=flat_dtype, **kw)
    flat = torch.full((numel + 3,), 0.25, dtype=flat_dtype)
    out["flatten_out"] = megadlm_ext.flatten(args, flat, scale=-3.0, **kw).clone()
    megadlm_ext.accumulate_into(flat, args, scale=1.0 / 3.0, **kw)
    out["accumulate"] = flat.clone()
    megadlm_ext.unflatten(flat, args, scale=2.0, **kw)
    megadlm_ext.scale_(args, 0.75)
    out["after_unflatten_scale"] = [t.clone() for t in work]
    out["l2_norm"] = megadlm_ext.l2_norm(args)
    out["nonfinite_flag"] = megadlm_ext.nonfinite_flag(args)
    out["has_nonfinite"] = megadlm_ext.has_nonfinite(args)
    big = max(range(len(work)), key=lambda i: work[i].numel())
    work[big].view(-1)[-1] = float("inf")
    out["has_nonfinite_inf"] = megadlm_ext.has_nonfinite(args)
    out["nonfinite_flag_inf"] = megadlm_ext.nonfinite_flag(args)
    return out


def _assert_bitwise(a, b, *, norm_rtol=None):
    """Every result bitwise equal; ``norm_rtol``: the norm only that close (the two routes
    sum the squares in different orders)."""
    assert a.keys() == b.keys()
    for k in a:
        if k == "l2_norm" and norm_rtol is not None:
            assert float(a[k]) == pytest.approx(float(b[k]), rel=norm_rtol)
            continue
        x, y = a[k], b[k]
        if isinstance(x, list):
            assert all(p.dtype == q.dtype and torch.equal(p, q) for p, q in zip(x, y)), k
        elif isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape, k
            bits = (lambda t: t.reshape(-1).view(torch.uint8)) if x.dtype.is_floating_point else (lambda t: t)
            assert torch.equal(bits(x), bits(y)), k
        else:
            assert x == y, k


@pytest.mark.parametrize("name", ROUTES)
@pytest.mark.parametrize("gaps", [False, True])
@pytest.mark.parametrize("kind", sorted(LISTS))
def test_table_equals_list_every_op(name, kind, gaps):
    ts, offs, numel, flat_dtype = _case(kind, gaps)
    with route(name):
        want = _run_all(ts, lambda w: w, offs, numel, flat_dtype)
        got = _run_all(ts, lambda w: megadlm_ext.TensorTable(w, offsets=offs), None, numel, flat_dtype)
    _assert_bitwise(want, got)
    # and the contract itself, independently of both routes
    base = torch.full((numel,), 0.25, dtype=flat_dtype)
    expect = expect_flatten(ts, offs or packed_offsets(ts)[0], numel, flat_dtype, -3.0, base)
    assert torch.equal(got["flatten_out"][:numel], expect)
    acc = expect_accumulate(got["flatten_out"], ts, offs or packed_offsets(ts)[0], 1.0 / 3.0)
    assert torch.equal(got["accumulate"], acc)
    assert got["has_nonfinite"] is False and got["has_nonfinite_inf"] is True


def test_routes_agree_and_take_each_others_tables():
    """The compiled and reference routes give the same bits on tables (the norm: the same
    number up to the summation order, as for lists), and each route's ops take the other
    route's table (a reference table gets a compiled twin, built once)."""
    ts, offs, numel, flat_dtype = _case("mixed->fp32", True, seed=3)
    made = []

    def maker(cls):
        def make(work):
            made.append(cls(work, offsets=offs))
            return made[-1]

        return make

    runs = {}
    for route_name in ROUTES:
        for table_cls in (megadlm_ext._C.TensorTable, reference.TensorTable):
            with route(route_name):
                runs[route_name, table_cls.__module__] = _run_all(
                    ts, maker(table_cls), None, numel, flat_dtype
                )
    first = runs["compiled", megadlm_ext._C.TensorTable.__module__]
    for (route_name, _), other in runs.items():
        _assert_bitwise(first, other, norm_rtol=None if route_name == "compiled" else 1e-6)
    twins = [t for t in made if type(t) is reference.TensorTable and t._twin is not None]
    assert len(twins) == 1 and twins[0]._twin.matches(twins[0].tensors)  # the compiled-route run
    with route("compiled"):
        compiled = megadlm_ext.TensorTable(ts, offsets=offs)
    with route("reference"):
        ref = megadlm_ext.TensorTable(ts, offsets=offs)
    assert type(compiled) is megadlm_ext._C.TensorTable and type(ref) is reference.TensorTable
    assert isinstance(compiled, megadlm_ext.TensorTable) and isinstance(ref, megadlm_ext.TensorTable)
    assert not isinstance(ts, megadlm_ext.TensorTable)
    for attr in ("offsets", "numel", "flat_numel", "device"):
        assert getattr(compiled, attr) == getattr(ref, attr), attr
    assert compiled.offsets == offs and compiled.flat_numel == numel
    assert len(compiled) == len(ref) == len(ts) and repr(compiled) == repr(ref)


def _errors():
    """(what, build the table's input, call, message) for inputs refused at construction."""
    nc = torch.ones(4, 4).t()

    def with_(i, t, n=5):
        ts = [torch.ones(3) for _ in range(n)]
        ts[i] = t
        return ts

    yield "not a tensor", with_(2, 3.0), {}, r"tensors\[2\] is a float, not a tensor"
    yield "list type", torch.ones(3), {}, "must be a list or tuple of tensors"
    yield "dtype", with_(4, torch.ones(3, dtype=torch.int64)), {}, r"tensors\[4\] has dtype"
    yield "non-contiguous", with_(2, nc), {}, r"tensors\[2\] is not contiguous"
    yield "device", with_(1, torch.empty(3, device="meta")), {}, r"tensors\[1\] is on meta"
    yield (
        "negative offset",
        with_(0, torch.ones(3), 3),
        {"offsets": [0, -1, 8]},
        r"offsets\[1\] = -1 is negative",
    )
    yield (
        "overlap",
        with_(0, torch.ones(3), 3),
        {"offsets": [0, 10, 12]},
        r"tensors\[1\] and tensors\[2\] overlap",
    )
    yield "offsets length", with_(0, torch.ones(3), 3), {"offsets": [0, 3]}, "offsets has 2 entries"


@pytest.mark.parametrize("name", ROUTES)
@pytest.mark.parametrize("case", list(_errors()), ids=lambda c: c[0])
def test_construction_refuses_what_the_list_path_refuses(name, case):
    _, tensors, kw, msg = case
    with route(name):
        with pytest.raises(ValueError, match=msg):
            megadlm_ext.TensorTable(tensors, **kw)


@pytest.mark.parametrize("name", ROUTES)
def test_per_call_checks(name):
    """Refusals at call time: offsets besides a table, a flat buffer too small or aliasing a
    tensor, in-place writes into tensors that share memory; messages as the list path's."""
    base = torch.zeros(12)
    shared = [base[0:6], base[4:10]]  # overlapping views
    ts = [torch.ones(3) for _ in range(3)]
    with route(name):
        table = megadlm_ext.TensorTable(ts)
        with pytest.raises(ValueError, match="offsets must be None with a TensorTable"):
            megadlm_ext.flatten(table, offsets=[0, 3, 6])
        with pytest.raises(ValueError, match=r"tensors\[2\] .*runs past the end of out \(8 elements\)"):
            megadlm_ext.flatten(table, torch.zeros(8))
        with pytest.raises(ValueError, match=r"tensors\[2\] .*runs past the end of flat"):
            megadlm_ext.accumulate_into(torch.zeros(8), table)
        pool = torch.zeros(9)
        aliased = megadlm_ext.TensorTable([pool[:3], pool[3:6]])
        with pytest.raises(ValueError, match=r"tensors\[0\] aliases flat"):
            megadlm_ext.unflatten(pool, aliased)
        sh = megadlm_ext.TensorTable(shared)  # legal to build and read ...
        assert float(megadlm_ext.l2_norm(sh)) == 0.0
        for write in (
            lambda: megadlm_ext.scale_(sh, 2.0),
            lambda: megadlm_ext.unflatten(torch.zeros(12), sh),
        ):
            with pytest.raises(ValueError, match=r"tensors\[0\] and tensors\[1\] share memory"):
                write()  # ... but not to write into
        # the list path words it the same way
        with pytest.raises(ValueError, match=r"tensors\[0\] and tensors\[1\] share memory"):
            megadlm_ext.scale_(shared, 2.0)


def _validate_message(name, mutate):
    ts = [torch.ones(4) for _ in range(5)]
    with route(name):
        table = megadlm_ext.TensorTable(ts)
        table.validate()  # unchanged: no error
        mutate(ts)
        with pytest.raises(ValueError) as err:
            table.validate()
    return str(err.value)


MUTATIONS = {
    "data swap": (lambda ts: setattr(ts[3], "data", torch.zeros(4)), r"tensors\[3\] data moved from 0x[0-9a-f]+ to 0x"),
    "resize_": (lambda ts: ts[2].resize_(4096), r"tensors\[2\] has 4096 elements, had 4"),
    "set_": (lambda ts: ts[1].set_(torch.zeros(4).untyped_storage()), r"tensors\[1\] data moved"),
    "dtype": (lambda ts: setattr(ts[4], "data", torch.zeros(4, dtype=torch.bfloat16)), r"tensors\[4\] is now torch.bfloat16, was torch.float32"),
    "storage freed": (lambda ts: ts[0].untyped_storage().resize_(0), r"tensors\[0\] data moved from 0x[0-9a-f]+ to 0x0 "),
}  # fmt: skip


@pytest.mark.parametrize("what", sorted(MUTATIONS))
def test_validate_names_the_moved_tensor(what):
    mutate, msg = MUTATIONS[what]
    got = {name: _validate_message(name, mutate) for name in ROUTES}
    for text in got.values():
        assert re.search(msg, text), text
        assert text.startswith("TensorTable.validate: ") and "build a new TensorTable" in text
    # the two routes word it the same (up to the addresses, which differ per run)
    assert re.sub("0x[0-9a-f]+", "0x", got["compiled"]) == re.sub("0x[0-9a-f]+", "0x", got["reference"])


@pytest.mark.parametrize("name", ROUTES)
def test_matches(name):
    ts = [torch.ones(2) for _ in range(4)]
    with route(name):
        table = megadlm_ext.TensorTable(ts)
    assert table.matches(ts) and table.matches(list(ts)) and table.matches(tuple(ts))
    assert not table.matches(ts[:3]) and not table.matches(ts + [ts[0]])
    assert not table.matches([*ts[:3], ts[3].clone()])  # equal values, another tensor
    assert not table.matches(ts[::-1]) and not table.matches(ts[0]) and not table.matches(None)


@pytest.mark.parametrize("name", ROUTES)
def test_table_outlives_its_list_and_keeps_tensors_alive(name):
    with route(name):
        table = megadlm_ext.TensorTable([torch.full((n,), float(n)) for n in (1, 2, 3)])
    gc.collect()  # the list (and any other reference) is gone: the table holds the tensors
    probe = weakref.ref(table.tensors[2])
    assert [t.tolist() for t in table.tensors] == [[1.0], [2.0, 2.0], [3.0] * 3]
    with route(name):
        megadlm_ext.scale_(table, 2.0)
        assert torch.equal(megadlm_ext.flatten(table), torch.tensor([2.0, 4, 4, 6, 6, 6]))
    assert probe() is not None
    del table
    gc.collect()
    assert probe() is None  # released with the table


def test_swapped_storage_stays_allocated():
    """After a `.data =` swap the table still points at the old storage, which it keeps alive:
    writes land there (not in freed memory) and validate() reports the move."""
    t = torch.ones(1000)
    table = megadlm_ext.TensorTable([t])
    old = t.detach()  # another view of the original storage, to look at it
    old_ptr = old.data_ptr()
    del old
    t.data = torch.zeros(1000)
    gc.collect()
    megadlm_ext.scale_(table, 3.0)  # writes the old storage, still owned by the table
    assert float(t.sum()) == 0.0
    with pytest.raises(ValueError, match=f"data moved from 0x{old_ptr:x}"):
        table.validate()


def test_cycle_through_a_table_is_collected():
    """A table stored on one of its own tensors is a reference cycle the collector sees."""
    t = torch.ones(8)
    t.table = megadlm_ext.TensorTable([t])
    probe = weakref.ref(t)
    del t
    gc.collect()
    assert probe() is None


def test_table_in_a_module_global_at_interpreter_exit():
    code = (
        "import torch, megadlm_ext\n"
        "T = megadlm_ext.TensorTable([torch.ones(5) for _ in range(3)])\n"
        "megadlm_ext.scale_(T, 2.0); print(float(megadlm_ext.l2_norm(T)))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert abs(float(r.stdout) - (15 * 4.0) ** 0.5) < 1e-5


def test_cache_builds_once_per_flat_buffer():
    """Host work per call is a cache hit once a (direction, flat buffer) pair is known; a new
    buffer (or dtype, or length) is a miss; flatten without `out` builds for that call only."""
    ts = [torch.randn(3) for _ in range(50)]
    table = megadlm_ext._C.TensorTable(ts)
    a, b = torch.zeros(150), torch.zeros(150)
    megadlm_ext.flatten(table, a)
    for _ in range(5):
        megadlm_ext.flatten(table, a)
        megadlm_ext.accumulate_into(a, table)  # same direction and buffer: the same table
    assert table._cache_stats() == (10, 1, 1)
    megadlm_ext.flatten(table, b)  # another buffer
    megadlm_ext.flatten(table, a[:150].view(torch.int32).view(torch.float32))  # same bytes: a hit
    megadlm_ext.unflatten(a, table)  # another direction
    megadlm_ext.flatten(table, torch.zeros(151))  # another length
    assert table._cache_stats() == (11, 4, 4)
    for _ in range(3):
        megadlm_ext.flatten(table)  # a fresh buffer each call: not cached
    assert table._cache_stats()[1:] == (4, 4)
    for i in range(12):  # LRU: at most 8 entries
        megadlm_ext.flatten(table, torch.zeros(150 + i))
    assert table._cache_stats()[2] == 8
    assert torch.equal(megadlm_ext.flatten(table, a), torch.cat(ts))


def test_threads_share_a_table():
    """Ops on one table from several threads (the GIL is released while kernels run)."""
    ts = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in range(1, 400)]
    table = megadlm_ext.TensorTable(ts)
    want = megadlm_ext.l2_norm(ts)
    results, errors = [], []

    def work():
        try:
            out = torch.empty(table.flat_numel)
            for _ in range(30):
                results.append(torch.equal(megadlm_ext.l2_norm(table), want))
                results.append(torch.equal(megadlm_ext.flatten(table, out), torch.cat(ts)))
        except Exception as exc:  # noqa: BLE001 -- reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors and len(results) == 240 and all(results)


def test_table_is_cheaper_than_the_list():
    """10,000 one-element tensors: the table skips the per-tensor parse (measured: ~10x, see
    docs/extension.md); asserted loosely, the machine being shared."""
    ts = [torch.randn(1) for _ in range(10_000)]
    table = megadlm_ext.TensorTable(ts)
    flat = torch.empty(10_000)
    lst, tab = [], []
    for _ in range(15):
        t0 = time.perf_counter()
        megadlm_ext.flatten(ts, flat)
        t1 = time.perf_counter()
        megadlm_ext.flatten(table, flat)
        t2 = time.perf_counter()
        lst.append(t1 - t0)
        tab.append(t2 - t1)
    assert statistics.median(lst) > 2 * statistics.median(tab), (
        statistics.median(lst),
        statistics.median(tab),
    )
    assert torch.equal(flat, torch.cat(ts))
