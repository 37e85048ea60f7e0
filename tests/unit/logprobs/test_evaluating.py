"""``evaluating``: eval mode and no gradients inside, every module's flag as it was after.

``forward_logprobs``, ``train``'s evaluation and the sampler run their forward passes in it.
It switches only the modules in training mode, by their flag, and a class with a ``train()``
of its own through that method both ways (megatron-core's ``MambaMixer`` marks its decode
cache stale there).
"""

from __future__ import annotations

import pytest
import torch

from megatron_hybrid.logprobs.forward import evaluating


class _OwnTrain(torch.nn.Module):
    """A module with its own ``train()`` that records the modes it was given."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(2, 2)
        self.calls: list[bool] = []

    def train(self, mode: bool = True):
        self.calls.append(mode)
        return super().train(mode)


def _model():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5), _OwnTrain())
    model.frozen = torch.nn.Linear(2, 2)
    model.train()
    model.frozen.eval()  # a submodule the caller keeps in eval mode
    model[2].inner.eval()  # and one under the module with its own train()
    model[2].calls.clear()
    return model


def _flags(model) -> dict[str, bool]:
    return {name: module.training for name, module in model.named_modules()}


@pytest.mark.parametrize("raises", [False, True], ids=["returns", "raises"])
def test_flags_switched_inside_and_restored_exactly(raises):
    model = _model()
    before = _flags(model)
    assert before["frozen"] is False and before["2.inner"] is False and before["2"] is True
    with pytest.raises(RuntimeError, match="inside") if raises else torch.no_grad():
        with evaluating([model]):
            assert not any(_flags(model).values())
            assert not torch.is_grad_enabled()
            if raises:
                raise RuntimeError("inside")
    assert _flags(model) == before
    assert model[2].calls == [False, True]  # its own train(), both ways


def test_a_model_in_eval_mode_is_not_switched():
    model = _model()
    model.eval()
    model[2].calls.clear()
    with evaluating([model]):
        assert not any(_flags(model).values())
    assert not any(_flags(model).values()) and model[2].calls == []
