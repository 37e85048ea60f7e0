"""adapter_config.json read as peft 0.21.2 reads it: each honoured field against peft itself
(logits of ``PeftModel.from_pretrained`` on the same folder, with a negative control: the logits
of the whole adapter, which is what a loader ignoring the field computes), each refused field by
name, and the folders peft itself refuses."""

from __future__ import annotations

import json
import shutil
import warnings

import peft_oracle
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_peft_oracle import REL_L2, errors, logits_of

from megatron_hybrid.hf import load_hf_model
from megatron_hybrid.peft import PeftAdapterError, load_peft_adapter, save_peft_adapter
from megatron_hybrid.peft.adapter_config import FIELDS, read_adapter_config

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def _edited(case, tmp_path, name="edited", **fields):
    """A copy of the case's adapter folder with ``fields`` set in its config (None deletes)."""
    folder = tmp_path / name
    shutil.copytree(case.adapter, folder)
    config = json.loads((folder / CONFIG).read_text())
    for key, value in fields.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / CONFIG).write_text(json.dumps(config))
    return folder


def _ours(case, folder, input_ids):
    return logits_of(load_peft_adapter(load_hf_model(case.hf), folder), input_ids)


#: Honoured fields of the dense Qwen3.5 adapter (layers 0-2 GatedDeltaNet, 3 attention):
#: id -> config fields. Each narrows or rescales what the whole file computes.
HONOURED = {
    "target_modules_list": dict(target_modules=["q_proj", "in_proj_z"]),
    "target_modules_full_name": dict(
        target_modules=["model.layers.1.linear_attn.out_proj", "model.layers.3.mlp.up_proj"]
    ),
    "target_modules_regex": dict(target_modules=r".*\.layers\.[02]\..*_proj.*"),
    "exclude_modules_list": dict(exclude_modules=["gate_proj", "linear_attn.in_proj_qkv"]),
    "exclude_modules_regex": dict(exclude_modules=r".*layers\.3\..*"),
    "layers_to_transform": dict(layers_to_transform=[1, 3]),
    "layers_to_transform_int_and_pattern": dict(layers_to_transform=2, layers_pattern="layers"),
    "use_rslora": dict(use_rslora=True),
}


@pytest.mark.parametrize("fields", list(HONOURED.values()), ids=list(HONOURED))
def test_honoured_field_gives_peft_logits(fields, cases, input_ids, pg, tmp_path):
    case = cases["qwen3_5"]
    folder = _edited(case, tmp_path, **fields)
    theirs, _ = peft_oracle.peft_logits(case.hf, folder, input_ids)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = _ours(case, folder, input_ids)
    # Tensors of modules the config does not target are left out, with a warning.
    left_out = [w for w in caught if "left out because" in str(w.message)]
    assert bool(left_out) == ("use_rslora" not in fields), [str(w.message) for w in caught]
    max_abs, rel = errors(ours, theirs)
    bound = peft_oracle.peft_bound(case.hf, folder, input_ids)
    assert max_abs <= bound and rel <= REL_L2, (max_abs, bound, rel)
    # Negative control: the whole file as it stands (what a loader ignoring the field
    # computes) is far from peft's reading.
    control, _ = errors(case.logits, theirs)
    assert control > 20 * bound, (control, bound)


@pytest.mark.parametrize(
    "fields",
    [
        dict(fan_in_fan_out=True),  # peft resets it to False on torch.nn.Linear
        dict(rank_pattern={"q_proj": peft_oracle.RANK}, alpha_pattern={".*": peft_oracle.ALPHA}),
        dict(init_lora_weights="gaussian", inference_mode=False, revision="main"),
        dict(layers_to_transform=[]),  # an empty list selects every layer in peft
    ],
    ids=["fan_in_fan_out", "uniform_patterns", "initialisation_and_metadata", "empty_layers"],
)
def test_fields_without_effect_give_peft_logits(fields, cases, input_ids, pg, tmp_path):
    case = cases["qwen3_5"]
    folder = _edited(case, tmp_path, **fields)
    theirs, _ = peft_oracle.peft_logits(case.hf, folder, input_ids)
    assert torch.equal(theirs, case.logits)  # peft itself: no change
    max_abs, rel = errors(_ours(case, folder, input_ids), theirs)
    assert max_abs <= case.bound and rel <= REL_L2, (max_abs, case.bound, rel)


