"""``forward_logprobs``: next-token log-probs of many sequences, forward only, any parallel layout.

The call RL trainers make on a freshly loaded policy and on the reference model every step. The
sequences are validated, packed into THD micro-batches (padded ``[B, S]`` rows where a layer type
cannot pack, or on request) through the padding planners, run forward-only through
megatron-core's schedule (``get_forward_backward_func``: no pipelining, PP or interleaved VPP),
and reduced on the last pipeline stage to per-token log-probs (and entropies) with the
vocab-parallel functions of :mod:`megatron_hybrid.logprobs.vocab`. The results are broadcast over
the pipeline group, so every rank returns them, in input order.

Every rank of one model replica (its TP x PP group) must pass the same sequences; data-parallel
replicas may pass different ones (expert parallelism spans them: the number of micro-batches is
made equal across the world with dummy micro-batches). A bad input on any rank makes every rank
raise before the forward pass, so no rank is left waiting in a collective.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from functools import partial

import torch

from megatron_hybrid.logprobs import DEFAULT_MAX_TOKENS
from megatron_hybrid.logprobs.batches import (
    MicroBatch,
    agree,
    check_sequences,
    plan_micro_batches,
    replica_error,
)
from megatron_hybrid.logprobs.vocab import (
    check_temperature,
    token_logprobs,
    token_logprobs_and_entropy,
)
from megatron_hybrid.padding import (
    padding_config_from,
    thd_unsupported_reason_for,
)
from megatron_hybrid.padding.batch import to_device
from megatron_hybrid.schedule.steps import run_schedule

__all__ = [
    "choose_packed",
    "evaluating",
    "forward_logprobs",
    "model_device",
    "model_logits",
    "real_vocab_size",
]


def _chunks(model) -> list:
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if not chunks or not all(isinstance(c, torch.nn.Module) for c in chunks):
        raise ValueError("model must be a model chunk (torch.nn.Module) or a list of them (VPP)")
    return chunks


def real_vocab_size(model) -> int:
    """The vocabulary a model's log-probs are over: its ``real_vocab_size`` (the tokenizer's,
    where the output layer holds padding rows; set by ``HybridModel`` and checkpoints), else
    its ``vocab_size``."""
    real = getattr(model, "real_vocab_size", None)
    return model.vocab_size if real is None else real


def model_device(inner: list) -> torch.device:
    """Where the model chunks' parameters are (the current CUDA device, or the CPU)."""
    for chunk in inner:
        for param in chunk.parameters():
            return param.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"


def _has_own_train(module: torch.nn.Module) -> bool:
    return type(module).train is not torch.nn.Module.train


def _set_flag(module: torch.nn.Module, mode: bool) -> None:
    # ``training`` is a plain attribute: ``nn.Module.__setattr__`` would first look for a
    # parameter, buffer or submodule of that name (about 1.5 microseconds a module).
    object.__setattr__(module, "training", mode)


@contextlib.contextmanager
def evaluating(chunks: list) -> Iterator[None]:
    """Forward passes without gradients in eval mode (no dropout); every module's training
    flag as it was afterwards.

    Only the modules in training mode are switched, by their flag; a class with a ``train()``
    of its own (megatron-core 0.19.2's ``MambaMixer`` marks its decode cache stale there) is
    switched through it, both ways. ``Module.eval()`` on the chunks walks every module through
    a Python call: a model of 8 layers of 256 experts has about 8,000 modules, and switching
    and restoring them all that way took about 38 ms of host time per call on a CPU, against
    about 7 ms (an eval-mode model) to 9 ms (a training one) for this: one walk to read the
    flags, then only the switched ones.
    """
    modules = [module for chunk in chunks for module in chunk.modules()]
    modes = [module.training for module in modules]
    switched = [module for module, mode in zip(modules, modes, strict=True) if mode]
    own = [module for module in switched if _has_own_train(module)]
    for module in own:
        module.train(False)
    for module in switched:
        _set_flag(module, False)
    try:
        with torch.no_grad():
            yield
    finally:
        for module in own:
            module.train(True)
        # Then every flag exactly as it was (an own train() sets its whole subtree).
        for module, mode in zip(modules, modes, strict=True):
            if module.training is not mode:
                _set_flag(module, mode)


