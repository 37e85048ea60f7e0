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

from collections.abc import Sequence
from functools import partial

import torch

from megatron_hybrid.logprobs import DEFAULT_MAX_TOKENS
from megatron_hybrid.logprobs.batches import (
    MicroBatch,
    dummy_micro_batch,
    micro_batch_groups,
    sequences_batch,
)
from megatron_hybrid.logprobs.vocab import check_temperature, token_entropy, token_logprobs
from megatron_hybrid.padding import (
    packed_seq_params_to,
    padding_config_from,
    thd_unsupported_reason_for,
)

__all__ = ["forward_logprobs", "real_vocab_size"]


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


def _device(inner: list) -> torch.device:
    for chunk in inner:
        for param in chunk.parameters():
            return param.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"


def _input_error(sequences, vocab: int) -> tuple[str | None, list[torch.Tensor]]:
    """The first problem with ``sequences`` (or None) and the sequences as CPU int64 tensors."""
    if torch.is_tensor(sequences) or not isinstance(sequences, Sequence):
        return "sequences must be a list of 1-D token tensors", []
    if not sequences:
        return "sequences is empty: pass at least one sequence of token ids", []
    tokens = []
    for i, seq in enumerate(sequences):
        t = seq if torch.is_tensor(seq) else torch.as_tensor(seq)
        if t.dtype.is_floating_point or t.is_complex() or t.dtype == torch.bool or t.dim() != 1:
            return f"sequence {i} must be a 1-D integer tensor, got {t.dtype} {tuple(t.shape)}", []
        if t.numel() == 0:
            return f"sequence {i} is empty (0 tokens); every sequence needs at least one", []
        bad = ((t < 0) | (t >= vocab)).nonzero()
        if bad.numel():
            at = int(bad[0])
            return (
                f"sequence {i} holds token id {int(t[at])} at position {at}, outside the "
                f"vocabulary [0, {vocab})"
            ), []
        tokens.append(t.detach().to("cpu", torch.long))
    return None, tokens


