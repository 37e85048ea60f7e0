"""Megatron-LM integration: grouped and repeated patterns in a ``megatron.training`` script.

megatron-core 0.19.2's ``megatron.training`` validates ``--hybrid-layer-pattern`` with its own
grammar, which knows no ``[...]`` groups, ``{N}`` repetition or ``(...)`` runs.
:func:`parse_and_validate_args` therefore hands megatron's validation the *flattened* pattern
(same physical layers, ``|`` stages and ``/`` MTP depths, so ``num_layers``, the virtual
pipeline size and ``mtp_num_layers`` come out right), keeps the real pattern in
``args.megatron_hybrid_layer_pattern`` and then clears ``args.hybrid_layer_pattern``. With it
cleared, megatron.training's checkpoint loader treats the run like a GPT run: it does not refuse
this package's own checkpoints as "saved by a hybrid model run", and a GPT checkpoint loads into
a grouped model as it is (the keys match). Side effects: Megatron-LM's FLOP estimate uses the GPT
formula, and its MoE metrics divide by the physical layer count. Nothing in megatron-core is
edited.

A pretraining script needs these lines (this module's :func:`main` is such a script)::

    from megatron.core.enums import ModelType
    from megatron.training import pretrain
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron_hybrid.training import megatron_lm

    args = megatron_lm.parse_and_validate_args()
    pretrain(pretrain_cfg_container_from_args(args), megatron_lm.datasets_provider,
             ModelType.encoder_or_decoder, megatron_lm.forward_step,
             model_provider=megatron_lm.model_provider)

Run it like any Megatron-LM script, e.g. ``torchrun --nproc_per_node 2 -m
megatron_hybrid.training.megatron_lm --hybrid-layer-pattern '[*E]{4}' --num-experts 8 ...``.
Requires Python >= 3.12 (``megatron.training`` 0.19.2 does not import on 3.11).

Data comes as ``pretrain_gpt.py`` builds it: megatron-core's ``GPTDataset`` from Megatron-LM's
``--data-path`` / ``--split`` (or ``--train-data-path`` ...), ``--data-cache-path`` and tokenizer
flags, blended by ``BlendedMegatronDatasetBuilder`` (the data set class is
:class:`~megatron_hybrid.data.gpt.DocumentGPTDataset`, which also applies the loss masks
``prepare-data`` stores beside chat data). ``--mock-data`` trains on the package's synthetic
tokens instead; without either the script stops with a message.

The functions here take Megatron-LM's own argparse namespace (``get_args()``; its API, with
hundreds of flags of its own), not the package's typed
:class:`~megatron_hybrid.training.train_settings.TrainSettings`, which the package's commands make
at their edge.
"""

from __future__ import annotations

import sys

import torch

from megatron_hybrid.data.files import check_prefix
from megatron_hybrid.data.gpt import (
    DEFAULT_SPLIT,
    build_gpt_datasets,
    empty_split,
    gpt_dataset_config,
)
from megatron_hybrid.data.synthetic import SyntheticSamples, SyntheticTokens
from megatron_hybrid.model import HybridModel
from megatron_hybrid.modules import hybrid_stack_spec
from megatron_hybrid.pattern import ParsedPattern, parse_pattern
from megatron_hybrid.schedule.steps import lm_forward_step
from megatron_hybrid.training.arguments import (
    MEGATRON_LM_GROUPS,
    add_hybrid_args,
    required_pattern,
    spec_backend,
)

__all__ = [
    "SyntheticLMDataset",
    "check_fused_kernels",
    "datasets_from_args",
    "datasets_provider",
    "flatten_for_megatron",
    "forward_step",
    "main",
    "model_provider",
    "parse_and_validate_args",
    "tokenizer_vocab_size",
]


def flatten_for_megatron(pattern: str | ParsedPattern) -> str:
    """The pattern in megatron-core's own grammar: groups dissolved, repetition expanded.

    >>> flatten_for_megatron("[*-]{2}|[*E]{2}/*E")
    '*-*-|*E*E/*E'
    """
    return parse_pattern(pattern).flat


def parse_and_validate_args(extra_args_provider=None, args_defaults=None):
    """Megatron-LM's ``parse_and_validate_args``, accepting the package's pattern grammar.

    Args:
        extra_args_provider: more ``parser -> parser`` flags of the script.
        args_defaults: defaults as for megatron's ``validate_args``.

    Returns:
        The validated args, also installed as megatron's global args.
    """
    from megatron.training import arguments as megatron_args
    from megatron.training.global_vars import set_global_variables

    def provider(parser):
        parser = add_hybrid_args(parser, MEGATRON_LM_GROUPS)
        return extra_args_provider(parser) if extra_args_provider else parser

    args = megatron_args.parse_args(provider)
    parsed = required_pattern(args)
    if parsed.mtp_num_depths and args.position_embedding_type != "rope":
        # megatron.training defaults to learned_absolute; the MTP block applies RoPE.
        raise ValueError(
            f"the pattern's MTP part needs --position-embedding-type rope (got "
            f"{args.position_embedding_type})"
        )
    args.megatron_hybrid_layer_pattern = parsed.canonical
    args.hybrid_layer_pattern = flatten_for_megatron(parsed)
    megatron_args.validate_args(args, args_defaults or {})
    check_fused_kernels(args)
    # Keys of this package's models are already GPT's (grouped) or megatron-core's (ungrouped):
    # megatron.training must neither translate GPT checkpoints nor reject them as non-hybrid.
    args.hybrid_layer_pattern = None
    set_global_variables(args)
    return args