def _symbols(inner, config) -> set[str] | None:
    parsed = getattr(inner, "parsed_pattern", None)
    if parsed is None:
        return None
    return {symbol for symbol, count in parsed.layer_counts.items() if count}


def choose_packed(inner, config, packed: bool | None) -> bool:
    """Whether to pack (THD) a model chunk's input: the caller's choice ``packed``, else whenever
    every layer type packs; ``packed=True`` for a model that cannot is a ValueError."""
    symbols = _symbols(inner, config)
    if symbols is None:  # a model without a pattern (GPTModel): TE's attention packs
        reason = None if config.transformer_impl == "transformer_engine" else "local attention"
    else:
        reason = thd_unsupported_reason_for(symbols, config)
    if packed and reason:
        raise ValueError(f"forward_logprobs: packed=True, but the model cannot pack: {reason}")
    return reason is None if packed is None else bool(packed)


def _collect(batch: MicroBatch, reduce, output: torch.Tensor):
    """Loss function of the last stage: the per-token results of ``batch``'s spans, in one
    ``[parts, predictions]`` tensor."""
    logits = output.reshape(-1, output.size(-1))
    rows = to_device(batch.span_rows, logits.device)
    batch.results = torch.stack(reduce(logits, to_device(batch.labels, logits.device)))[:, rows]
    zero = torch.zeros((), device=logits.device)
    return zero, torch.ones((), dtype=torch.int, device=logits.device), {}


def model_logits(model, inputs: dict, *, gather_output: bool) -> torch.Tensor:
    """A model chunk's logits for a micro-batch's inputs (``MicroBatch.inputs``: token ids,
    positions, packed-sequence parameters, padding mask; no attention mask), vocab-parallel or
    gathered over the tensor-parallel ranks (``gather_output``)."""
    return model(
        input_ids=inputs["input_ids"],
        position_ids=inputs["position_ids"],
        attention_mask=None,
        packed_seq_params=inputs["packed_seq_params"],
        padding_mask=inputs["padding_mask"],
        runtime_gather_output=gather_output,
    )


def _forward_step(data_iterator, model, *, reduce, device):
    batch: MicroBatch = next(data_iterator)
    inputs = batch.to(device).inputs
    output = model_logits(model, inputs, gather_output=False)  # reduced without gathering
    return output, partial(_collect, batch, reduce)