def _agree(error: str | None, device) -> None:
    """Raise on every rank if any rank refused its input (no rank waits in a collective)."""
    flag = torch.tensor([0.0 if error is None else 1.0], device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    if error is not None:
        raise ValueError(f"forward_logprobs: {error}")
    if flag.item():
        raise ValueError(
            "forward_logprobs: another rank refused its input (see that rank's error); every "
            "rank must pass valid sequences"
        )


def _replica_error(tokens: list[torch.Tensor], group, device) -> str | None:
    """Why the ranks of one model replica disagree about the sequences, or None."""
    if group is None or group.size() == 1:
        return None
    digest = 0
    for i, t in enumerate(tokens):
        digest = (digest * 1_000_003 + int((t * torch.arange(1, len(t) + 1)).sum()) + i) % (1 << 31)
    sizes = (len(tokens), sum(len(t) for t in tokens), digest)
    mix = torch.tensor(sizes, dtype=torch.float64, device=device)
    low, high = mix.clone(), mix.clone()
    torch.distributed.all_reduce(low, op=torch.distributed.ReduceOp.MIN, group=group)
    torch.distributed.all_reduce(high, op=torch.distributed.ReduceOp.MAX, group=group)
    if not torch.equal(low, high):
        return (
            "the ranks of one model replica (tensor and pipeline parallel) passed different "
            "sequences; every rank of a replica must pass the same list"
        )
    return None


def _symbols(inner, config) -> set[str] | None:
    parsed = getattr(inner, "parsed_pattern", None)
    if parsed is None:
        return None
    return {symbol for symbol, count in parsed.layer_counts.items() if count}


def _packs(inner, config, packed: bool | None) -> bool:
    """Whether to pack: the caller's choice, else whenever every layer type packs."""
    symbols = _symbols(inner, config)
    if symbols is None:  # a model without a pattern (GPTModel): TE's attention packs
        reason = None if config.transformer_impl == "transformer_engine" else "local attention"
    else:
        reason = thd_unsupported_reason_for(symbols, config)
    if packed and reason:
        raise ValueError(f"forward_logprobs: packed=True, but the model cannot pack: {reason}")
    return reason is None if packed is None else bool(packed)


def _world_max(values: list[int], device) -> list[int]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return [int(v) for v in tensor.tolist()]


def _collect(batch: MicroBatch, reduce, output: torch.Tensor):
    """Loss function of the last stage: per-token results of every sequence in ``batch``."""
    logits = output.reshape(-1, output.size(-1))
    values = reduce(logits, batch.labels.to(logits.device))
    for index, first, count in batch.spans:
        batch.results[index] = tuple(v[first : first + count] for v in values)
    zero = torch.zeros((), device=logits.device)
    return zero, torch.ones((), dtype=torch.int, device=logits.device), {}


def _forward_step(data_iterator, model, *, reduce, device):
    batch: MicroBatch = next(data_iterator)
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.inputs.items()}
    params = inputs["packed_seq_params"]
    if params is not None:
        params = packed_seq_params_to(params, device)
    output = model(
        input_ids=inputs["input_ids"],
        position_ids=inputs["position_ids"],
        attention_mask=None,
        packed_seq_params=params,
        padding_mask=inputs["padding_mask"],
        runtime_gather_output=False,  # vocab-parallel logits: reduced without gathering them
    )
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
        (``logprobs[j] = log p(seq[j + 1] | seq[: j + 1])``), or with ``with_entropy`` one
        ``(logprobs, entropies)`` pair per sequence. No gradients.

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
    device = _device(inner)
    error, tokens = _input_error(sequences, vocab)
    if error is None and max_tokens_per_micro_batch < 1:
        error = f"max_tokens_per_micro_batch must be >= 1, got {max_tokens_per_micro_batch}"
    if error is None and pg.cp.size() > 1:
        error = "context parallelism is not supported; run with context_parallel_size 1"
    _agree(error, device)
    _agree(_replica_error(tokens, pg.mp, device), device)

    padding = padding_config_from(config, pg)
    use_thd = _packs(inner[0], config, packed)
    runnable = [i for i, t in enumerate(tokens) if len(t) > 1]  # one token predicts nothing
    lengths = [len(tokens[i]) - 1 for i in runnable]  # inputs: the last token is a label only
    pipelined = padding.fixed_length_required
    rows = 1 if not use_thd and (pipelined or padding.needs_group_equalize) else None
    fixed = None
    if pipelined:
        fixed = _fixed_length(padding, lengths, max_tokens_per_micro_batch, use_thd, device)
    try:
        groups = micro_batch_groups(lengths, padding, max_tokens_per_micro_batch, use_thd, rows)
        groups = [[runnable[i] for i in group] for group in groups] if lengths else []
        error = None
    except ValueError as refused:
        groups, error = [], str(refused)
    _agree(error, device)

    count = _world_max([len(groups)], device)[0]
    if len(chunks) > 1:
        count = -(-count // pg.pp.size()) * pg.pp.size()  # interleaving needs whole rounds
    options = dict(packed=use_thd, fixed_length=fixed, rows=rows, equalize_group=pg.tp_ep)
    batches = [sequences_batch(tokens, group, padding, **options) for group in groups]
    batches += [dummy_micro_batch(padding, **options) for _ in range(count - len(groups))]

    reduce = partial(_reduce, tp_group=pg.tp, temperature=temperature, vocab_size=vocab,
                     with_entropy=with_entropy)  # fmt: skip
    if count:
        _run(chunks, config, pg, batches, reduce, device)
    return _gather(tokens, batches, pg, device, with_entropy)


def _fixed_length(padding, lengths, max_tokens, use_thd, device) -> int:
    """The one row length every micro-batch has under pipeline parallelism."""
    if use_thd:
        probe = padding.thd([1])
        return max(probe.total_multiple, max_tokens // probe.total_multiple * probe.total_multiple)
    longest = _world_max([max(lengths, default=1)], device)[0]
    return padding.align_seq_length(longest, micro_batch_size=1, force_policy="round_up")


def _reduce(logits, labels, *, tp_group, temperature, vocab_size, with_entropy):
    values = [token_logprobs(logits, labels, tp_group=tp_group, temperature=temperature,
                             vocab_size=vocab_size)]  # fmt: skip
    if with_entropy:
        values.append(
            token_entropy(logits, tp_group=tp_group, temperature=temperature, vocab_size=vocab_size)
        )
    return values


def _run(chunks, config, pg, batches, reduce, device) -> None:
    """The forward-only schedule over ``batches`` (each model chunk reads its own iterator)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    pp = pg.pp.size()
    vpp = len(chunks) if len(chunks) > 1 else None
    kwargs = dict(pg_collection=pg)
    if pp > 1:
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        kwargs["p2p_communicator"] = P2PCommunicator(pp_group=pg.pp, config=config)
    iterators = [iter(batches) for _ in chunks]
    modes = [module.training for chunk in chunks for module in chunk.modules()]
    for chunk in chunks:
        chunk.eval()
    try:
        with torch.no_grad():
            get_forward_backward_func(pp_size=pp, vp_size=vpp)(
                forward_step_func=partial(_forward_step, reduce=reduce, device=device),
                data_iterator=iterators if vpp else iterators[0],
                model=chunks if vpp else chunks[0],
                num_microbatches=len(batches),
                seq_length=batches[0].seq_length,
                micro_batch_size=batches[0].rows,
                forward_only=True,
                **kwargs,
            )
    finally:
        modules = [module for chunk in chunks for module in chunk.modules()]
        for module, mode in zip(modules, modes, strict=True):
            module.training = mode


def _gather(tokens, batches, pg, device, with_entropy):
    """Every sequence's results, broadcast from the last pipeline stage, in input order."""
    found = {index: values for batch in batches for index, values in batch.results.items()}
    sizes = [len(t) - 1 for t in tokens]
    parts = 2 if with_entropy else 1
    flat = torch.empty(parts, sum(sizes), dtype=torch.float32, device=device)
    last = pg.pp.rank() == pg.pp.size() - 1
    if last:
        offset = 0
        for index, size in enumerate(sizes):
            for part in range(parts):
                if size:
                    flat[part, offset : offset + size] = found[index][part].float()
            offset += size
    if pg.pp.size() > 1:
        source = torch.distributed.get_global_rank(pg.pp, pg.pp.size() - 1)
        torch.distributed.broadcast(flat, src=source, group=pg.pp)
    split = [
        tuple(p.clone() for p in pair)
        for pair in zip(*(flat[k].split(sizes) for k in range(parts)), strict=True)
    ]
    return [pair if with_entropy else pair[0] for pair in split]
