"""LoRA training through ``train`` on CPU: the loss goes down, adapter-only checkpoints are a
small fraction of a full fine-tuning checkpoint, a resume continues the uninterrupted run (on
TP1 and on TP2 from a TP1 run), another base is refused, ``convert`` writes the adapter as a
PEFT folder and the merged model, both of which transformers/peft compute alike."""

from __future__ import annotations

import json

import hf_oracle
import peft_oracle
import pytest
import torch

from megatron_hybrid.testing.spawn import run_distributed

pytestmark = pytest.mark.slow

SHORT = [
    "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-2",
]  # fmt: skip
LORA = ["--lora-rank", "4", "--lora-alpha", "8"]


def _train_worker(rank, world_size, argv):
    from megatron_hybrid.cli.main import build_parser, load_commands
    from megatron_hybrid.training.run import run_training
    from megatron_hybrid.training.train_settings import settings_from_args

    args = build_parser(load_commands()).parse_args(["train", *argv])
    summary = run_training(settings_from_args(args))
    return summary.losses, summary.grad_norms


def train(*argv: str, ranks: int = 1):
    return run_distributed(_train_worker, ranks, list(argv), timeout=900)[0]


def _jittered_train_worker(rank, world_size, argv, jitter):
    """``_train_worker`` with every step under :class:`rounding.RoundingJitter` of ``jitter``
    (``(eps, seed)``; None: as it is): the forward's and backward's computing ops; in-place
    updates (the fused AdamW, ``main_grad`` accumulation, reductions) keep their own rounding."""
    if jitter is not None:
        from rounding import RoundingJitter

        from megatron_hybrid.training import run

        jitter, step = RoundingJitter(*jitter), run.train_step

        def jittered_step(*args, **kwargs):
            with jitter:
                return step(*args, **kwargs)

        run.train_step = jittered_step
    return _train_worker(rank, world_size, argv)


def resume_bounds(*argv: str) -> dict[str, float]:
    """How far two correct float32 runs of ``train *argv`` may lie apart, each step's loss and
    gradient norm relative (:func:`rounding.float32_bounds`: the response of the same run to
    simulated roundings of two sizes, scaled to float32's), derived from the computation."""
    from rounding import JITTER_EPS, float32_bounds

    def evaluate(rounding):
        jitter = (rounding.eps, rounding.seed) if hasattr(rounding, "seed") else None
        losses, norms = run_distributed(_jittered_train_worker, 1, list(argv), jitter,
                                        timeout=900)[0]  # fmt: skip
        results = {f"loss{i}": torch.tensor(v) for i, v in enumerate(losses)}
        return results | {f"norm{i}": torch.tensor(v) for i, v in enumerate(norms)}

    def relative(a, b):
        return abs(float(a) - float(b)) / abs(float(b))

    # Two sizes of simulated rounding: AdamW's update saturates for gradients near zero, so the
    # step after it may respond less than linearly to the larger one.
    return float32_bounds(evaluate, measure=relative, floor=1e-6, sizes=(JITTER_EPS, 2.0**-20))


def _cli_worker(rank, world_size, argv):
    from megatron_hybrid.cli.main import main

    return main(argv)


