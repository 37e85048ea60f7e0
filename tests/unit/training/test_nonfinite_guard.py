"""The NaN guard names the first non-finite parameter, else gradient, it finds (one rank)."""

from __future__ import annotations

import pytest
import torch

from megatron_hybrid.training.guard import NonFiniteStepError, check_step
from megatron_hybrid.training.loop import StepResult, first_nonfinite_parameter


@pytest.fixture
def model(model_parallel):
    from megatron_hybrid.testing.models import build_hybrid, small_config

    built = build_hybrid(small_config("[*-]"), "[*-]", model_parallel())
    for param in built.parameters():
        param.main_grad = torch.zeros_like(param)
    return built


def _named(model, part: str) -> tuple[str, torch.nn.Parameter]:
    return next((n, p) for n, p in model.named_parameters() if part in n)


def test_finite_model_names_nothing(model):
    """The control: nothing is named when every parameter and gradient is finite."""
    assert first_nonfinite_parameter([model]) is None


def test_a_nonfinite_gradient_is_named(model):
    name, param = _named(model, "linear_fc1.weight")
    param.main_grad[0, 0] = float("nan")
    assert first_nonfinite_parameter([model]) == f"gradient of {name} (rank 0)"


def test_a_nonfinite_parameter_is_named_before_gradients(model):
    grad_name, grad_param = _named(model, "linear_qkv.weight")
    grad_param.main_grad[1, 1] = float("inf")
    name, param = _named(model, "linear_fc2.weight")
    with torch.no_grad():
        param[0, 0] = float("-inf")
    assert first_nonfinite_parameter([model]) == f"parameter {name} (rank 0)"


def test_the_stop_message_names_it():
    result = StepResult(
        loss=float("nan"),
        grad_norm=float("nan"),
        tokens=8,
        finite=False,
        nonfinite="gradient of decoder.layers.0.mlp.linear_fc1.weight (rank 1)",
    )
    with pytest.raises(NonFiniteStepError, match=r"^step 3: gradient of decoder\.layers\.0\.mlp\."
                       r"linear_fc1\.weight \(rank 1\) is NaN or infinite \(loss nan"):  # fmt: skip
        check_step(result, 3, "stop", None)
    assert check_step(result, 3, "skip", None) is True