def forward_logprobs(
    model,
    sequences: Sequence[torch.Tensor],
    *,
    max_tokens_per_micro_batch: int = DEFAULT_MAX_TOKENS,
    temperature: float = 1.0,
    with_entropy: bool = False,
    vocab_size: int | None = None,
    packed: bool | None = None,
):
    """Next-token log-probs (and entropies) of ``sequences`` under ``model``, forward only.

    Args:
        model: this rank's model chunk (HybridModel or GPTModel, wrapped or not), or its list of
            chunks under virtual pipeline parallelism.
        sequences: 1-D integer token tensors (or lists of ids), any lengths >= 1.
        max_tokens_per_micro_batch: tokens per forward pass, alignment padding included.
        temperature: the sampling temperature the log-probs are for.
        with_entropy: also return each position's entropy.
        vocab_size: the real vocabulary size (default: the model's ``real_vocab_size``, which
            ``HybridModel`` keeps when its vocabulary is padded, else its ``vocab_size``); ids
            at and past it are refused, and logits of padded vocabulary rows are excluded.
        packed: THD micro-batches (True), padded rows (False), or None: packed whenever every
            layer type packs (``thd_unsupported_reason_for``).

    Returns:
        On every rank, in input order, one float32 tensor of ``len - 1`` log-probs per sequence
        (``logprobs[j] = log p(seq[j + 1] | seq[: j + 1])``); with ``with_entropy`` two such
        lists, ``(logprobs, entropies)``. No gradients. The tensors are views of one buffer.

    Raises:
        ValueError: bad sequences (empty list, an empty sequence, ids outside the vocabulary,
            different lists within a replica), a sequence longer than a micro-batch after
            alignment, ``packed=True`` for a model that cannot pack, or context parallelism.
    """
    from megatron.core.utils import get_model_config, unwrap_model

    chunks = _chunks(model)
    inner = [unwrap_model(chunk) for chunk in chunks]
    config = get_model_config(chunks[0])
    pg = getattr(inner[0], "pg_collection", None)
    if pg is None:
        from megatron.core.process_groups_config import ProcessGroupCollection

        pg = ProcessGroupCollection.use_mpu_process_groups()
    temperature = check_temperature(temperature)
    if isinstance(max_tokens_per_micro_batch, bool) or not isinstance(
        max_tokens_per_micro_batch, int
    ):
        raise ValueError(
            f"max_tokens_per_micro_batch must be an int, got {max_tokens_per_micro_batch!r}"
        )
    vocab = vocab_size if vocab_size is not None else real_vocab_size(inner[0])
    device = model_device(inner)
    where = "forward_logprobs"
    error, tokens = check_sequences(sequences, vocab)
    if error is None and max_tokens_per_micro_batch < 1:
        error = f"max_tokens_per_micro_batch must be >= 1, got {max_tokens_per_micro_batch}"
    if error is None and pg.cp.size() > 1:
        error = "context parallelism is not supported; run with context_parallel_size 1"
    agree(error, device, where)
    agree(replica_error(tokens, pg.mp, device), device, where)

    batches = plan_micro_batches(
        tokens,
        padding_config_from(config, pg),
        max_tokens=max_tokens_per_micro_batch,
        packed=choose_packed(inner[0], config, packed),
        pg_collection=pg,
        chunks=len(chunks),
        device=device,
        where=where,
    )
    reduce = partial(_reduce, tp_group=pg.tp, temperature=temperature, vocab_size=vocab,
                     with_entropy=with_entropy)  # fmt: skip
    if batches:
        _run(chunks, pg, batches, reduce, device)
    return _gather(tokens, batches, pg, device, with_entropy)


def _reduce(logits, labels, *, tp_group, temperature, vocab_size, with_entropy):
    # The labels are the checked sequences' tokens: no range check (it would wait for the device).
    options = dict(tp_group=tp_group, temperature=temperature, vocab_size=vocab_size,
                   check_labels=False)  # fmt: skip
    if with_entropy:  # one pass over the vocabulary for both
        return list(token_logprobs_and_entropy(logits, labels, **options))
    return [token_logprobs(logits, labels, **options)]


def _run(chunks, pg, batches, reduce, device) -> None:
    """The forward-only schedule over ``batches`` (each model chunk reads its own iterator)."""
    with evaluating(chunks):
        run_schedule(
            chunks,
            batches,
            seq_length=batches[0].seq_length,
            micro_batch_size=batches[0].rows,
            forward_only=True,
            forward_step=partial(_forward_step, reduce=reduce, device=device),
            pg_collection=pg,
        )


def _gather(tokens, batches, pg, device, with_entropy):
    """Every sequence's results, broadcast from the last pipeline stage, in input order: one
    copy per micro-batch into one buffer, whose views are returned."""
    sizes = [len(t) - 1 for t in tokens]
    parts = 2 if with_entropy else 1
    flat = torch.empty(parts, sum(sizes), dtype=torch.float32, device=device)
    if pg.pp.rank() == pg.pp.size() - 1:
        starts = torch.tensor([0, *sizes]).cumsum(0).tolist()
        for batch in batches:
            if batch.spans:
                where = torch.cat(
                    [torch.arange(starts[i], starts[i] + n) for i, _, n in batch.spans]
                )
                flat.index_copy_(1, to_device(where, device), batch.results.float())
    if pg.pp.size() > 1:
        source = torch.distributed.get_global_rank(pg.pp, pg.pp.size() - 1)
        torch.distributed.broadcast(flat, src=source, group=pg.pp)
    split = [list(flat[k].split(sizes)) for k in range(parts)]
    return (split[0], split[1]) if with_entropy else split[0]
