"""Adapters in: ``load_peft_adapter`` reads a PEFT folder strictly.

Every tensor of the file must name a piece of the model (module LoRA, PEFT's 3-D routed-expert
layout, or per-expert names), have the shape the piece needs and come with its partner; the
config fields that change the math and are not modelled (DoRA, biases, per-module ranks, ...)
are refused by name. Nothing is dropped silently, unlike loaders that skip names they do not
know (peft 0.21 itself drops per-expert names on Qwen3.5-MoE and Nemotron-H).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_hybrid.hf.weights import model_chunks
from megatron_hybrid.peft.apply import apply_lora, lora_state, model_plan
from megatron_hybrid.peft.config import MEGATRON_TARGETS, LoRAConfig, LoRAConfigError
from megatron_hybrid.peft.export import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from megatron_hybrid.peft.formats import PEFT_PREFIX, unpack_experts
from megatron_hybrid.peft.naming import Naming, target_of_key

__all__ = ["PeftAdapterError", "load_peft_adapter"]


class PeftAdapterError(LoRAConfigError):
    """A PEFT folder that does not fit the model; the message names what and where."""


#: adapter_config.json fields that change the math, with the value this loader models.
_REFUSED = {
    "use_dora": False,
    "lora_bias": False,
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "layer_replication": None,
    "trainable_token_indices": None,
    "bias": "none",
}


def _read_config(folder: Path) -> dict:
    path = folder / ADAPTER_CONFIG
    if not path.is_file() or not (folder / ADAPTER_WEIGHTS).is_file():
        raise PeftAdapterError(
            f"{folder}: not a PEFT adapter folder (needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})"
        )
    try:
        config = json.loads(path.read_text())
    except (ValueError, OSError) as error:  # JSONDecodeError and UnicodeDecodeError included
        raise PeftAdapterError(f"{path} is not readable JSON ({error})") from None
    if not isinstance(config, dict):
        raise PeftAdapterError(
            f"{path} holds a JSON {type(config).__name__}, not an object of adapter settings"
        )
    if config.get("peft_type") != "LORA":
        raise PeftAdapterError(f"{path}: peft_type {config.get('peft_type')!r}, expected 'LORA'")
    for name, value in _REFUSED.items():
        if config.get(name) not in (value, None, [], {}, False) or (
            name == "bias" and config.get(name, "none") != "none"
        ):
            raise PeftAdapterError(
                f"{path}: {name}={config[name]!r} is not supported (only {value!r}): the "
                "adapter would not compute what PEFT computes"
            )
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise PeftAdapterError(f"{path}: r={rank!r} is not a rank")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise PeftAdapterError(f"{path}: lora_alpha={alpha!r} is not a number")
    for name, uniform in (("rank_pattern", rank), ("alpha_pattern", alpha)):
        other = {k: v for k, v in (config.get(name) or {}).items() if v != uniform}
        if other:
            raise PeftAdapterError(
                f"{path}: {name} gives some modules another value ({other}); one rank and "
                "alpha for every adapter is supported"
            )
    return config


def _adapted_params(config: dict, naming: Naming, module: str, params: list) -> list[str]:
    """The 3-D parameters of experts module ``module`` that the config adapts (PEFT matches
    ``target_parameters`` as suffixes of the full parameter name)."""
    targets = config.get("target_parameters") or []
    memory = naming.memory(module)
    out = []
    for fused in params:
        full = f"{memory}.{fused.param}"
        if any(full == t or full.endswith(f".{t}") for t in targets):
            out.append(fused.param)
    return out


def _name_table(config: dict, naming: Naming) -> dict[str, tuple]:
    """File name -> ``("module", piece, "A"|"B")``, ``("fused", FusedExperts, "A"|"B")`` or
    ``("expert", FusedExperts, expert, hf_name, "A"|"B")``."""
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
    return table


def _selection(names, table, path) -> tuple[set[str], dict]:
    """The pieces a file adapts, checking each has both ``A`` and ``B``."""
    unknown = sorted(n for n in names if n not in table)
    if unknown:
        shown = ", ".join(unknown[:5]) + (
            f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        )
        raise PeftAdapterError(
            f"{path}: {len(unknown)} tensors name no adaptable piece of this model ({shown}); "
            "the adapter was made for another model, or for modules this loader does not adapt"
        )
    halves: dict = {}
    for name in names:
        what = table[name]
        halves.setdefault(what[:-1], set()).add(what[-1])
    for what, got in halves.items():
        if got != {"A", "B"}:
            raise PeftAdapterError(f"{path}: {what[1]} has lora_{got.pop()} without its partner")
    pieces = set()
    for what in halves:
        if what[0] == "module":
            pieces.add(what[1])
        else:
            pieces.add(f"{what[1].module}.{what[1].param}")
    return pieces, halves


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

    Reads ``adapter_config.json`` (rank, alpha, rsLoRA) and ``adapter_model.safetensors``,
    adapts exactly the pieces the file holds (``apply_lora`` with those targets) and fills
    each rank's shards. Accepts PEFT's own format (routed experts in the 3-D
    ``target_parameters`` layout of peft >= 0.19) and the per-expert one. Call it on every rank
    of ``group`` together, on a model without adapters, before wrapping it for training.

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
    config = _read_config(folder)
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
    rank = int(config["r"])
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
        pieces, halves = _selection(names, table, path)
        for name in names:
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
            alpha=config["lora_alpha"],
            dropout=float(config.get("lora_dropout") or 0.0) if dropout is None else dropout,
            targets=sorted(pieces),
            use_rslora=bool(config.get("use_rslora", False)),
        )
        apply_lora(model, lora, conversion=conversion, group=group)
        _fill(model, _Source(handle, halves, table, naming, rank), naming)
    return model