def check_fused_kernels(args) -> None:
    """Refuse, before the model is built, a fused kernel that megatron-core would import mid-run.

    Megatron-LM turns ``--masked-softmax-fusion`` on by default. With ``--transformer-impl
    local`` megatron-core's ``FusedScaleMaskSoftmax`` then imports the
    ``scaled_masked_softmax_cuda`` extension inside the first forward pass; the megatron-core
    wheel does not ship it.

    Raises:
        ValueError: the fusion is on, the ``local`` implementation is chosen and the extension is
            not installed.
    """
    if args.transformer_impl != "local" or not getattr(args, "masked_softmax_fusion", False):
        return
    import importlib.util

    if importlib.util.find_spec("scaled_masked_softmax_cuda") is None:
        raise ValueError(
            "--masked-softmax-fusion (Megatron-LM's default) needs the scaled_masked_softmax_cuda "
            "extension, which is not installed: pass --no-masked-softmax-fusion, build "
            "Megatron-LM's fused kernels, or use --transformer-impl transformer_engine"
        )


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None,
                   pg_collection=None):  # fmt: skip
    """Build this rank's :class:`~megatron_hybrid.HybridModel` chunk (megatron's callback)."""
    from megatron.training import get_args
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    config = config or core_transformer_config_from_args(args)
    backend = spec_backend(args)
    return HybridModel(
        config,
        hybrid_stack_spec(backend, config=config, mamba_impl=getattr(args, "mamba_impl", "auto")),
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        hybrid_layer_pattern=args.megatron_hybrid_layer_pattern,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        hybrid_cuda_graphs=getattr(args, "hybrid_cuda_graphs", False),
        real_vocab_size=tokenizer_vocab_size(args),
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
        pg_collection=pg_collection,
        vp_stage=vp_stage,
    )


def tokenizer_vocab_size(args) -> int:
    """The real vocabulary of a Megatron-LM run: ``--vocab-size`` if given, else the
    tokenizer's. ``args.padded_vocab_size`` (the model's rows) pads it to a multiple of
    ``--make-vocab-size-divisible-by`` x TP; log-probs must leave those rows out."""
    if getattr(args, "vocab_size", None):
        return int(args.vocab_size)
    from megatron.training import get_tokenizer

    return int(get_tokenizer().vocab_size)


class SyntheticLMDataset(torch.utils.data.Dataset):
    """The package's synthetic variable-length data as fixed-length samples (pads masked)."""

    def __init__(
        self, num_samples: int, seq_length: int, vocab_size: int, seed: int, split: str = "train"
    ):
        self.num_samples = num_samples
        self.seq_length = seq_length
        tokens = SyntheticTokens(vocab_size=vocab_size, max_length=seq_length, seed=seed)
        self.samples = SyntheticSamples(tokens, split)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        sequence = self.samples.sample(int(index)).tokens
        length = len(sequence) - 1
        tokens = torch.zeros(self.seq_length + 1, dtype=torch.long)
        tokens[: length + 1] = sequence
        real = torch.arange(self.seq_length) < length
        return dict(
            input_ids=tokens[:-1],
            labels=tokens[1:],
            loss_mask=real.float(),
            padding_mask=~real,
            position_ids=torch.arange(self.seq_length),
        )


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    """megatron's data-provider callback: :func:`datasets_from_args` of the global args."""
    from megatron.training import get_args

    return datasets_from_args(get_args(), train_val_test_num_samples)


def _blends(args):
    """``(blend, blend_per_split)`` of Megatron-LM's data flags, as its
    ``get_blend_and_blend_per_split`` reads them (megatron-core's ``get_blend_from_list``)."""
    import json

    from megatron.core.datasets.utils import get_blend_from_list

    if getattr(args, "data_args_path", None):
        with open(args.data_args_path) as stream:
            return get_blend_from_list(stream.read().split()), None
    if getattr(args, "data_path", None):
        return get_blend_from_list(args.data_path), None
    if getattr(args, "per_split_data_args_path", None):
        with open(args.per_split_data_args_path) as stream:
            per_split = json.load(stream)
        return None, [
            get_blend_from_list(
                per_split[split].split() if isinstance(per_split[split], str) else per_split[split]
            )
            for split in ("train", "valid", "test")
        ]
    paths = [getattr(args, f"{split}_data_path", None) for split in ("train", "valid", "test")]
    if any(path is not None for path in paths):
        return None, [get_blend_from_list(path) for path in paths]
    return None, None


