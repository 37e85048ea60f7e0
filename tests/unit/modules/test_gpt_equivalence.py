"""Grouped patterns against GPTModel: same sharded state dict, same math, shared checkpoints."""

from __future__ import annotations

import pytest
import torch
from support.checkpoints import grads_by_checkpoint_key, sharded_metadata

from megatron_hybrid.testing.models import build_gpt_twin, build_hybrid, model_inputs, small_config

GPT_EQUIVALENT = ["[*-]{3}", "[*E]{3}", "[*-][*E]{2}", "[*E]{2}[*-]", "[*E]{2}/*E"]
METADATA = [
    pytest.param(None, id="default"),
    pytest.param({"non_homogeneous_layers": True}, id="non_homogeneous"),
    pytest.param({"singleton_local_shards": True}, id="singleton_local_shards"),
]


@pytest.mark.parametrize("metadata", METADATA)
@pytest.mark.parametrize("pattern", GPT_EQUIVALENT)
def test_sharded_state_dict_equals_gpt(model_parallel, pattern, metadata):
    config = small_config(pattern)
    gpt = build_gpt_twin(config, pattern, model_parallel())
    expected = sharded_metadata(gpt.sharded_state_dict(metadata=metadata))
    hybrid = build_hybrid(config, pattern, model_parallel())
    actual = sharded_metadata(hybrid.sharded_state_dict(metadata=metadata))
    assert sorted(actual) == sorted(expected)
    assert actual == expected


def test_stacked_form_for_uniform_groups(pg):
    """`[*E]{3}` takes TransformerBlock's homogeneous form: one key, a leading layer axis."""
    config = small_config("[*E]{3}")
    sharded = sharded_metadata(build_hybrid(config, "[*E]{3}", pg).sharded_state_dict())
    kind, shape, _, _, _ = sharded["decoder.layers.self_attention.linear_proj.weight"]
    assert shape[0] == 3
    assert not any(key.startswith("decoder.layers.0.") for key in sharded)
    assert "decoder.final_layernorm.weight" in sharded
    assert "decoder.final_norm.weight" not in sharded


def test_mixed_groups_use_indexed_logical_keys(pg):
    config = small_config("[*-][*E]{2}")
    sharded = sharded_metadata(build_hybrid(config, "[*-][*E]{2}", pg).sharded_state_dict())
    assert "decoder.layers.0.mlp.linear_fc1.weight" in sharded
    assert "decoder.layers.2.mlp.router.weight" in sharded
    assert "decoder.layers.3.mlp.router.weight" not in sharded  # logical, not physical


def _forward_backward(model, inputs):
    model.zero_grad(set_to_none=True)
    loss = model(**inputs)
    loss.sum().backward()
    grads = {key: g.clone() for key, g in grads_by_checkpoint_key(model).items()}
    logits = model(**{**inputs, "labels": None}).detach()
    return loss.detach(), logits, grads


def _save(model, directory):
    from megatron.core import dist_checkpointing

    dist_checkpointing.save(model.sharded_state_dict(), str(directory))


def _load(model, directory):
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(model.sharded_state_dict(), str(directory))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")], missing
    assert not unexpected, unexpected


@pytest.mark.parametrize("direction", ["gpt_to_grouped", "grouped_to_gpt"])
@pytest.mark.parametrize("pattern", ["[*E]{2}", "[*-][*E]{2}", "[*E]{2}/*E"])
def test_torch_dist_round_trip_bitwise(model_parallel, tmp_path, pattern, direction):
    config = small_config(pattern)
    inputs = model_inputs()
    builders = {"gpt": build_gpt_twin, "grouped": build_hybrid}
    source_name, target_name = direction.split("_to_")
    source = builders[source_name](config, pattern, model_parallel(seed=1))
    reference_loss, reference_logits, reference_grads = _forward_backward(source, inputs)
    _save(source, tmp_path)

    target = builders[target_name](config, pattern, model_parallel(seed=2))
    _load(target, tmp_path)
    loss, logits, grads = _forward_backward(target, inputs)
    assert torch.equal(loss, reference_loss)
    assert torch.equal(logits, reference_logits)
    assert grads.keys() == reference_grads.keys()
    for key, grad in reference_grads.items():
        assert torch.equal(grads[key], grad), key


def test_grouping_does_not_change_math(model_parallel):
    """`[*-]` and `*-` hold the same layers in the same order and compute the same thing."""
    inputs = model_inputs()
    flat = build_hybrid(small_config("*-*E"), "*-*E", model_parallel(seed=3))
    grouped = build_hybrid(small_config("[*-][*E]"), "[*-][*E]", model_parallel(seed=4))
    flat_params = list(flat.parameters())
    grouped_params = list(grouped.parameters())
    assert [p.shape for p in flat_params] == [p.shape for p in grouped_params]
    with torch.no_grad():
        for dst, src in zip(grouped_params, flat_params, strict=True):
            dst.copy_(src)
    a, b = _forward_backward(flat, inputs), _forward_backward(grouped, inputs)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert [g for g in a[2].values()] and all(
        torch.equal(x, y) for x, y in zip(a[2].values(), b[2].values(), strict=True)
    )


@pytest.fixture
def gpt_attention_type():
    """A registered layer type that plays GPT's attention half (symbol 'A')."""
    import dataclasses

    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_hybrid.modules import LayerRuntime, register_layer_type, unregister_layer_type
    from megatron_hybrid.pattern import LAYER_TYPES, GptRole

    facts = dataclasses.replace(LAYER_TYPES["*"], symbol="A", name="my attention")
    assert facts.gpt_role == GptRole.ATTENTION
    runtime = LayerRuntime(
        symbol="A",
        spec_field="my_attention_layer",
        build=lambda spec, args: None,
        forward=lambda layer, hidden_states, inputs: hidden_states,
        run_pre_dispatch=lambda layer, hidden_states, node: hidden_states,
        default_spec=lambda backend: ModuleSpec(module=torch.nn.Identity),
    )
    register_layer_type(facts, runtime)
    yield "A"
    unregister_layer_type("A")


def test_a_registered_gpt_attention_type_is_gpt_equivalent(gpt_attention_type):
    """The GPT-role symbols are read from the layer-type table when asked, not frozen at import
    (a frozen set made gpt_config_for_pattern trip its own assertion on such a type)."""
    from megatron_hybrid.checkpointing.equivalence import gpt_equivalent_layers
    from megatron_hybrid.model.gpt_interop import gpt_config_for_pattern

    pattern = f"[{gpt_attention_type}-]{{2}}"
    assert gpt_equivalent_layers(pattern)
    config = gpt_config_for_pattern(small_config("[*-]{2}"), pattern)
    assert config.num_layers == 2