def cli(*argv: str) -> int:
    return run_distributed(_cli_worker, 1, list(argv), timeout=600)[0]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny Qwen3.5-MoE folder (2 * moe_intermediate != hidden) and a twin with other
    weights."""
    root = tmp_path_factory.mktemp("lora_train")
    folder = hf_oracle.make_hf_checkpoint("qwen3_5_moe", root / "base", **peft_oracle.OVERRIDES)
    other = hf_oracle.make_hf_checkpoint(
        "qwen3_5_moe", root / "other", seed=1, **peft_oracle.OVERRIDES
    )
    return folder, other


@pytest.fixture(scope="module")
def runs(base, tmp_path_factory):
    """An uninterrupted 4-step LoRA run saving at 2 and 4, and a full fine-tuning run."""
    folder, _ = base
    root = tmp_path_factory.mktemp("runs")
    hf = ["--load-hf", str(folder)]
    whole = train(*hf, *LORA, *SHORT, "--train-iters", "4", "--save-interval", "2",
                  "--save", str(root / "whole"))  # fmt: skip
    full = train(*hf, *SHORT, "--train-iters", "1", "--save", str(root / "full"))
    return root, whole, full


def _tensor_bytes(folder) -> int:
    """Bytes of every tensor a torch_dist checkpoint holds (model and optimizer state)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    total = 0
    for meta in FileSystemReader(str(folder)).read_metadata().state_dict_metadata.values():
        if isinstance(meta, TensorStorageMetadata):
            element = torch.empty((), dtype=meta.properties.dtype).element_size()
            total += meta.size.numel() * element
    return total


def test_loss_goes_down_and_the_checkpoint_holds_adapters_only(runs):
    root, (losses, _), _ = runs
    assert losses[-1] < losses[0]
    lora_ckpt, full_ckpt = root / "whole" / "iter_0000004", root / "full" / "iter_0000001"
    record = json.loads((lora_ckpt / "lora.json").read_text())
    assert record["lora"]["rank"] == 4 and record["base"]["fingerprint"]["kind"] == "hf"
    # Adapters and their optimizer state against weights and theirs: the adapters' share of
    # the parameters (11% at rank 4 of this 64-wide model; 0.3% at rank 16 of a 2048-wide one).
    ratio = _tensor_bytes(lora_ckpt) / _tensor_bytes(full_ckpt)
    assert ratio < 0.15, ratio
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(lora_ckpt)).read_metadata().state_dict_metadata
    tensors = [k for k in keys if k.startswith("decoder.")]
    assert tensors and all(".lora_A." in k or ".lora_B." in k for k in tensors), tensors[:5]


def test_resume_continues_the_uninterrupted_run(runs, base):
    root, (whole, whole_norms), _ = runs
    folder, _ = base
    args = ["--load-hf", str(folder), *LORA, *SHORT, "--train-iters", "4"]
    half = str(root / "whole" / "iter_0000002")
    resumed, norms = train(*args, "--load", half, "--save", str(root / "resumed"))
    assert resumed == whole[2:] and norms == whole_norms[2:]


@pytest.mark.distributed
def test_resume_on_tp2_from_a_tp1_run(runs, base, tmp_path):
    """The TP2 resume of a TP1 run continues it within the float32 rounding of the TP1 resume's
    own steps (bounds from the computation: step 4 follows an AdamW update at lr 1e-2 that
    amplifies rounding in gradients near zero, so its norm's bound is wider than step 3's).
    Control: a resume at twice the learning rate (as a schedule restored wrong would be) is
    outside the step-4 bound."""
    root, (whole, whole_norms), _ = runs
    args = [*LORA, *SHORT, "--train-iters", "4"]
    tp2 = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
    # The base comes from where the run recorded it: no --load-hf needed.
    half = str(root / "whole" / "iter_0000002")
    bounds = resume_bounds(*args, "--load", half)
    resumed, norms = train(*args, *tp2, "--load", half, "--save", str(tmp_path / "tp2"), ranks=2)
    for i in range(2):
        moved = abs(norms[i] - whole_norms[2 + i]) / whole_norms[2 + i]
        print(
            f"\nstep {3 + i}: norm {moved:.2e} from TP1 (bound {bounds[f'norm{i}']:.2e}), loss "
            f"{abs(resumed[i] - whole[2 + i]) / whole[2 + i]:.2e} ({bounds[f'loss{i}']:.2e})"
        )
        assert resumed[i] == pytest.approx(whole[2 + i], rel=bounds[f"loss{i}"]), (i, bounds)
        assert norms[i] == pytest.approx(whole_norms[2 + i], rel=bounds[f"norm{i}"]), (i, bounds)
    lr = SHORT.index("--lr") + 1
    other_lr = [*LORA, *SHORT[:lr], "2e-2", *SHORT[lr + 1 :], "--train-iters", "4"]
    _, control = train(*other_lr, *tp2, "--load", half, ranks=2)
    print(f"control, step 4: norm {abs(control[1] - whole_norms[3]) / whole_norms[3]:.2e} from TP1")
    assert control[0] == pytest.approx(whole_norms[2], rel=bounds["norm0"])  # before any update
    assert control[1] != pytest.approx(whole_norms[3], rel=bounds["norm1"]), (control, bounds)