def datasets_from_args(args, train_val_test_num_samples) -> tuple:
    """Train/valid/test datasets of Megatron-LM's flags, built as ``pretrain_gpt.py`` builds
    them (its ``core_gpt_dataset_config_from_args``): the tokenizer from its tokenizer flags
    (megatron-core's ``build_tokenizer``), ``GPTDatasetConfig`` from the data flags, and
    ``BlendedMegatronDatasetBuilder``; ``--mock-data``: the package's synthetic tokens.

    Raises:
        ValueError: neither data flags nor ``--mock-data``.
    """
    if getattr(args, "mock_data", False):
        vocab = args.padded_vocab_size
        # One chain; each split draws its own sequences of it (validation measures what the
        # training split teaches).
        return tuple(
            SyntheticLMDataset(max(int(n), 1), args.seq_length, vocab, args.seed, split)
            for split, n in zip(("train", "valid", "test"), train_val_test_num_samples, strict=True)
        )
    blend, blend_per_split = _blends(args)
    if blend is None and blend_per_split is None:
        raise ValueError(
            "no training data: pass --data-path PREFIX ... (Megatron data sets, e.g. from "
            "python -m megatron_hybrid prepare-data) or --mock-data for synthetic tokens"
        )
    if blend is not None:  # a split without documents would make megatron-core loop forever
        for prefix in blend[0]:
            problem = empty_split(check_prefix(prefix), args.split or DEFAULT_SPLIT)
            if problem:
                raise ValueError(problem)
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    config = gpt_dataset_config(
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        seq_length=args.seq_length,
        seed=args.seed,
        tokenizer=build_tokenizer(args),
        multiple_validation_sets=getattr(args, "multiple_validation_sets", None),
        full_validation=getattr(args, "full_validation", None),
        num_dataset_builder_threads=getattr(args, "num_dataset_builder_threads", 1),
        path_to_cache=args.data_cache_path,
        mmap_bin_files=getattr(args, "mmap_bin_files", True),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=getattr(args, "mid_level_dataset_surplus", 0.005),
        allow_ambiguous_pad_tokens=getattr(args, "allow_ambiguous_pad_tokens", False),
    )
    return tuple(build_gpt_datasets(config, train_val_test_num_samples))


# Every rank builds the (deterministic) data itself: no broadcast from TP rank 0 needed.
datasets_provider.is_distributed = True


class _OnDevice:
    def __init__(self, iterator):
        self.iterator = iterator

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.iterator)
        if "tokens" in batch:  # a GPTDataset sample: the forward step reads input_ids
            batch["input_ids"] = batch.pop("tokens")
        device = torch.cuda.current_device()
        return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """megatron's forward-step callback (``return_schedule_plan`` for EP overlap)."""
    iterator = _OnDevice(data_iterator) if data_iterator is not None else None
    return lm_forward_step(iterator, model, return_schedule_plan=return_schedule_plan)


def _use_prebuilt_dataset_helpers() -> None:
    """Skip megatron.training's ``make`` of the dataset helpers when the wheel's build is there.

    ``initialize_megatron`` always runs ``make`` in ``megatron/core/datasets``; the megatron-core
    wheel ships the compiled helper but not the Makefile, so that step fails outside a
    Megatron-LM checkout although nothing needs compiling.
    """
    import importlib.util

    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
        return
    import megatron.core.datasets.utils as dataset_utils

    dataset_utils.compile_helpers = lambda: None


_PROG = "python -m megatron_hybrid.training.megatron_lm"
_NEEDS_312 = (
    "megatron.training 0.19.2 needs Python >= 3.12 (it imports typing.override); set up a 3.12 "
    "environment with: PYTHON=python3.12 bash scripts/setup.sh"
)


def _without_megatron_training(argv: list[str], error: ImportError) -> int:
    """``--help`` (this package's flags) or one clear line where megatron.training cannot load."""
    import argparse

    if "-h" in argv or "--help" in argv:
        parser = argparse.ArgumentParser(
            prog=_PROG,
            description="Megatron-LM's pretrain() with hybrid layer patterns. Megatron-LM's own "
            f"flags are not listed: {_NEEDS_312}.",
        )
        add_hybrid_args(parser, MEGATRON_LM_GROUPS)
        parser.print_help()
        return 0
    print(
        f"{_PROG}: error: cannot import megatron.training ({error}); {_NEEDS_312}", file=sys.stderr
    )
    return 2


def main(argv: list[str] | None = None) -> int:
    """Pretrain with Megatron-LM's loop; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        from megatron.training import pretrain
    except ImportError as error:
        return _without_megatron_training(argv, error)
    from megatron.core.enums import ModelType
    from megatron.training.argument_utils import pretrain_cfg_container_from_args

    _use_prebuilt_dataset_helpers()
    args = parse_and_validate_args()
    pretrain(
        pretrain_cfg_container_from_args(args),
        datasets_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        model_provider=model_provider,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
