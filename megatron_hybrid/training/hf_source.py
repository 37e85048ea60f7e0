"""``train --load-hf HF_DIR`` and ``train --load`` of a converted checkpoint: the model comes from
a Hugging Face config, the training settings from the flags.

The architecture (pattern, sizes, norms, router, RoPE, MLA/GatedDeltaNet/Mamba details) is the
conversion's. :attr:`HFSource.settings` states it in flag terms once; the run validates those
values (so a message about, say, ``--num-experts`` names the model's real value), reads them and
records them, without touching the parsed flags. The ``TransformerConfig`` is built once, from
the conversion and :func:`~megatron_hybrid.training.config.training_fields` of the flags.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from megatron_hybrid.hf.config import HFConversion, conversion_for
from megatron_hybrid.hf.dist import (
    conversion_of_checkpoint,
    load_model_state,
    read_hf_record,
    restore_hf_source,
)
from megatron_hybrid.hf.io import CONFIG_FILE
from megatron_hybrid.hf.weights import load_hf_weights, model_chunks
from megatron_hybrid.training.arguments import model_setting_dests
from megatron_hybrid.training.config import training_fields
from megatron_hybrid.training.train_settings import TrainSettings

__all__ = ["HFSource", "hf_source", "hf_training_config"]

# Flag dest -> the conversion's TransformerConfig field.
_SHAPE_FLAGS = {
    "hidden_size": "hidden_size",
    "num_attention_heads": "num_attention_heads",
    "num_query_groups": "num_query_groups",
    "kv_channels": "kv_channels",
    "ffn_hidden_size": "ffn_hidden_size",
    "num_experts": "num_moe_experts",
    "moe_router_topk": "moe_router_topk",
    "moe_ffn_hidden_size": "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
    "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank",
    "qk_head_dim": "qk_head_dim",
    "qk_pos_emb_head_dim": "qk_pos_emb_head_dim",
    "v_head_dim": "v_head_dim",
    "mamba_state_dim": "mamba_state_dim",
    "mamba_head_dim": "mamba_head_dim",
    "mamba_num_groups": "mamba_num_groups",
    "mamba_num_heads": "mamba_num_heads",
}


#: Model settings a Hugging Face config leaves to the command line: how the model is computed.
_CHOSEN_WITH_HF = frozenset({"transformer_impl"})


@dataclasses.dataclass
class HFSource:
    """Where the initial weights come from.

    Attributes:
        conversion: the model's conversion.
        hf_path: a Hugging Face folder to load the weights from (``--load-hf``), or None.
        checkpoint: a converted (weights-only) ``torch_dist`` checkpoint to load, or None; the
            run then initialises from it instead of resuming ``--load``.
        resumed: the run resumes a ``train`` checkpoint of a model that started from Hugging
            Face weights (the checkpoint records the config; the resume loads the weights).
        recorded_in: the checkpoint whose record of the Hugging Face source (stored dtypes,
            FP8 scales, carried tensors) the model takes on (a resumed run's ``--load``).
    """

    conversion: HFConversion
    hf_path: str | None = None
    checkpoint: str | None = None
    resumed: bool = False
    recorded_in: str | None = None

    @property
    def settings(self) -> dict[str, Any]:
        """The conversion's architecture as flag values (``dest`` -> value)."""
        c, m = self.conversion.config_kwargs, self.conversion.model_kwargs
        settings: dict[str, Any] = {"hybrid_layer_pattern": self.conversion.pattern.pattern}
        settings.update({dest: c[field] for dest, field in _SHAPE_FLAGS.items() if field in c})
        settings.update(
            vocab_size=m["vocab_size"],
            max_position_embeddings=m["max_sequence_length"],
            position_embedding_type=m["position_embedding_type"],
            untie_embeddings_and_output_weights=not m["share_embeddings_and_output_weights"],
            normalization=c.get("normalization", "LayerNorm"),
            swiglu=bool(c.get("gated_linear_unit", False)),
            disable_bias_linear=not c.get("add_bias_linear", True),
            qk_layernorm=bool(c.get("qk_layernorm", False)),
        )
        return settings

    def applied_to(self, args: TrainSettings) -> TrainSettings:
        """New settings: ``args`` with the model settings replaced by the conversion's.

        Raises:
            ValueError: a model flag was given that the conversion sets otherwise (or that
                this model does not have): it would be ignored, so it is refused by name.
        """
        self.check_given(args)
        return dataclasses.replace(args, **self.settings)

    @property
    def where(self) -> str:
        """The flag and path the model comes from, for messages."""
        if self.hf_path is not None:
            return f"--load-hf {self.hf_path}"
        return f"--load {self.checkpoint or self.recorded_in}"

    def check_given(self, args: TrainSettings) -> None:
        """Refuse model-shape flags given on the command line that the Hugging Face config
        decides (``--transformer-impl``, which chooses how to compute it, stays free)."""
        settings = self.settings
        wrong = []
        for dest in model_setting_dests():
            if dest not in args.given or dest in _CHOSEN_WITH_HF:
                continue
            flag, value = "--" + dest.replace("_", "-"), getattr(args, dest)
            if dest not in settings:
                wrong.append(f"{flag} (the config decides it)")
            elif value != settings[dest]:
                wrong.append(f"{flag} {value} (the model's: {settings[dest]})")
        if wrong:
            raise ValueError(
                f"{self.where} sets the model from its Hugging Face config "
                f"({self.conversion.family}), so {', '.join(wrong)} would be ignored: drop "
                f"{'it' if len(wrong) == 1 else 'them'}"
            )


def hf_source(args: TrainSettings) -> HFSource | None:
    """The Hugging Face source of a ``train`` run (``args`` is only read).

    ``--load-hf HF_DIR``, or ``--load CKPT`` where CKPT is a weights-only checkpoint written by
    ``convert --from-hf`` (an initialisation, not a resume: :attr:`HFSource.checkpoint`), or a
    ``train`` checkpoint of a model that started from Hugging Face weights.

    Raises:
        ValueError: both ``--load-hf`` and ``--load`` are given, ``--moe-grouped-gemm`` (whose
            expert keys the conversion does not map), or the config is refused.
    """
    load_hf = args.load_hf
    source = None
    if load_hf:
        if args.load:
            raise ValueError(
                "--load-hf starts from Hugging Face weights and --load resumes a checkpoint; "
                "give one of them"
            )
        source = HFSource(conversion_for(load_hf), hf_path=load_hf)
    elif args.load:
        if (Path(args.load) / CONFIG_FILE).is_file():
            raise ValueError(
                f"--load {args.load} is a Hugging Face folder ({CONFIG_FILE} and its weights), "
                f"not a checkpoint: start from it with --load-hf {args.load} (or convert it "
                f"first: convert --from-hf {args.load} --save CKPT)"
            )
        recorded = _recorded(args.load)
        if recorded.get("hf_config") is not None:
            if args.hybrid_layer_pattern:
                raise ValueError(
                    f"--load {args.load} records the Hugging Face model it trains; drop "
                    "--hybrid-layer-pattern (the model comes from the checkpoint)"
                )
            conversion = conversion_of_checkpoint(args.load)
            if recorded.get("model_only"):
                source = HFSource(conversion, checkpoint=args.load)
            else:
                source = HFSource(conversion, resumed=True, recorded_in=args.load)
    if source is not None and args.moe_grouped_gemm:
        raise ValueError(
            "--moe-grouped-gemm changes the experts' checkpoint keys, which the Hugging Face "
            "conversion does not map; leave it off with --load-hf"
        )
    return source


def _recorded(load: str) -> dict:
    """The Hugging Face record of the checkpoint ``load`` names ({} if none can be read: the
    resume logic then reports what is wrong with the checkpoint)."""
    try:
        return read_hf_record(load)
    except (OSError, ValueError):
        return {}


def hf_training_config(source: HFSource, args: TrainSettings, **overrides):
    """The conversion's TransformerConfig with :func:`training_fields` of the flags."""
    fields = training_fields(args, source.conversion.pattern)
    return source.conversion.transformer_config(**fields, **overrides)


def model_kwargs(source: HFSource) -> dict:
    """HybridModel arguments of the conversion that ``build_model_chunks`` passes through."""
    kwargs = dict(source.conversion.model_kwargs)
    for name in (
        "vocab_size",
        "max_sequence_length",
        "share_embeddings_and_output_weights",
        "position_embedding_type",
    ):
        kwargs.pop(name)
    return kwargs


def load_initial_weights(source: HFSource, chunks) -> None:
    """Copy the source's weights into the (wrapped) model chunks of this rank, with what the
    model keeps of its Hugging Face source (stored dtypes, FP8 scales, carried tensors) for the
    checkpoints it saves and the folders it exports."""
    if source.hf_path is not None:
        load_hf_weights(chunks, source.hf_path, source.conversion)
        return
    if not source.resumed:  # a resume loads the weights itself
        load_model_state(chunks, source.checkpoint)
    restore_hf_source(chunks, source.checkpoint or source.recorded_in)
    for chunk in model_chunks(chunks):
        chunk.hf_conversion = source.conversion
