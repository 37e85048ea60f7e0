"""``PolicyTrainer``: a policy-gradient step on packed sequences, log-probs and weight sync.

Over the model chunks :func:`~megatron_hybrid.hf.load_hf_model` returns (LoRA models included:
only the adapters train), wrapped in megatron's ``DistributedDataParallel`` and stepped by its
(distributed) optimizer exactly as ``train`` wraps and steps them
(:func:`~megatron_hybrid.training.loop.wrap_model_chunks`,
:func:`~megatron_hybrid.training.optimizers.build_optimizer`). A step packs the sequences into THD
micro-batches through the padding planners (padded rows where a layer type cannot pack;
:func:`~megatron_hybrid.logprobs.batches.plan_micro_batches`), runs them through megatron-core's
schedule (no pipelining, PP or interleaved VPP) with the policy loss of
:mod:`megatron_hybrid.rl.losses` as the loss function
(:func:`~megatron_hybrid.training.loop.train_step` with
:func:`~megatron_hybrid.rl.forward_step.policy_forward_step`), and applies
one optimizer step.

The loss is exact over the global batch: each micro-batch's loss function returns megatron's
per-token three-tuple ``(sum of weighted token losses, count, report)``; with
``calculate_per_token_loss`` the schedule adds the counts over micro-batches, megatron's DDP sums
gradients over data-parallel ranks and ``finalize_model_grads`` divides them by the count summed
over every data-parallel rank (megatron-core 0.19.2, ``pipeline_parallel/schedules.py``,
``forward_step_calc_loss``; ``distributed/finalize_model_grads.py``, ``finalize_model_grads``).
So ``token-mean`` divides by the loss-masked tokens of the whole global batch, and the sequence
means by its sequences, whatever the micro-batching and data-parallel size.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from functools import partial

import torch

from megatron_hybrid.hf.stream import iter_hf_weights
from megatron_hybrid.hf.weights import model_chunks
from megatron_hybrid.logprobs import DEFAULT_MAX_TOKENS
from megatron_hybrid.logprobs.batches import (
    MicroBatch,
    agree,
    check_sequences,
    plan_micro_batches,
    replica_error,
)
from megatron_hybrid.logprobs.forward import choose_packed, forward_logprobs, model_device
from megatron_hybrid.logprobs.vocab import check_temperature
from megatron_hybrid.padding import padding_config_from
from megatron_hybrid.rl.forward_step import POLICY_LOSS, micro_batch_loss, policy_forward_step
from megatron_hybrid.rl.losses import PolicyLoss, sequence_weights
from megatron_hybrid.training.loop import train_step, wrap_model_chunks
from megatron_hybrid.training.optimizers import build_optimizer, check_optimizer

__all__ = ["PolicyTrainer", "StepMetrics", "TrainerSettings"]


@dataclass(frozen=True)
class TrainerSettings:
    """What a :class:`PolicyTrainer` is built with (its constructor's keywords), checked.

    Attributes:
        lr: learning rate.
        optimizer: ``"adam"`` (megatron's AdamW) or ``"sgd"`` (no momentum).
        weight_decay: decoupled (adam) or L2 (sgd) weight decay.
        clip_grad: global gradient-norm clip (0: none).
        moe_aux_loss_coeff: the MoE load-balancing loss's weight; None: off, so that a step is
            exactly the policy loss.
        temperature: the sampling temperature the log-probs are for (logits / temperature).
    """

    lr: float
    optimizer: str = "adam"
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    moe_aux_loss_coeff: float | None = None
    temperature: float = 1.0

    def __post_init__(self) -> None:
        check_optimizer(self.optimizer)
        numbers = dict(lr=self.lr, weight_decay=self.weight_decay, clip_grad=self.clip_grad)
        if self.moe_aux_loss_coeff is not None:
            numbers["moe_aux_loss_coeff"] = self.moe_aux_loss_coeff
        for name, value in numbers.items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{name} must be a number, got {value!r}")
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        check_temperature(self.temperature)


@dataclass(frozen=True)
class StepMetrics:
    """What one :meth:`PolicyTrainer.step` did (the same on every rank).

    ``policy_loss``, ``kl`` and ``entropy`` are aggregated as the loss is (``loss_agg``), so
    ``loss = policy_loss + kl_coef * kl - entropy_coef * entropy``; ``kl`` is 0 without
    ``ref_logprobs``. ``clip_fraction`` is over the loss-masked tokens, ``tokens`` counts the
    real tokens of the global batch and ``loss_tokens`` its loss-masked ones. ``skipped`` says
    what was NaN or infinite when the optimizer was not stepped (None: it was).
    """

    loss: float
    policy_loss: float
    kl: float
    entropy: float
    clip_fraction: float
    grad_norm: float
    tokens: int
    loss_tokens: int
    skipped: str | None = None

    def as_dict(self) -> dict:
        """The metrics as a plain dict (for loggers)."""
        return asdict(self)


def _configure_for_policy(inner: list, config, settings: TrainerSettings) -> None:
    """The model's MoE settings for a step that is exactly the policy loss.

    Per-token loss (routers read the flag when built, so it is set on them too); the
    load-balancing and z losses off unless ``moe_aux_loss_coeff`` is given; an aux-loss-free
    router's expert bias frozen (megatron-core's ``finalize_model_grads`` would move it every
    step, routing rollouts differently from the weights the engine gets).
    """
    config.calculate_per_token_loss = True
    config.moe_aux_loss_coeff = settings.moe_aux_loss_coeff or 0.0
    if settings.moe_aux_loss_coeff is None:
        config.moe_z_loss_coeff = None
    for chunk in inner:
        for module in chunk.modules():
            if hasattr(module, "calculate_per_token_loss"):
                module.calculate_per_token_loss = True
            if hasattr(module, "expert_bias"):
                module.frozen_expert_bias = True


def _per_token(name: str, values, tokens: list[torch.Tensor], *, scalars: bool = False):
    """``values`` as float32 CPU tensors of ``len(seq) - 1`` each, or an error message."""
    if torch.is_tensor(values) or not isinstance(values, Sequence) or len(values) != len(tokens):
        got = f"{len(values)} entries" if isinstance(values, Sequence) else type(values).__name__
        return f"{name} must be a list of one tensor per sequence ({len(tokens)}), got {got}"
    out = []
    for i, (value, seq) in enumerate(zip(values, tokens, strict=True)):
        want = len(seq) - 1
        tensor = torch.as_tensor(value).detach().to("cpu", torch.float32)
        if scalars and tensor.dim() == 0:
            tensor = tensor.expand(want)
        if tensor.shape != (want,):
            return (
                f"{name}[{i}] has shape {tuple(tensor.shape)}; sequence {i} has {len(seq)} tokens, "
                f"so it needs {want} values (entry j for token j + 1)"
                + (" or one number" if scalars else "")
            )
        out.append(tensor)
    return out


def _loss_masks(values, tokens) -> list[torch.Tensor] | str:
    masks = _per_token("loss_masks", values, tokens)
    if isinstance(masks, str):
        return masks
    for i, mask in enumerate(masks):
        if not bool(((mask == 0) | (mask == 1)).all()):
            return f"loss_masks[{i}] holds values other than 0 and 1 (or True and False)"
    return masks


def _rows(values: list[torch.Tensor], batch: MicroBatch) -> torch.Tensor:
    """Per-sequence values placed at the output rows that predict their tokens."""
    rows = torch.zeros(batch.labels.numel(), dtype=torch.float32)
    if batch.spans:
        rows.index_copy_(0, batch.span_rows, torch.cat([values[i] for i, _, _ in batch.spans]))
    return rows


class PolicyTrainer:
    """A policy-gradient trainer over a model's chunks (see the module doc).

    Args:
        model: what ``load_hf_model`` returned on this rank (a HybridModel, or its list of
            chunks under virtual pipeline parallelism), with LoRA adapters or without; not
            wrapped in DDP yet.
        optimizer: ``"adam"`` or ``"sgd"`` (no momentum: with ``clip_grad=0.0`` one step is
            exactly ``w - lr * grad``).
        lr, weight_decay, clip_grad, moe_aux_loss_coeff, temperature: see
            :class:`TrainerSettings`.

    Raises:
        ValueError: bad settings, a model already wrapped, without trainable parameters, with
            context parallelism, MTP layers or the EP-overlap schedule.
    """

    def __init__(
        self,
        model,
        *,
        optimizer: str = "adam",
        lr: float,
        weight_decay: float = 0.0,
        clip_grad: float = 1.0,
        moe_aux_loss_coeff: float | None = None,
        temperature: float = 1.0,
    ) -> None:
        from megatron.core.distributed import DistributedDataParallel
        from megatron.core.utils import get_model_config

        self.settings = TrainerSettings(
            lr=lr,
            optimizer=optimizer,
            weight_decay=weight_decay,
            clip_grad=clip_grad,
            moe_aux_loss_coeff=moe_aux_loss_coeff,
            temperature=temperature,
        )
        given = list(model) if isinstance(model, list | tuple) else [model]
        if any(isinstance(chunk, DistributedDataParallel) for chunk in given):
            raise ValueError(
                "PolicyTrainer: the model is already wrapped in DistributedDataParallel; pass "
                "the model load_hf_model returned (the trainer wraps it)"
            )
        inner = model_chunks(given)
        config = get_model_config(inner[0])
        pg = inner[0].pg_collection
        if pg.cp.size() > 1:
            raise ValueError(
                "PolicyTrainer: context parallelism is not supported; load the model with "
                "context_parallel_size=1"
            )
        if getattr(config, "mtp_num_layers", None):
            raise ValueError(
                "PolicyTrainer: the model has multi-token-prediction layers, which the policy "
                "loss does not train; load it with load_hf_model(..., mtp=False)"
            )
        if getattr(config, "overlap_moe_expert_parallel_comm", False):
            raise ValueError(
                "PolicyTrainer: overlap_moe_expert_parallel_comm is not supported; build the "
                "model without it"
            )
        if not any(p.requires_grad for chunk in inner for p in chunk.parameters()):
            raise ValueError("PolicyTrainer: the model has no parameter that requires a gradient")
        _configure_for_policy(inner, config, self.settings)
        for chunk in inner:
            chunk.train()
        self.model = inner if len(inner) > 1 else inner[0]
        self.config = config
        self.pg = pg
        self.chunks = wrap_model_chunks(inner, config, pg, optimizer=self.settings.optimizer)
        self.optimizer = build_optimizer(
            self.chunks,
            config,
            lr=self.settings.lr,
            weight_decay=self.settings.weight_decay,
            clip_grad=self.settings.clip_grad,
            pg=pg,
            optimizer=self.settings.optimizer,
        )
        self.vocab_size = inner[0].vocab_size
        self.packed = choose_packed(inner[0], config, None)
        self.device = model_device(inner)

    def logprobs(
        self,
        sequences: Sequence[torch.Tensor],
        *,
        with_entropy: bool = False,
        max_tokens_per_micro_batch: int = DEFAULT_MAX_TOKENS,
    ):
        """Log-probs (and entropies) of ``sequences`` under the current weights, forward only:
        ``forward_logprobs`` at the trainer's temperature (same arguments and results)."""
        return forward_logprobs(
            self.model,
            sequences,
            max_tokens_per_micro_batch=max_tokens_per_micro_batch,
            temperature=self.settings.temperature,
            with_entropy=with_entropy,
        )

    def iter_hf_weights(self, **kwargs):
        """``iter_hf_weights`` of the current weights, for the inference engine (collective:
        every rank iterates). ``merge_lora=True`` streams LoRA models' merged weights,
        ``quantize="fp8"`` FP8 ones; see :func:`megatron_hybrid.hf.iter_hf_weights`."""
        return iter_hf_weights(self.model, **kwargs)

    def step(
        self,
        sequences: Sequence[torch.Tensor],
        *,
        loss_masks,
        advantages,
        old_logprobs=None,
        ref_logprobs=None,
        clip_eps: float = 0.2,
        clip_eps_high: float | None = None,
        kl_coef: float = 0.0,
        entropy_coef: float = 0.0,
        loss_agg: str = "token-mean",
        max_tokens_per_micro_batch: int = DEFAULT_MAX_TOKENS,
    ) -> StepMetrics:
        """One optimizer step on the policy loss of ``sequences`` (collective).

        Every rank of a model replica (its TP x PP group) passes the same sequences;
        data-parallel replicas pass their own share of the global batch. Per-token inputs are
        lists with one tensor of ``len(seq) - 1`` values per sequence (entry ``j`` for token
        ``j + 1``, as ``forward_logprobs`` returns them); an advantage may also be one number
        per sequence.

        Args:
            sequences: 1-D integer token tensors (prompt and response).
            loss_masks: 0/1 per token: which tokens the loss counts (the response's).
            advantages: ``A`` per token (or per sequence).
            old_logprobs: the log-probs the responses were sampled with (None: this step's,
                detached, so the ratio is 1).
            ref_logprobs: the reference policy's log-probs (needed when ``kl_coef`` > 0).
            clip_eps, clip_eps_high, kl_coef, entropy_coef, loss_agg: the loss
                (:mod:`megatron_hybrid.rl.losses`).
            max_tokens_per_micro_batch: tokens per micro-batch, alignment padding included.

        Returns:
            The step's :class:`StepMetrics`.

        Raises:
            ValueError: on every rank, if any rank's input is bad (the message says what and
                where) or a sequence does not fit a micro-batch; nothing is computed then.
        """
        where = "PolicyTrainer.step"
        try:
            loss = PolicyLoss(clip_eps, clip_eps_high, kl_coef, entropy_coef, loss_agg)
            error = None
        except ValueError as refused:
            loss, error = None, str(refused)
        if error is None and (
            isinstance(max_tokens_per_micro_batch, bool)
            or not isinstance(max_tokens_per_micro_batch, int)
            or max_tokens_per_micro_batch < 1
        ):
            error = (
                "max_tokens_per_micro_batch must be an int >= 1, got "
                f"{max_tokens_per_micro_batch!r}"
            )
        tokens: list[torch.Tensor] = []
        if error is None:
            error, tokens = check_sequences(sequences, self.vocab_size)
        inputs: dict = {}
        if error is None:
            error, inputs = self._inputs(tokens, loss, loss_masks, advantages, old_logprobs,
                                         ref_logprobs)  # fmt: skip
        agree(error, self.device, where)
        agree(replica_error(tokens, self.pg.mp, self.device), self.device, where)

        batches = plan_micro_batches(
            tokens,
            padding_config_from(self.config, self.pg),
            max_tokens=max_tokens_per_micro_batch,
            packed=self.packed,
            pg_collection=self.pg,
            chunks=len(self.chunks),
            device=self.device,
            where=where,
        )
        agree(
            None if batches else "no sequence has two tokens or more: nothing to train on",
            self.device,
            where,
        )
        items = [self._micro_batch(batch, tokens, inputs) for batch in batches]
        # The labels are the checked sequences' tokens: no range check (it would wait for the
        # device).
        options = dict(tp_group=self.pg.tp, temperature=self.settings.temperature,
                       vocab_size=self.vocab_size, check_labels=False)  # fmt: skip
        result = train_step(
            self.chunks,
            self.optimizer,
            items,
            self.config,
            seq_length=batches[0].seq_length,
            micro_batch_size=batches[0].rows,
            pg_collection=self.pg,
            forward_step=partial(
                policy_forward_step, loss=partial(micro_batch_loss, settings=loss, options=options)
            ),
            loss_key=POLICY_LOSS,
        )
        total, count, policy, kl, entropy, clipped, masked = result.reports[POLICY_LOSS].tolist()
        divisor = max(count, 1.0)
        return StepMetrics(
            loss=total / divisor,
            policy_loss=policy / divisor,
            kl=kl / divisor,
            entropy=entropy / divisor,
            clip_fraction=clipped / max(masked, 1.0),
            grad_norm=result.grad_norm,
            tokens=result.tokens,
            loss_tokens=int(masked),
            skipped=result.nonfinite,
        )

    def _inputs(self, tokens, loss, loss_masks, advantages, old_logprobs, ref_logprobs):
        """``(error, per-token inputs by name)``: the checked float32 CPU lists, with each
        sequence's weights and count of ``loss.loss_agg``."""
        masks = _loss_masks(loss_masks, tokens)
        if isinstance(masks, str):
            return masks, {}
        inputs = dict(
            mask=masks, advantages=_per_token("advantages", advantages, tokens, scalars=True)
        )
        for name, values in (("old", old_logprobs), ("ref", ref_logprobs)):
            inputs[name] = (
                None if values is None else _per_token(f"{name}_logprobs", values, tokens)
            )
        if loss.kl_coef and ref_logprobs is None:
            return f"kl_coef={loss.kl_coef} needs ref_logprobs (the reference policy's)", {}
        for values in inputs.values():
            if isinstance(values, str):
                return values, {}
        arguments = dict(mask="loss_masks", advantages="advantages", old="old_logprobs",
                         ref="ref_logprobs")  # fmt: skip
        for name, values in inputs.items():
            for i, value in enumerate(values or ()):
                if not bool(torch.isfinite(value[masks[i] > 0]).all()):
                    return (f"{arguments[name]}[{i}] is NaN or infinite at a loss-masked token", {})
        shares = [sequence_weights(mask, loss.loss_agg) for mask in masks]
        inputs["weights"] = [weights for weights, _ in shares]
        inputs["count"] = [count for _, count in shares]
        return None, inputs

    def _micro_batch(self, batch: MicroBatch, tokens, inputs: dict) -> dict:
        """The dict ``policy_forward_step`` reads, on the model's device."""
        device = self.device
        item = dict(batch.to(device).inputs)
        item["labels"] = item["labels"].reshape(-1)  # MicroBatch.labels' shape
        for name in ("mask", "weights", "advantages", "old", "ref"):
            values = inputs[name]
            item[name] = None if values is None else _rows(values, batch).to(device)
        count = sum(inputs["count"][i] for i, _, _ in batch.spans)
        item["count"] = torch.tensor(count, dtype=torch.int, device=device)
        item["num_tokens"] = sum(len(tokens[i]) for i, _, _ in batch.spans)
        return item