def test_another_base_is_refused(runs, base):
    root, *_ = runs
    _, other = base
    with pytest.raises(Exception, match="trained on the base .* differs in its weights"):
        train("--load-hf", str(other), *LORA, *SHORT, "--train-iters", "4",
              "--load", str(root / "whole" / "iter_0000002"))  # fmt: skip
    assert cli("convert", "--load", str(root / "whole"), "--to-peft", str(root / "x"),
               "--base-hf", str(other)) == 2  # fmt: skip


def test_convert_writes_the_adapter_and_the_merged_model(runs, base, tmp_path):
    root, *_ = runs
    folder, _ = base
    run = str(root / "whole")
    assert cli("convert", "--load", run, "--to-peft", str(tmp_path / "peft")) == 0
    assert cli("convert", "--load", run, "--to-hf", str(tmp_path / "merged"), "--merge-lora") == 0
    assert cli("convert", "--load", run, "--to-hf", str(tmp_path / "plain")) == 2
    # The base the run records is never written, --overwrite or not (it was, with exit 0).
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    assert cli("convert", "--load", run, "--to-hf", str(folder), "--merge-lora",
               "--overwrite") == 2  # fmt: skip
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    input_ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    peft_logits, live = peft_oracle.peft_logits(folder, tmp_path / "peft", input_ids)
    assert live == 78  # every adapter of the run, none dropped by PEFT
    base_logits = hf_oracle.hf_logits(folder, input_ids)
    assert (peft_logits - base_logits).abs().max().item() > 1e-3  # the adapter trained
    # Merged weights against the adapter applied on the fly: float32 rounding, amplified by
    # GatedDeltaNet's recurrence (PEFT's own merge_and_unload moves them as much).
    merged = hf_oracle.hf_logits(tmp_path / "merged", input_ids)
    bound = hf_oracle.logits_bound(tmp_path / "merged", input_ids)
    assert (merged - peft_logits).abs().max().item() <= bound


def test_load_peft_trains_from_a_peft_adapter(base, tmp_path):
    """--load-peft, a step at lr 0, convert --to-peft: the PEFT file comes back bitwise."""
    from safetensors.torch import load_file

    folder, _ = base
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    adapter, *_ = peft_oracle.make_adapter("qwen3_5_moe", folder, tmp_path / "adapter", ids)
    train("--load-hf", str(folder), "--load-peft", str(adapter), *SHORT[:-2], "--lr", "0",
          "--train-iters", "1", "--save", str(tmp_path / "run"))  # fmt: skip
    assert cli("convert", "--load", str(tmp_path / "run"), "--to-peft", str(tmp_path / "out")) == 0
    theirs = load_file(adapter / "adapter_model.safetensors")
    ours = load_file(tmp_path / "out" / "adapter_model.safetensors")
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lora-alpha", "8"], "add --lora-rank"),
        (["--lora-rank", "4"], "pretrained base"),
        (["--load-base", "x"], "frozen base of a LoRA run"),
        (["--lora-rank", "4", "--load-peft", "p", "--load-hf", "h"], "drop --lora-rank"),
        (["--lora-rank", "4", "--load-hf", "h", "--load-base", "b"], "choose one"),
        (["--lora-rank", "0", "--load-hf", "h"], "--lora-rank must be"),
        (["--lora-rank", "4", "--lora-dropout", "1.5", "--load-hf", "h"], "--lora-dropout"),
    ],
)
def test_lora_flags_are_checked_first(argv, message):
    from megatron_hybrid.cli.main import build_parser, load_commands
    from megatron_hybrid.training.lora_rules import validate_lora_flags
    from megatron_hybrid.training.settings import SettingsError

    args = build_parser(load_commands()).parse_args(["train", *argv])
    with pytest.raises(SettingsError, match=message):
        validate_lora_flags(args)


