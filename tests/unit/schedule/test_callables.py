"""Which slot computes which delayed weight gradients (``delay_wgrad_compute``).

With TransformerEngine linears, a weight gradient is computed only when some slot calls its
module's ``backward_dw``; a linear that no slot covers keeps no gradient. The local linears of the
CPU tests compute theirs in backward, so comparing gradients with the plain schedule cannot see
a missing entry. These tests check the coverage itself: every linear layer (every module with a
``backward_dw``) of a logical layer is reached from exactly one slot, pre-layers and shared
experts from the pre-dispatch slot, routed experts and dense MLPs from the ``mlp`` slot.
"""

from __future__ import annotations

import pytest

from megatron_hybrid.testing.models import build_hybrid, small_config


def _linears(module) -> set[int]:
    """Parameter ids of the modules inside ``module`` that own a delayed-wgrad ``backward_dw``."""
    return {
        id(p)
        for m in module.modules()
        if callable(getattr(m, "backward_dw", None)) and not list(m.children())
        for p in m.parameters(recurse=False)
    }


def _covered(callables: list) -> list[int]:
    """Parameter ids reachable from a slot's delayed-wgrad callables (with repeats)."""
    return [id(p) for c in callables for p in c.parameters()]


def _logical_layers(model):
    from megatron_hybrid.schedule import build_layer_callables
    from megatron_hybrid.schedule.plan import logical_layer_members

    decoder = model.decoder
    for layer_type, layer in zip(decoder.layer_type_list, decoder.layers, strict=True):
        members = logical_layer_members(layer, layer_type)
        yield members, build_layer_callables(members)


CASES = [
    pytest.param("[*-][*E]", {}, id="dense-group-and-moe-group"),
    pytest.param("[*E]", dict(moe_shared_expert_intermediate_size=64), id="shared-experts"),
    pytest.param("*[*E]-", {}, id="plain-layers-around-group"),
    pytest.param("[GE]", {}, id="gated-delta-net", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("pattern, changes", CASES)
def test_every_linear_is_in_one_delayed_wgrad_slot(pg, pattern, changes):
    if "G" in pattern:
        pytest.importorskip("fla")
    model = build_hybrid(small_config(pattern, **changes), pattern, pg)
    checked = 0
    for members, callables in _logical_layers(model):
        pre_dispatch = _covered(callables.backward_dw["pre_dispatch_computation"])
        mlp = _covered(callables.backward_dw["mlp"])
        everything = set().union(*(_linears(module) for _, module in members))
        assert everything, f"no linear layers found in {members}"
        # Exactly one slot: a repeat would compute (and accumulate) a weight gradient twice.
        assert len(pre_dispatch + mlp) == len(set(pre_dispatch + mlp))
        assert everything <= set(pre_dispatch) | set(mlp), "a linear layer no slot covers"

        terminal_symbol, terminal = members[-1]
        if terminal_symbol in ("E", "-"):
            routed = terminal.mlp.experts if terminal_symbol == "E" else terminal.mlp
            assert _linears(routed) <= set(mlp)
            for _, pre_layer in members[:-1]:
                assert _linears(pre_layer) <= set(pre_dispatch)
            shared = getattr(terminal.mlp, "shared_experts", None)
            if shared is not None:
                assert _linears(shared) <= set(pre_dispatch)
                checked += 1
        else:
            assert mlp == []
        checked += 1
    assert checked >= 1
    if changes.get("moe_shared_expert_intermediate_size"):
        assert checked >= 2, "the shared experts were not checked"


def test_mtp_projection_is_in_the_pre_dispatch_slot(pg):
    from megatron_hybrid.schedule.mtp import build_mtp_callables

    pattern = "[*E]/*E"
    model = build_hybrid(small_config(pattern), pattern, pg)
    depth = model.mtp.layers[0]
    callables = build_mtp_callables(depth)
    pre_dispatch = _covered(callables.backward_dw["pre_dispatch_computation"])
    mlp = _covered(callables.backward_dw["mlp"])
    assert _linears(depth.eh_proj) <= set(pre_dispatch)
    assert _linears(depth.mtp_model_layer) <= set(pre_dispatch) | set(mlp)
    assert len(pre_dispatch + mlp) == len(set(pre_dispatch + mlp))
