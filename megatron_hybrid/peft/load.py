"""Adapters in: ``load_peft_adapter`` reads a PEFT folder as peft 0.21.2 reads it.

``adapter_config.json`` decides what is adapted, with peft's own matching rules
(:mod:`megatron_hybrid.peft.adapter_config`); its fields that change the math and are not
modelled (DoRA, aLoRA, biases, per-module ranks, ...) are refused by name, as are folders peft
itself refuses (targets that match nothing). Every tensor of the file must name a piece of the
model (module LoRA or PEFT's 3-D routed-expert layout), have the shape the piece needs and come
with its partner; tensors of pieces the config does not target are left out, as peft leaves
them out, with a warning. Per-expert names, which peft 0.21 drops without a word on
transformers 5 models, are refused.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import torch

from megatron_hybrid.hf.weights import model_chunks
from megatron_hybrid.peft.adapter_config import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterConfig,
    PeftAdapterError,
    read_adapter_config,
)
from megatron_hybrid.peft.apply import apply_lora, lora_state, model_plan
from megatron_hybrid.peft.config import MEGATRON_TARGETS, LoRAConfig
from megatron_hybrid.peft.formats import PEFT_PREFIX, unpack_experts
from megatron_hybrid.peft.naming import Naming, target_of_key

__all__ = ["PeftAdapterError", "load_peft_adapter"]


def _folder_config(folder: Path) -> AdapterConfig:
    if not (folder / ADAPTER_CONFIG).is_file() or not (folder / ADAPTER_WEIGHTS).is_file():
        raise PeftAdapterError(
            f"{folder}: not a PEFT adapter folder (needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})"
        )
    return read_adapter_config(folder)


def _shown(names: list[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _converted(config: AdapterConfig, naming: Naming, names: list[str]) -> AdapterConfig:
    """``config`` as peft 0.21 reads it for a family whose MoE layout changed in transformers 5:
    a regular expression becomes the leaf names it matches, and names peft then moves to the
    routed experts (``gate_proj`` of a dense MLP would adapt the experts instead) are refused
    (``utils/transformers_weight_conversion.py``: ``_convert_peft_config_moe``)."""
    moved = naming.peft.moved_targets
    targets = config.target_modules
    if not moved or targets is None:
        return config
    if isinstance(targets, str):
        resolved = set(config.resolve_regex(names))
        containers: dict[str, list[str]] = {}
        for name in names:
            container, _, last = name.rpartition(".")
            containers.setdefault(last, []).append(container)
        for old, new in moved.items():  # experts fused in transformers 5: probe the old names
            if old not in resolved and any(
                config.targets_module(f"{c}.{old}") for c in containers.get(new, ())
            ):
                resolved.add(old)
        if not resolved:
            return config
        config = dataclasses.replace(config, target_modules=frozenset(resolved))
    hit = sorted(
        t for t in config.target_modules if any(t == m or t.endswith(f".{m}") for m in moved)
    )
    if hit:
        raise PeftAdapterError(
            f"{config.path}: target_modules {hit}: for {naming.conversion.family} peft 0.21 "
            f"turns {sorted(moved)} into the routed experts' parameters (its transformers-v5 "
            "conversion), so these entries would not adapt the modules they name and the "
            "experts would get an adapter of another rank; name dense and shared MLP linears "
            "as target_parameters (gate_proj.weight, ...) and the experts as "
            "mlp.experts.gate_up_proj / mlp.experts.down_proj, as save_peft_adapter writes them"
        )
    return config


def _select(config: AdapterConfig, naming: Naming) -> set[str]:
    """The pieces peft adapts for ``config`` on this model: module pieces (on-disk names) and
    routed-expert parameters (``<experts module>.<param>``), as :class:`LoRAConfig` targets.

    Raises:
        PeftAdapterError: the config selects modules or parameters this package does not adapt,
            nothing at all, or a combination peft refuses (the message names them).
    """
    modules, parameters = naming.model_names()
    path = config.path
    config = _converted(config, naming, [*modules, *parameters])
    chosen = [m for m in modules if config.targets_module(m)]
    params = [p for p in parameters if config.targets_parameter(p)]
    for name in chosen:
        reason = naming.peft.incompatible_leaves.get(name.rsplit(".", 1)[-1])
        if reason:
            raise PeftAdapterError(f"{path}: target_modules select {name}: {reason}")
    foreign = [m for m in chosen if modules[m] is None]
    foreign += [p for p in params if parameters[p] is None]
    if foreign:
        raise PeftAdapterError(
            f"{path}: the targets select {len(foreign)} module(s) or parameter(s) that are not "
            f"linears of the model's layers or routed-expert weights ({_shown(sorted(foreign))}"
            "); peft would adapt them (embeddings, the output layer, gates) or refuse them "
            "(containers, norms), and this package adapts neither: narrow the targets"
        )
    if not chosen and not params:
        raise PeftAdapterError(
            f"{path}: target_modules {_described(config.target_modules)} and target_parameters "
            f"{list(config.target_parameters)} match no module of the model (peft refuses such "
            "a folder: 'Target modules ... not found in the base model'); the adapter was made "
            "for another model"
        )
    twice = sorted({modules[m] for m in chosen} & {parameters[p] for p in params})
    if twice:
        raise PeftAdapterError(
            f"{path}: {_shown(twice)} are targeted both as modules and through their weight in "
            "target_parameters (peft refuses to wrap an adapted layer's parameter)"
        )
    if params and config.dropout:
        raise PeftAdapterError(
            f"{path}: lora_dropout={config.dropout} with target_parameters: peft refuses it "
            "(dropout cannot be factored out of a wrapped parameter); set lora_dropout to 0"
        )
    if params and not chosen and config.fan_in_fan_out:
        raise PeftAdapterError(
            f"{path}: fan_in_fan_out=true with target_parameters only: peft refuses it"
        )
    for name in chosen + params:
        rank, alpha = config.rank_of(name), config.alpha_of(name)
        if rank != config.rank or alpha != config.alpha:
            raise PeftAdapterError(
                f"{path}: rank_pattern / alpha_pattern give {name} rank {rank} and alpha {alpha} "
                f"(r={config.rank}, lora_alpha={config.alpha}); one rank and alpha for every "
                "adapter is supported"
            )
    pieces = {modules[m] for m in chosen}
    for name in params:
        target = parameters[name]
        pieces.add(target if isinstance(target, str) else f"{target.module}.{target.param}")
    return pieces


def _described(targets) -> str:
    return repr(targets) if isinstance(targets, str) or targets is None else str(sorted(targets))


def _adapted_params(config: AdapterConfig, naming: Naming, module: str, params: list) -> list[str]:
    """The 3-D parameters of experts module ``module`` that the config adapts (PEFT matches
    ``target_parameters`` as suffixes of the full parameter name)."""
    memory = naming.memory(module)
    return [f.param for f in params if config.targets_parameter(f"{memory}.{f.param}")]


def _name_table(config: AdapterConfig, naming: Naming) -> dict[str, tuple]:
    """File name -> ``("module", piece, "A"|"B")``, ``("fused", FusedExperts, "A"|"B")``,
    ``("expert", FusedExperts, expert, hf_name, "A"|"B")`` or ``("stray", experts module,
    "A"|"B")`` (a routed-expert name the config does not target)."""
    plan = naming.plan
    table: dict[str, tuple] = {}

    def add(names: tuple[str, str], *what) -> None:
        table[names[0]] = (*what, "A")
        table[names[1]] = (*what, "B")

    for link in plan.links:
        if link.key.startswith("mtp.") or target_of_key(link.key) not in MEGATRON_TARGETS:
            continue
        piece = link.hf_name.removesuffix(".weight")
        fused = plan.fused_experts.get(link.key)
        if fused is not None:
            add(naming.module(piece), "expert", fused, link.expert, link.hf_name)
            continue
        add(naming.module(piece), "module", piece)
        # The on-disk prefix loads too (Nemotron-H's backbone.), as it does in PEFT.
        add((f"{PEFT_PREFIX}{piece}.lora_A.weight", f"{PEFT_PREFIX}{piece}.lora_B.weight"),
            "module", piece)  # fmt: skip
    for module, params in naming.fused_modules().items():
        adapted = _adapted_params(config, naming, module, params)
        for fused in params:
            if fused.param in adapted:
                add(naming.experts(fused, adapted), "fused", fused)
        # Names of this module's other parameters (another nesting of PEFT's wrappers): peft
        # leaves them out when the config does not target them.
        for depth in range(len(params)):
            names = naming.experts(params[-1 - depth], [f.param for f in params])
            for name, half in zip(names, "AB", strict=True):
                table.setdefault(name, ("stray", module, half))
    return table


def _piece_of(what: tuple) -> str:
    """The LoRAConfig target a table entry belongs to (never a target for stray names)."""
    if what[0] == "module":
        return what[1]
    if what[0] == "stray":
        return f"{what[1]}.<not targeted>"
    return f"{what[1].module}.{what[1].param}"


def _selection(names, table, selected: set[str], path) -> tuple[set[str], dict]:
    """The pieces to load: those the config selects, each with its ``A`` and ``B`` in the
    file. Tensors of pieces the config does not select are left out, as peft leaves them out
    (with a warning here).

    Raises:
        PeftAdapterError: a tensor names nothing this model adapts, names a per-expert module
            peft would drop, lacks its partner, or a selected piece has no tensors.
    """
    unknown = sorted(n for n in names if n not in table)
    if unknown:
        raise PeftAdapterError(
            f"{path}: {len(unknown)} tensors name no adaptable piece of this model "
            f"({_shown(unknown)}); the adapter was made for another model, or for modules this "
            "loader does not adapt"
        )
    per_expert = sorted(n for n in names if table[n][0] == "expert")
    if per_expert:
        raise PeftAdapterError(
            f"{path}: {len(per_expert)} tensors adapt routed experts one by one "
            f"({_shown(per_expert, 2)}); transformers 5 holds each layer's experts as one 3-D "
            "parameter, so peft 0.21 leaves these tensors out without a word: write the "
            "adapter in peft's layout (save_peft_adapter(format='peft'), convert --to-peft "
            "without --peft-format per_expert)"
        )
    halves: dict = {}
    for name in names:
        what = table[name]
        halves.setdefault(what[:-1], set()).add(what[-1])
    in_file = {_piece_of(what) for what in halves}
    missing = sorted(selected - in_file)
    if missing:
        raise PeftAdapterError(
            f"{path}: the config adapts {len(missing)} module(s) the file holds no tensors for "
            f"({_shown(missing)}); peft would leave them at their initial values (warning "
            "'Found missing adapter keys'): the folder is incomplete"
        )
    ignored = sorted(n for n in names if _piece_of(table[n]) not in selected)
    if ignored:
        warnings.warn(
            f"{path}: {len(ignored)} tensors are left out because adapter_config.json does not "
            f"target their modules ({_shown(ignored, 3)}), as peft leaves them out",
            stacklevel=3,
        )
    halves = {what: got for what, got in halves.items() if _piece_of(what) in selected}
    for what, got in halves.items():
        if got != {"A", "B"}:
            raise PeftAdapterError(f"{path}: {what[1]} has lora_{got.pop()} without its partner")
    return selected, halves


def _expected_shape(what: tuple, naming: Naming, rank: int) -> tuple[int, ...]:
    plan = naming.plan
    kind, half = what[0], what[-1]
    if kind == "module":
        rows, width = plan.hf_shapes[f"{what[1]}.weight"]
    elif kind == "expert":
        rows, width = plan.hf_shapes[what[3]]
    else:
        experts, rows, width = plan.key_shapes[what[1].key]
        return (experts * rank, width) if half == "A" else (rows, rank * experts)
    return (rank, width) if half == "A" else (rows, rank)


class _Source:
    """The file's tensors, read lazily, as ``A`` per (piece, expert) and ``B`` rows per
    (checkpoint key, expert)."""

    def __init__(self, handle, halves: dict, table: dict, naming: Naming, rank: int) -> None:
        self.handle, self.naming, self.rank = handle, naming, rank
        self.names = {}  # what (without half) + half -> file name
        for name, what in table.items():
            if what[:-1] in halves and name in handle.keys():
                self.names[what] = name
        self.cache: dict = {}

    def _get(self, name: str) -> torch.Tensor:
        if name not in self.cache:
            self.cache[name] = self.handle.get_tensor(name)
        return self.cache[name]

    def _fused(self, fused, expert: int):
        key = ("fused", fused)
        a = self._get(self.names[(*key, "A")])
        b = self._get(self.names[(*key, "B")])
        experts = self.naming.plan.key_shapes[fused.key][0]
        a_list, b_list = unpack_experts(a, b, experts, self.rank)
        return a_list[expert], b_list[expert]

    def a(self, piece: str, fused, expert) -> torch.Tensor:
        """``A`` ``[r, in]`` of a piece (of one expert)."""
        if fused is None:
            return self._get(self.names[("module", piece, "A")])
        if ("fused", fused, "A") in self.names:
            return self._fused(fused, expert)[0]
        values = [
            self._get(name)
            for what, name in self.names.items()
            if what[0] == "expert" and what[1] == fused and what[2] == expert and what[-1] == "A"
        ]
        if not values:
            return None
        for other in values[1:]:
            if not torch.equal(other, values[0]):
                raise PeftAdapterError(
                    f"expert {expert} of {fused.module}: the per-expert pieces of "
                    f"{fused.param} have different lora_A; the fused expert weight holds one A "
                    "(as PEFT's 3-D layout does), so this adapter cannot be loaded exactly"
                )
        return values[0]

    def b_rows(self, key: str, expert, start: int, stop: int, links, fused) -> torch.Tensor:
        """Rows ``start:stop`` of the ``B`` of checkpoint key ``key`` (expert ``expert``)."""
        out = torch.zeros(stop - start, self.rank)
        if fused is not None and ("fused", fused, "A") in self.names:
            # transformers' fused parameter holds the checkpoint key's rows as they are.
            return self._fused(fused, expert)[1][start:stop]
        for link in links:
            low, high = max(start, link.key_rows.start), min(stop, link.key_rows.stop)
            if low >= high:
                continue
            what = (
                ("expert", fused, expert, link.hf_name)
                if fused is not None
                else ("module", link.hf_name.removesuffix(".weight"))
            )
            name = self.names.get((*what, "B"))
            if name is None:
                continue  # a piece without an adapter: its rows of B stay zero
            hf = self._get(name)
            i0, i1 = low - link.key_rows.start, high - link.key_rows.start
            rows = link.hf_rows
            index = (
                slice(rows.start + i0, rows.start + i1)
                if isinstance(rows, slice)
                else list(rows[i0:i1])
            )
            out[low - start : high - start] = hf[index]
        return out


@torch.no_grad()
def _fill(model, source: _Source, naming: Naming) -> None:
    plan = naming.plan
    for chunk in model_chunks(model):
        for cand in chunk.lora_state.adapted:
            adapter = cand.module.lora
            active = [cand.pieces[i] for i in sorted(cand.active)]
            for i, pieces in enumerate(cand.weights):
                a, b = adapter.a(i), adapter.b(i)
                template = pieces.chunks[0].template
                p = template.prepend_axis_num
                start, width = template.global_offset[p + 1], a.shape[1]
                for block, piece in enumerate(active):
                    value = source.a(piece, pieces.fused, pieces.expert)
                    if value is None:  # an expert the file leaves out: no update (B = 0)
                        a[block * adapter.rank : (block + 1) * adapter.rank] = 0
                        continue
                    a[block * adapter.rank : (block + 1) * adapter.rank] = value[
                        :, start : start + width
                    ].to(a.dtype)
                for rows in pieces.chunks:
                    links = plan.by_key.get((rows.key, rows.expert), ())
                    value = source.b_rows(
                        rows.key,
                        rows.expert,
                        rows.global_start,
                        rows.global_start + rows.rows,
                        links,
                        pieces.fused,
                    )
                    b[rows.local_start : rows.local_start + rows.rows] = value.to(b.dtype)


def load_peft_adapter(model, folder, *, group=None, dropout: float | None = None):
    """Apply the LoRA adapter of a PEFT folder to ``model`` and load its tensors strictly.

    Reads ``adapter_config.json`` as peft 0.21.2 reads it
    (:mod:`megatron_hybrid.peft.adapter_config`: every field honoured as peft applies it, or
    refused by name), adapts exactly the modules and routed-expert parameters peft would adapt
    on the transformers model (``apply_lora`` with those pieces), and fills each rank's shards
    from ``adapter_model.safetensors`` (routed experts in the 3-D ``target_parameters`` layout of
    peft >= 0.19). Tensors of modules the config does not target are left out, as peft leaves
    them out (with a warning). Call it on every rank of ``group`` together, on a model without
    adapters, before wrapping it for training.

    Args:
        model: the model (built with ``load_hf_model``, or with its ``hf_conversion`` set).
        folder: the PEFT folder.
        group: process group over every rank holding the model.
        dropout: adapter dropout for further training (default: the file's ``lora_dropout``).

    Returns:
        ``model``, adapted.

    Raises:
        PeftAdapterError: the folder does not fit the model (the message says which tensor or
            field and why).
    """
    from safetensors import SafetensorError, safe_open

    folder = Path(folder)
    config = _folder_config(folder)
    chunks = model_chunks(model)
    if lora_state(model) is not None:
        raise PeftAdapterError("load_peft_adapter: the model already has LoRA adapters")
    conversion = getattr(chunks[0], "hf_conversion", None)
    if conversion is None:
        raise PeftAdapterError(
            "load_peft_adapter needs a model built from Hugging Face weights (load_hf_model), "
            "whose conversion names the pieces a PEFT file holds"
        )
    _, plan = model_plan(chunks, conversion, group)
    naming = Naming(conversion, plan)
    selected = _select(config, naming)
    rank = config.rank
    path = folder / ADAPTER_WEIGHTS
    try:
        opened = safe_open(str(path), framework="pt")
    except (SafetensorError, OSError) as error:
        raise PeftAdapterError(
            f"{path} is damaged ({error}): it is not a complete safetensors file; copy or export "
            "it again"
        ) from None
    with opened as handle:
        names = list(handle.keys())
        if not names:
            raise PeftAdapterError(f"{path} holds no tensors: loading it would change nothing")
        table = _name_table(config, naming)
        pieces, halves = _selection(names, table, selected, path)
        for name in names:
            if _piece_of(table[name]) not in pieces:
                continue
            expected = _expected_shape(table[name], naming, rank)
            got = tuple(handle.get_slice(name).get_shape())
            if got != expected:
                raise PeftAdapterError(
                    f"{path}: {name} has shape {got}, this model needs {expected} (rank {rank}"
                    "; routed experts: lora_A [experts*r, in], lora_B [out, r*experts] as "
                    "peft >= 0.19 writes them)"
                )
        lora = LoRAConfig(
            rank=rank,
            alpha=config.alpha,
            dropout=config.dropout if dropout is None else dropout,
            targets=sorted(pieces),
            use_rslora=config.use_rslora,
        )
        apply_lora(model, lora, conversion=conversion, group=group)
        _fill(model, _Source(handle, halves, table, naming, rank), naming)
    return model