def _batch_worker(rank, world_size, commands):
    import contextlib
    import io

    from megatron_hybrid.cli.main import main

    out = []
    for argv in commands:
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            out.append((main(argv), stdout.getvalue()))
    return out


def _peft_logprobs(hf, adapter, sequences) -> list[torch.Tensor]:
    """log_softmax of peft's logits (transformers' alone without ``adapter``), per sequence."""
    model = peft_oracle.load_base(hf)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    out = []
    with torch.no_grad():
        for s in sequences:
            logits = model(input_ids=torch.tensor([s]), use_cache=False).logits[0].double()
            log_p = torch.log_softmax(logits, -1)[:-1]
            out.append(log_p.gather(-1, torch.tensor(s[1:])[:, None]).squeeze(-1))
    return out


def _error(path, reference) -> float:
    records = [json.loads(line)["logprobs"] for line in path.read_text().splitlines()]
    return max(
        (torch.tensor(got, dtype=torch.float64) - want).abs().max().item()
        for got, want in zip(records, reference, strict=True)
    )


def test_logprobs_and_check_checkpoint_read_adapters(runs, base, tmp_path):
    """logprobs scores the adapted model, as peft computes it, for --load-hf BASE --load-peft
    ADAPTER and for --load RUN (a LoRA run; base from its record); check-checkpoint names the
    run's adapters and base and how to export them. Control: the base's own log-probs."""
    root, *_ = runs
    folder, _ = base
    run = str(root / "whole")
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))
    adapter, *_ = peft_oracle.make_adapter("qwen3_5_moe", folder, tmp_path / "adapter", ids)
    sequences = [[int(t) for t in torch.randint(0, 256, (n,), generator=torch.Generator()
                                                .manual_seed(n))] for n in (5, 17, 9)]  # fmt: skip
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"input_ids": s}) + "\n" for s in sequences))
    out = {name: tmp_path / f"{name}.jsonl" for name in ("peft", "run")}
    commands = [
        ["logprobs", "--load-hf", str(folder), "--load-peft", str(adapter), "--input",
         str(source), "--output", str(out["peft"])],
        ["logprobs", "--load", run, "--input", str(source), "--output", str(out["run"])],
        ["convert", "--load", run, "--to-peft", str(tmp_path / "exported")],
        ["check-checkpoint", "--load", run],
    ]  # fmt: skip
    done = run_distributed(_batch_worker, 1, commands, timeout=900)[0]
    assert [code for code, _ in done] == [0, 0, 0, 0], done[-1][1]
    base_logprobs = _peft_logprobs(folder, None, sequences)
    for name, peft_folder in (("peft", adapter), ("run", tmp_path / "exported")):
        reference = _peft_logprobs(folder, peft_folder, sequences)
        # A log-prob errs by at most twice its logits' error (the HF logits tests' bound).
        bounds = [peft_oracle.peft_bound(folder, peft_folder, torch.tensor([s])) for s in sequences]
        bound = max(1e-3, 2 * max(bounds))
        assert _error(out[name], reference) <= bound, (name, bound)
        assert max((a - b).abs().max().item() for a, b in zip(reference, base_logprobs,
                                                              strict=True)) > 1e-2  # fmt: skip
    report = done[3][1]
    assert (
        "LoRA run" in report and "rank 4, alpha 8" in report and "targets:    all-linear" in report
    )
    assert f"base:       {folder}" in report and "present" in report
    assert f"convert --load {run} --to-peft" in report and "--merge-lora" in report
    assert "OK: the adapters load on their recorded base" in report