def test_narrower_target_parameters_give_peft_logits(cases, input_ids, pg, tmp_path):
    """Only the experts' down_proj: peft nests one wrapper, so the file's gate_up_proj tensors
    (experts.base_layer.lora_*) are left out, the down_proj ones (experts.lora_*) read."""
    case = cases["qwen3_5_moe"]
    folder = _edited(case, tmp_path, target_parameters=["mlp.experts.down_proj"])
    theirs, _ = peft_oracle.peft_logits(case.hf, folder, input_ids)
    with pytest.warns(UserWarning, match="left out because adapter_config.json does not target"):
        ours = _ours(case, folder, input_ids)
    max_abs, rel = errors(ours, theirs)
    bound = peft_oracle.peft_bound(case.hf, folder, input_ids)
    assert max_abs <= bound and rel <= REL_L2, (max_abs, bound, rel)
    assert errors(case.logits, theirs)[0] > 20 * bound  # the control


def test_round_trip_keeps_a_narrowed_adapter(cases, input_ids, pg, tmp_path):
    """A folder narrowed by layers_to_transform exports (save_peft_adapter, convert --to-peft)
    as the adapter peft reads: the field's effect is kept, not dropped."""
    case = cases["qwen3_5"]
    folder = _edited(case, tmp_path, layers_to_transform=[0, 3])
    model = load_peft_adapter(load_hf_model(case.hf), folder)
    save_peft_adapter(model, tmp_path / "out")
    theirs, _ = peft_oracle.peft_logits(case.hf, folder, input_ids)
    again, _ = peft_oracle.peft_logits(case.hf, tmp_path / "out", input_ids)
    assert torch.equal(again, theirs)
    names = load_file(tmp_path / "out" / WEIGHTS)
    assert names and all(".layers.0." in n or ".layers.3." in n for n in names)


#: Refused fields: (field, value, what the message names).
REFUSED = [
    ("use_dora", True, "use_dora.*DoRA"),
    ("lora_bias", True, "lora_bias"),
    ("bias", "all", "bias='all'.*biases"),
    ("bias", "lora_only", "bias='lora_only'"),
    ("modules_to_save", ["lm_head"], "modules_to_save.*full trained copies"),
    ("layer_replication", [[0, 2], [1, 4]], "layer_replication"),
    ("trainable_token_indices", [1, 2], "trainable_token_indices"),
    ("alora_invocation_tokens", [5, 7], "alora_invocation_tokens.*invocation tokens"),
    ("use_qalora", True, "use_qalora"),
    ("velora_config", {"rank": 2}, "velora_config.*VeLoRA"),
    ("monteclora_config", {"num_samples": 2}, "monteclora_config"),
    ("use_bdlora", {"nblocks": 2}, "use_bdlora.*BD-LoRA"),
    ("arrow_config", {"top_k": 2}, "arrow_config"),
    ("kasa_config", {"rank": 2}, "kasa_config.*KaSA"),
    ("megatron_config", {"hidden_size": 64}, "megatron_config.*megatron-specific"),
    ("megatron_core", "my_megatron.core", "megatron_core.*megatron-specific"),
    ("ensure_weight_tying", True, "ensure_weight_tying"),
    ("init_lora_weights", "pissa", "init_lora_weights.*changes the base"),
    ("init_lora_weights", "olora", "init_lora_weights.*changes the base"),
    ("task_type", "SEQ_CLS", "task_type.*CAUSAL_LM"),
    ("peft_type", "IA3", "peft_type 'IA3'"),
    ("a_field_of_peft_0_99", 1, r"unknown field\(s\) \['a_field_of_peft_0_99'\]"),
    ("target_modules", "all-linear", "'all-linear' is resolved by peft"),
    ("target_parameters", "mlp.gate_proj.weight", "target_parameters must be a list"),
    ("layers_pattern", "layers", "layers_pattern needs layers_to_transform"),
    ("lora_alpha", 0, "lora_alpha=0"),
    ("r", 0, "r=0 is not a rank"),
]


@pytest.mark.parametrize(
    "field, value, message", REFUSED, ids=[f"{f}={v!r}"[:40] for f, v, _ in REFUSED]
)
def test_refused_field_is_named(field, value, message, cases, tmp_path):
    """The config is read first, before any model is touched (load_peft_adapter's first step)."""
    folder = _edited(cases["qwen3_5"], tmp_path, **{field: value})
    with pytest.raises(PeftAdapterError, match=message) as caught:
        read_adapter_config(folder)
    assert str(folder / CONFIG) in str(caught.value)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("alora_invocation_tokens", [5, 7], "alora_invocation_tokens.*invocation tokens"),
        ("rank_pattern", {"q_proj": 8}, "give model.layers.3.self_attn.q_proj rank 8"),
        ("alpha_pattern", {"layers.0.linear_attn.out_proj": 3}, "alpha 3"),
    ],
    ids=["alora", "rank_pattern", "alpha_pattern"],
)
def test_load_refuses_by_name(field, value, message, cases, pg, tmp_path):
    case = cases["qwen3_5"]
    folder = _edited(case, tmp_path, **{field: value})
    with pytest.raises(PeftAdapterError, match=message):
        load_peft_adapter(load_hf_model(case.hf), folder)


