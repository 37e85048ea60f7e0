"""The ``generation_config.json`` an export writes for a source without one holds the token ids
transformers derives from the config.json (``GenerationConfig.from_model_config``), also where a
multimodal config.json's top level holds them as nulls and its ``text_config`` the values."""

from __future__ import annotations

import pytest

from megatron_hybrid.hf.export import _GENERATION_FIELDS, generation_config

CASES = {
    "text-only": ("qwen3_next", dict(bos_token_id=3, eos_token_id=4, pad_token_id=2), {}),
    "multimodal": ("qwen3_5", dict(text_config=dict(bos_token_id=5, eos_token_id=7)), {}),
    # A config.json with the top-level ids written as nulls (as older exports write them).
    "multimodal-nulls-on-top": (
        "qwen3_5",
        dict(text_config=dict(bos_token_id=5, eos_token_id=7)),
        dict(bos_token_id=None, eos_token_id=None),
    ),
}


def _configs(case: str, tmp_path):
    """The case's config.json as a dict, and the ids transformers derives from that file."""
    import json

    from transformers import AutoConfig, GenerationConfig

    family, fields, on_top = CASES[case]
    AutoConfig.for_model(family, **fields).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    written = {**json.loads(path.read_text()), **on_top}
    path.write_text(json.dumps(written))
    oracle = GenerationConfig.from_model_config(AutoConfig.from_pretrained(tmp_path))
    derived = oracle.to_diff_dict()
    return written, {k: v for k, v in derived.items() if k in _GENERATION_FIELDS}


@pytest.mark.parametrize("case", list(CASES))
def test_token_ids_are_transformers(case, tmp_path):
    config, oracle = _configs(case, tmp_path)
    assert oracle  # the case has ids to carry
    ours = generation_config(config)
    assert ours.pop("_from_model_config") is True
    assert ours == oracle


def test_negative_control_a_null_on_top_hides_the_text_configs_ids(tmp_path):
    """The lookup that read a top-level null as a value (``config.get(field, text[field])``)."""
    config, oracle = _configs("multimodal-nulls-on-top", tmp_path)
    assert all(config.get(field, 0) is None for field in oracle)  # the nulls are there
    text = config["text_config"]
    wrong = {f: config.get(f, text.get(f)) for f in _GENERATION_FIELDS}
    assert {f: v for f, v in wrong.items() if v is not None} != oracle
