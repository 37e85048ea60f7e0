"""The TF32 batched product (``kernels/tf32.py``) on a CPU: :func:`contract` is ``torch.einsum``
for the torch Mamba2 scan's five products (values and gradients, float64), the custom operator's
registration (schema, fake tensor, autograd, AOT dispatch: ``torch.library.opcheck``), the TF32
flag put back as it was, and the scan with ``tf32=True`` equal to the float32 one on a CPU,
where the operator is ``torch.bmm``. Whether the products run on TF32 on CUDA, and how far
from float64, is ``tests/functional/test_tf32_gpu.py``'s matter.
"""

from __future__ import annotations

import pytest
import torch

from megatron_hybrid.kernels.tf32 import contract, tf32_bmm, tf32_matmuls
from megatron_hybrid.testing.overlap import rel_error

# The scan's products (modules/ssd.py) with small, pairwise distinct sizes per index, so that a
# mixed-up axis cannot go unnoticed: b 2, c 3, l/s 4, g 2, r 3, p 5, n 6, z/y 4.
SIZES = dict(b=2, c=3, l=4, s=4, g=2, r=3, p=5, n=6, z=4, y=4)
SPECS = [
    pytest.param("bclgn,bcsgn->bgcls", id="scores"),
    pytest.param("bgrcls,bcsgrp->bclgrp", id="within-chunks"),
    pytest.param("bcsgn,bcsgrp->bcgrpn", id="chunk-states"),
    pytest.param("bgrzy,bygrpn->bzgrpn", id="states-between"),
    pytest.param("bclgn,bcgrpn->bclgrp", id="carried-in"),
]


def _operands(spec: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    left, right = spec.split("->")[0].split(",")
    return tuple(
        torch.randn([SIZES[i] for i in names], generator=gen, dtype=torch.float64).requires_grad_()
        for names in (left, right)
    )


@pytest.mark.parametrize("spec", SPECS)
def test_contract_is_einsum(spec):
    """Values and both gradients equal ``torch.einsum``'s (float64, so up to summation order);
    control: the second operand reversed along its summed index moves them far."""
    a, b = _operands(spec, seed=1)
    got = contract(spec, a, b, tf32=True)
    want = torch.einsum(spec, a, b)
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(2), dtype=want.dtype)
    got_grads = torch.autograd.grad(got, (a, b), grad)
    want_grads = torch.autograd.grad(want, (a, b), grad)
    for got_t, want_t in zip((got, *got_grads), (want, *want_grads), strict=True):
        assert got_t.shape == want_t.shape
        assert rel_error(got_t, want_t) < 1e-13
    left, right, out = spec.replace("->", ",").split(",")
    summed = next(i for i in left if i in right and i not in out)
    flipped = contract(spec, a, b.flip(right.index(summed)), tf32=True)
    assert rel_error(flipped, want) > 0.1


def test_contract_without_tf32_is_einsum_itself():
    a, b = _operands("bclgn,bcsgn->bgcls", seed=3)
    assert torch.equal(contract("bclgn,bcsgn->bgcls", a, b, tf32=False),
                       torch.einsum("bclgn,bcsgn->bgcls", a, b))  # fmt: skip


@pytest.mark.parametrize(
    "spec, shapes, message",
    [pytest.param("ij,jk->k", ([2, 3], [3, 4]), r"summed in one alone \(i\)", id="summed-alone"),
     pytest.param("ii,ik->k", ([3, 3], [3, 4]), "a repeated index", id="repeated"),
     pytest.param("ij,jk->ik", ([2, 3], [4, 5]), "index j is 3 and 4", id="sizes-differ")],
)  # fmt: skip
def test_contract_refuses_what_one_product_cannot_do(spec, shapes, message):
    a, b = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        contract(spec, a, b, tf32=True)


def test_operator_registration():
    """Schema, fake tensor, autograd registration and AOT dispatch (static and dynamic shapes)
    of the custom operator, as torch checks them."""
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(3, 4, 5, generator=gen, requires_grad=True)
    b = torch.randn(3, 5, 2, generator=gen, requires_grad=True)
    torch.library.opcheck(tf32_bmm, (a, b))
    torch.library.opcheck(tf32_bmm, (a.detach(), b.detach().transpose(1, 2).contiguous().mT))


@pytest.fixture
def restore_tf32_flag():
    """The test may set the flag either way; put the process's back."""
    saved = torch.backends.cuda.matmul.fp32_precision
    yield
    torch.backends.cuda.matmul.fp32_precision = saved


@pytest.mark.parametrize(
    "setter, value",
    [pytest.param("allow_tf32", False, id="legacy-off"),
     pytest.param("allow_tf32", True, id="legacy-on"),
     pytest.param("fp32_precision", "ieee", id="ieee"),
     pytest.param("fp32_precision", "none", id="none")],
)  # fmt: skip
def test_tf32_matmuls_puts_the_flag_back(restore_tf32_flag, setter, value):
    """Inside the block cuBLAS may use TF32; after it, also after an error, the flag reads as it
    was set, through the API that set it (torch refuses to read ``allow_tf32`` once the other
    API has left a value it cannot express)."""
    settings = torch.backends.cuda.matmul
    setattr(settings, setter, value)
    before = settings.fp32_precision
    with tf32_matmuls():
        assert settings.fp32_precision == "tf32"
    assert getattr(settings, setter) == value and settings.fp32_precision == before
    with pytest.raises(RuntimeError, match="inside"), tf32_matmuls():
        raise RuntimeError("inside")
    assert getattr(settings, setter) == value and settings.fp32_precision == before
