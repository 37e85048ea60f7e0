"""``train --load-hf`` and ``train --load`` of converted or HF-started checkpoints (CPU)."""

from __future__ import annotations

import hf_oracle
import pytest
import torch

from megatron_hybrid.testing.spawn import run_distributed

pytestmark = pytest.mark.slow

SHORT = ["--seq-length", "32", "--micro-batch-size", "2", "--lr", "1e-3"]


def _train_worker(rank, world_size, argv):
    from megatron_hybrid.cli.main import build_parser, load_commands
    from megatron_hybrid.training.run import run_training
    from megatron_hybrid.training.train_settings import settings_from_args

    parser = build_parser(load_commands())
    args = parser.parse_args(["train", *argv])
    summary = run_training(settings_from_args(args))
    return summary.losses


def train(*argv: str) -> list[float]:
    (losses,) = run_distributed(_train_worker, 1, list(argv), timeout=600)
    return losses


def test_load_hf_trains_and_every_way_in_gives_the_same_run(tmp_path):
    """--load-hf, --load of its convert --from-hf checkpoint, and a resume all agree."""
    source = hf_oracle.make_hf_checkpoint("qwen3_5_moe", tmp_path / "hf")
    hf_oracle.add_serving_files(source)  # the run's checkpoints carry them to the export
    from_hf = train("--load-hf", str(source), "--train-iters", "4", *SHORT,
                    "--save", str(tmp_path / "run"), "--save-interval", "2")  # fmt: skip
    # Four steps on four different batches: that the loss falls is not a property of so few
    # steps (the synthetic batches' losses vary more); that the weights moved is checked on the
    # export below.
    assert len(from_hf) == 4 and all(torch.isfinite(torch.tensor(from_hf)))

    argv = ["--from-hf", str(source), "--save", str(tmp_path / "ckpt")]
    assert run_distributed(_cli_worker, 1, argv)[0] == 0
    # Both record the Hugging Face model: check-checkpoint needs no flags for either.
    from megatron_hybrid.cli.main import main

    for folder in ("run", "ckpt"):
        assert main(["check-checkpoint", "--load", str(tmp_path / folder)]) == 0, folder
    from_ckpt = train("--load", str(tmp_path / "ckpt"), "--train-iters", "4", *SHORT)
    assert from_ckpt == from_hf  # the same initial weights, the same steps

    # The run's checkpoint records the HF model: it resumes without model flags...
    resumed = train("--load", str(tmp_path / "run") + "/iter_0000002", "--train-iters", "4",
                    *SHORT)  # fmt: skip
    assert resumed == pytest.approx(from_hf[2:], rel=1e-6)
    # ... and exports back to a Hugging Face folder transformers loads.
    argv = ["--load", str(tmp_path / "run"), "--to-hf", str(tmp_path / "out")]
    assert run_distributed(_cli_worker, 1, argv)[0] == 0
    exported = hf_oracle.read_tensors(tmp_path / "out")
    original = hf_oracle.read_tensors(source)
    assert set(exported) == set(original)
    moved = [k for k in original if not torch.equal(exported[k].float(), original[k].float())]
    assert len(moved) > len(original) // 2  # the run trained them (norms, routers, experts...)
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(hf_oracle.hf_logits(tmp_path / "out", ids)).all()
    from transformers import AutoTokenizer, GenerationConfig

    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / "out" / name).read_bytes() == (source / name).read_bytes(), name
    text = "a tokenizer goes with every export"
    assert AutoTokenizer.from_pretrained(tmp_path / "out")(text) == (
        AutoTokenizer.from_pretrained(source)(text)
    )
    assert GenerationConfig.from_pretrained(tmp_path / "out").max_new_tokens == 7


def _cli_worker(rank, world_size, argv):
    # In its own process: the command ends by destroying its process group.
    from megatron_hybrid.cli.main import main

    return main(["convert", *argv])


def test_mla_trains_on_cpu():
    """'+' (MLA) on the local backend: the package's MLA core attention, no TransformerEngine."""
    losses = train("--hybrid-layer-pattern", "[+-][+E]{2}/+E", "--num-experts", "4",
                   "--train-iters", "10")  # fmt: skip
    assert len(losses) == 10
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses


def test_load_hf_and_load_together_are_refused(tmp_path):
    from megatron_hybrid.cli.main import main

    assert main(["train", "--load-hf", str(tmp_path), "--load", str(tmp_path)]) == 2


def _recording_train_worker(rank, world_size, argv):
    """``_train_worker`` that also records the Mamba numerics every torch mixer was built with."""
    import functools

    from megatron_hybrid.modules import mamba_torch

    built = []
    original = mamba_torch.TorchMambaMixer.__init__

    @functools.wraps(original)  # the signature stays readable (the FLOP count reads defaults)
    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        built.append((self.dt_limit, self.norm_eps))

    mamba_torch.TorchMambaMixer.__init__ = init
    return _train_worker(rank, world_size, argv), built


def test_load_hf_nemotron_trains_with_transformers_mamba_numerics(tmp_path):
    """A Nemotron-H start trains with the step clamp and norm eps transformers uses (the oracle's
    time_step_min 0.5 and layer_norm_epsilon 1e-6), not megatron-core's defaults."""
    source = hf_oracle.make_hf_checkpoint("nemotron_h", tmp_path / "hf")
    argv = ["--load-hf", str(source), "--train-iters", "3", *SHORT]
    ((losses, built),) = run_distributed(_recording_train_worker, 1, argv, timeout=600)
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert built and set(built) == {((0.5, float("inf")), 1e-6)}
