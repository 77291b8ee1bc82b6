"""Every bad input is refused with a ValueError that names the tensor index, both routes."""

import pytest
import torch

import megadlm_ext

from .helpers import ROUTES, route


def ok_list(n=5):
    return [torch.ones(3) for _ in range(n)]


def cases():
    flat = torch.zeros(64)
    nc = torch.ones(4, 4).t()  # non-contiguous
    meta = torch.empty(3, device="meta")
    view_of_flat = flat[10:13]

    def with_(i, t, n=5):
        ts = ok_list(n)
        ts[i] = t
        return ts

    yield "not a tensor", lambda: megadlm_ext.flatten(with_(2, 3.0)), r"tensors\[2\] is a float"
    yield "list type", lambda: megadlm_ext.l2_norm(torch.ones(3)), "list or tuple"
    yield (
        "int dtype",
        lambda: megadlm_ext.scale_(with_(4, torch.ones(3, dtype=torch.int64)), 2.0),
        r"tensors\[4\] has dtype",
    )
    yield (
        "f64 dtype",
        lambda: megadlm_ext.l2_norm(with_(1, torch.ones(3, dtype=torch.float64))),
        r"tensors\[1\] has dtype",
    )
    yield "non-contiguous", lambda: megadlm_ext.flatten(with_(2, nc)), r"tensors\[2\] is not contiguous"
    yield (
        "non-contiguous in-place",
        lambda: megadlm_ext.unflatten(flat, with_(3, nc)),
        r"tensors\[3\] is not contiguous",
    )
    yield (
        "device vs flat",
        lambda: megadlm_ext.accumulate_into(flat, with_(1, meta)),
        r"tensors\[1\] is on meta",
    )
    yield "device vs out", lambda: megadlm_ext.flatten(with_(3, meta), flat), r"tensors\[3\] is on meta"
    yield "device vs [0]", lambda: megadlm_ext.has_nonfinite(with_(2, meta)), r"tensors\[2\] is on meta"
    yield "device scale_", lambda: megadlm_ext.scale_(with_(4, meta), 1.0), r"tensors\[4\] is on meta"
    yield (
        "offset past end",
        lambda: megadlm_ext.accumulate_into(flat, ok_list(3), offsets=[0, 3, 62]),
        r"tensors\[2\] .*runs past the end of flat",
    )
    yield (
        "out too small",
        lambda: megadlm_ext.flatten(ok_list(3), torch.zeros(8)),
        r"tensors\[2\] .*runs past the end of out",
    )
    yield (
        "negative offset",
        lambda: megadlm_ext.unflatten(flat, ok_list(3), offsets=[0, -1, 8]),
        r"offsets\[1\] = -1 is negative",
    )
    yield (
        "overlap",
        lambda: megadlm_ext.flatten(ok_list(3), flat, offsets=[0, 10, 12]),
        r"tensors\[1\] and tensors\[2\] overlap",
    )
    yield (
        "overlap unsorted",
        lambda: megadlm_ext.accumulate_into(flat, ok_list(4), offsets=[20, 0, 10, 21]),
        r"tensors\[0\] and tensors\[3\] overlap",
    )
    yield (
        "offsets length",
        lambda: megadlm_ext.flatten(ok_list(3), flat, offsets=[0, 3]),
        "offsets has 2 entries",
    )
    yield (
        "alias flat",
        lambda: megadlm_ext.accumulate_into(flat, with_(2, view_of_flat), offsets=[20, 23, 0, 30, 33]),
        r"tensors\[2\] aliases flat",
    )
    yield (
        "alias out",
        lambda: megadlm_ext.flatten(with_(1, view_of_flat), flat, offsets=[20, 23, 26, 29, 32]),
        r"tensors\[1\] aliases out",
    )
    shared = torch.ones(3)
    yield (
        "unflatten twice",
        lambda: megadlm_ext.unflatten(flat, [torch.ones(2), shared, torch.ones(1), shared]),
        r"tensors\[1\] and tensors\[3\] share memory",
    )
    base = torch.ones(10)
    yield (
        "scale_ overlap views",
        lambda: megadlm_ext.scale_([base[:6], torch.ones(2), base[4:]], 2.0),
        r"tensors\[0\] and tensors\[2\] share memory",
    )
    yield (
        "scale_ overlap in order",
        lambda: megadlm_ext.scale_([base[:2], base[2:6], base[5:]], 2.0),
        r"tensors\[1\] and tensors\[2\] share memory",
    )
    yield "flat 2-D", lambda: megadlm_ext.unflatten(torch.zeros(4, 4), ok_list(2)), "contiguous 1-D"
    yield (
        "out dtype",
        lambda: megadlm_ext.flatten(ok_list(2), torch.zeros(8), dtype=torch.bfloat16),
        "disagrees with out.dtype",
    )
    yield "flat not tensor", lambda: megadlm_ext.accumulate_into([1.0], ok_list(1)), "must be a tensor"


CASES = list(cases())


@pytest.mark.parametrize("name", ROUTES)
@pytest.mark.parametrize("label,call,pattern", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_value_error(name, label, call, pattern):
    with route(name):
        with pytest.raises(ValueError, match=pattern):
            call()


@pytest.mark.parametrize("name", ROUTES)
def test_refused_call_leaves_buffers_untouched(name):
    flat = torch.zeros(16)
    ts = [torch.ones(4), torch.ones(4)]
    with route(name):
        with pytest.raises(ValueError):
            megadlm_ext.accumulate_into(flat, ts, offsets=[0, 14])
    assert torch.count_nonzero(flat) == 0


def test_non_contiguous_handled_by_caller():
    """The documented fix in the message works: .contiguous() copies are accepted."""
    nc = torch.arange(16.0).reshape(4, 4).t()
    with route("compiled"):
        flat = megadlm_ext.flatten([nc.contiguous()])
    assert torch.equal(flat, nc.reshape(-1))