def test_every_peft_field_has_a_rule():
    """The table covers peft 0.21.2's LoraConfig exactly (a new peft field fails here)."""
    from dataclasses import fields

    from peft import LoraConfig

    assert {f.name for f in fields(LoraConfig)} == set(FIELDS)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(target_modules=["qq_proj"]), "match no module"),
        (dict(target_modules=r"decoder\..*"), "match no module"),
        (dict(target_modules=["q_proj"], exclude_modules=["q_proj"]), "match no module"),
        (dict(target_modules=r".*proj", layers_to_transform=[0]), "cannot be used when"),
    ],
    ids=["unknown_name", "regex_of_nothing", "all_excluded", "layers_with_regex"],
)
def test_folders_peft_refuses_are_refused(fields, message, cases, pg, tmp_path):
    case = cases["qwen3_5"]
    folder = _edited(case, tmp_path, **fields)
    with pytest.raises(ValueError):  # peft itself
        peft_oracle.peft_logits(case.hf, folder, torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(PeftAdapterError, match=message):
        load_peft_adapter(load_hf_model(case.hf), folder)


@pytest.mark.parametrize(
    "targets", [["embed_tokens"], ["lm_head", "q_proj"], [".*norm"], ["mlp"]],
    ids=["embedding", "output_layer", "regex_text_in_a_list", "container"],
)  # fmt: skip
def test_targets_this_package_does_not_adapt_are_refused(targets, cases, pg, tmp_path):
    case = cases["qwen3_5"]
    folder = _edited(case, tmp_path, target_modules=targets)
    pattern = "not linears of the model's layers|match no module"
    with pytest.raises(PeftAdapterError, match=pattern):
        load_peft_adapter(load_hf_model(case.hf), folder)


def test_targets_without_tensors_are_refused(cases, pg, tmp_path):
    case = cases["qwen3_5"]
    folder = _edited(case, tmp_path)
    tensors = load_file(folder / WEIGHTS)
    save_file(
        {n: t for n, t in tensors.items() if "q_proj" not in n}, folder / WEIGHTS, {"format": "pt"}
    )
    with pytest.raises(PeftAdapterError, match="holds no tensors for.*q_proj"):
        load_peft_adapter(load_hf_model(case.hf), folder)


def test_dropout_with_target_parameters_is_refused_as_peft_does(cases, pg, tmp_path):
    case = cases["qwen3_5_moe"]
    folder = _edited(case, tmp_path, lora_dropout=0.1)
    with pytest.raises(ValueError, match="lora_dropout"):  # peft itself
        peft_oracle.peft_logits(case.hf, folder, torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(PeftAdapterError, match="lora_dropout=0.1 with target_parameters"):
        load_peft_adapter(load_hf_model(case.hf), folder)


def test_targets_peft_moves_to_the_experts_are_refused(cases, pg, tmp_path):
    """Qwen3-Next: peft 0.21 turns gate_proj/up_proj into the experts' gate_up_proj."""
    case = cases["qwen3_next"]
    folder = _edited(case, tmp_path, target_modules=["q_proj", "gate_proj", "up_proj"])
    with pytest.raises(PeftAdapterError, match=r"\['gate_proj', 'up_proj'\].*routed experts"):
        load_peft_adapter(load_hf_model(case.hf), folder)


def test_per_expert_tensors_are_refused(cases, pg, tmp_path):
    """peft 0.21 drops per-expert names on transformers 5 models: refused, not read."""
    case = cases["qwen3_5_moe"]
    model = load_peft_adapter(load_hf_model(case.hf), case.adapter)
    save_peft_adapter(model, tmp_path / "per_expert", format="per_expert")
    with pytest.raises(PeftAdapterError, match="routed experts one by one.*3-D parameter"):
        load_peft_adapter(load_hf_model(case.hf), tmp_path / "per_expert")


@pytest.mark.parametrize(
    "content, message",
    [
        (b'{"r": 4,\n "lora_alpha": 8,\n "target_modules": [q_proj]}', "line 3 column 21"),
        (b'{"r": 4}\n\xff\xfe', "line 2 is not UTF-8"),
        (b'[{"r": 4}]', "holds a JSON list"),
    ],
    ids=["not_json", "not_utf8", "a_list"],
)
def test_broken_config_names_the_file(content, message, cases, pg, tmp_path):
    case = cases["qwen3_5"]
    folder = _edited(case, tmp_path)
    (folder / CONFIG).write_bytes(content)
    with pytest.raises(PeftAdapterError, match=message) as caught:
        load_peft_adapter(load_hf_model(case.hf), folder)
    assert str(folder / CONFIG) in str(caught.value)
