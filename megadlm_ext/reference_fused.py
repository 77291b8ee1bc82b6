"""Plain-PyTorch reference route of the fused transformer ops (rope, swiglu, add_rmsnorm and
their backwards); :mod:`megadlm_ext.reference` re-exports them.

Same contract and the same checks as the compiled route (csrc/fused_bindings.cpp): values
are read as fp32, combined in fp32 and rounded once into the output dtype, as the kernels
do. Written for clarity, not speed (it uses the cat the kernels avoid).
"""

from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _tensor(op: str, name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"{op}: {name} is on {t.device}; megadlm_ext runs cpu tensors (and cuda tensors in CUDA builds)"
        )
    return t


def _float(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{op}: {name} has dtype {t.dtype}; supported: float32, bfloat16, float16")


def _contiguous(op: str, name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(
            f"{op}: {name} is not contiguous (strides {tuple(t.stride())}); pass {name}.contiguous()"
        )


def _like(op: str, name: str, t: torch.Tensor, ref: torch.Tensor, ref_name: str, shape=None) -> None:
    if t.dtype != ref.dtype:
        raise ValueError(
            f"{op}: {name} is {t.dtype} but {ref_name} is {ref.dtype}; they must have the same dtype"
        )
    if t.device != ref.device:
        raise ValueError(f"{op}: {name} is on {t.device} but {ref_name} is on {ref.device}")
    want = list(ref.shape if shape is None else shape)
    if list(t.shape) != want:
        raise ValueError(f"{op}: {name} has shape {list(t.shape)} but must be {want}")


# ---- rotary embedding -------------------------------------------------------------------------
def _check_angles(name: str, t: torch.Tensor, x: torch.Tensor) -> None:
    if t.dtype != torch.float32:
        raise ValueError(f"rope: {name} must be float32 (the angles are kept in fp32), got {t.dtype}")
    if t.device != x.device:
        raise ValueError(f"rope: {name} is on {t.device} but x is on {x.device}")
    B, S, _, D = x.shape
    if t.dim() != 4 or t.shape[0] not in (1, B) or tuple(t.shape[1:]) != (S, 1, D):
        raise ValueError(
            f"rope: {name} has shape {list(t.shape)} but must be [{B} or 1, {S}, 1, {D}] "
            f"for x {list(x.shape)}"
        )


def rope(x, cos, sin, *, backward=False) -> torch.Tensor:
    _tensor("rope", "x", x)
    _float("rope", "x", x)
    if x.dim() != 4 or x.shape[3] % 2:
        raise ValueError(f"rope: x must be [B, S, heads, D] with an even D, got shape {list(x.shape)}")
    _check_angles("cos", _tensor("rope", "cos", cos), x)
    _check_angles("sin", _tensor("rope", "sin", sin), x)
    with torch.no_grad():
        x1, x2 = x.float().chunk(2, dim=-1)
        c1, c2 = cos.chunk(2, dim=-1)
        s1, s2 = sin.chunk(2, dim=-1)
        if backward:  # the transpose of the forward map (the inverse rotation for rotate-half angles)
            o1, o2 = x1 * c1 + x2 * s2, x2 * c2 - x1 * s1
        else:
            o1, o2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
        return torch.cat((o1, o2), dim=-1).to(x.dtype).contiguous()


# ---- SwiGLU -----------------------------------------------------------------------------------
def _check_gate_up(op: str, h) -> int:
    _tensor(op, "h", h)
    _float(op, "h", h)
    _contiguous(op, "h", h)
    if h.dim() < 1 or h.shape[-1] % 2:
        raise ValueError(
            f"{op}: h must be [..., 2F] ([gate | up]) with an even last dim, got shape {list(h.shape)}"
        )
    return h.shape[-1] // 2


def swiglu(h) -> torch.Tensor:
    _check_gate_up("swiglu", h)
    with torch.no_grad():
        gate, up = h.float().chunk(2, dim=-1)
        return (gate / (1 + torch.exp(-gate)) * up).to(h.dtype)


def swiglu_backward(h, grad_out) -> torch.Tensor:
    F = _check_gate_up("swiglu_backward", h)
    _tensor("swiglu_backward", "grad_out", grad_out)
    _like("swiglu_backward", "grad_out", grad_out, h, "h", [*h.shape[:-1], F])
    _contiguous("swiglu_backward", "grad_out", grad_out)
    with torch.no_grad():
        gate, up = h.float().chunk(2, dim=-1)
        d = grad_out.float()
        sig = 1 / (1 + torch.exp(-gate))
        d_gate = d * up * (sig * (1 + gate * (1 - sig)))
        d_up = d * (gate / (1 + torch.exp(-gate)))
        return torch.cat((d_gate, d_up), dim=-1).to(h.dtype)


# ---- residual add + RMSNorm -------------------------------------------------------------------
def _check_norm_input(op: str, x: torch.Tensor, x_name: str, weight) -> int:
    _float(op, x_name, x)
    _contiguous(op, x_name, x)
    if x.dim() < 1:
        raise ValueError(f"{op}: {x_name} must be [..., hidden]")
    _tensor(op, "weight", weight)
    _like(op, "weight", weight, x, x_name, [x.shape[-1]])
    _contiguous(op, "weight", weight)
    return x.shape[-1]


def add_rmsnorm(x, h, weight, eps):
    """-> (sum = x + h, y = rmsnorm(sum) * weight, rstd fp32 [...])."""
    _tensor("add_rmsnorm", "x", x)
    _tensor("add_rmsnorm", "h", h)
    _check_norm_input("add_rmsnorm", x, "x", weight)
    _like("add_rmsnorm", "h", h, x, "x")
    _contiguous("add_rmsnorm", "h", h)
    eps = float(eps)
    if not (eps > 0.0 and eps < float("inf")):
        raise ValueError(f"add_rmsnorm: eps must be a positive finite number, got {eps}")
    with torch.no_grad():
        total = (x.float() + h.float()).to(x.dtype)  # stored, then normalised as stored
        s = total.float()
        rstd = torch.rsqrt(s.square().mean(dim=-1) + eps)
        y = (s * rstd[..., None] * weight.float()).to(x.dtype)
        return total, y, rstd


def add_rmsnorm_backward(grad_sum, grad_y, sum, weight, rstd):  # noqa: A002 - the op's argument name
    """-> (grad of x (= of h), grad of weight)."""
    op = "add_rmsnorm_backward"
    _tensor(op, "sum", sum)
    _check_norm_input(op, sum, "sum", weight)
    for name, g in (("grad_sum", grad_sum), ("grad_y", grad_y)):
        _tensor(op, name, g)
        _like(op, name, g, sum, "sum")
        _contiguous(op, name, g)
    _tensor(op, "rstd", rstd)
    lead = list(sum.shape[:-1])
    if (
        rstd.dtype != torch.float32
        or rstd.device != sum.device
        or list(rstd.shape) != lead
        or not rstd.is_contiguous()
    ):
        raise ValueError(
            f"{op}: rstd must be the contiguous float32 {lead} tensor add_rmsnorm returned, got "
            f"{rstd.dtype} {list(rstd.shape)} on {rstd.device}"
        )
    with torch.no_grad():
        r = rstd[..., None]
        n = sum.float() * r
        gy = grad_y.float()
        gn = gy * weight.float()
        mean_dot = (gn * n).sum(dim=-1, keepdim=True) / sum.shape[-1]
        grad_x = (grad_sum.float() + r * (gn - n * mean_dot)).to(sum.dtype)
        grad_w = (gy * n).reshape(-1, sum.shape[-1]).sum(dim=0).to(weight.dtype)
        return grad_x, grad_w
