"""A CPU checkpoint written by 2 processes (EP=2) resumes on 1 (EP=1) and on 4 (EP=4).

Model and AdamW state reshard through their checkpoint keys; the RNG state (per rank) is not
restored on another world size, which this model (no dropout, synthetic data drawn from sample
indices) does not use. So the resumed losses equal those of the run that kept its layout up to
the order of floating-point reductions: within ``BOUND`` (relative).
"""

from __future__ import annotations

import pytest
from test_checkpoint_faults import TINY

#: Relative bound on the difference from the run that kept its layout (observed: 3e-8).
BOUND = 1e-6
LAYOUT = [*TINY[:-2], "--micro-batch-size", "1", "--global-batch-size", "4"]


def train_worker(rank: int, world_size: int, argv: list[str], forget_optimizer: bool = False):
    """``run_training`` in a spawned rank; ``forget_optimizer`` is the negative control."""
    import torch

    torch.set_num_threads(1)
    from megatron_hybrid.cli.main import build_parser, load_commands
    from megatron_hybrid.training import checkpoint
    from megatron_hybrid.training.run import run_training
    from megatron_hybrid.training.train_settings import settings_from_args

    if forget_optimizer:  # a resume that drops the AdamW moments (where the loader calls it)
        checkpoint.load_cpu_optimizer_state = lambda optimizer, loaded: None
    return run_training(
        settings_from_args(build_parser(load_commands()).parse_args(["train", *argv]))
    )


def train(world_size: int, *argv: str, forget_optimizer: bool = False):
    from megatron_hybrid.testing.spawn import run_distributed

    args = (list(argv), forget_optimizer)
    return run_distributed(train_worker, world_size, *args, timeout=400)[0]


@pytest.fixture(scope="module")
def two_process_runs(tmp_path_factory):
    """6 steps on 2 processes (EP=2), and 3 steps on 2 processes saved."""
    root = tmp_path_factory.mktemp("layouts") / "ckpt"
    full = train(2, *LAYOUT, "--expert-model-parallel-size", "2", "--train-iters", "6")
    train(
        2, *LAYOUT, "--expert-model-parallel-size", "2", "--train-iters", "3", "--save", str(root)
    )
    return full, root


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("world_size", "ep"), [pytest.param(1, 1, id="2_to_1"), pytest.param(4, 4, id="2_to_4")]
)
def test_resume_on_another_layout_matches_the_unchanged_run(two_process_runs, world_size, ep):
    full, root = two_process_runs
    resumed = train(world_size, *LAYOUT, "--expert-model-parallel-size", str(ep),
                    "--train-iters", "6", "--load", str(root))  # fmt: skip
    assert (resumed.first_iteration, resumed.last_iteration) == (3, 6)
    assert resumed.losses == pytest.approx(full.losses[3:], rel=BOUND)
    assert resumed.grad_norms == pytest.approx(full.grad_norms[3:], rel=BOUND)


@pytest.mark.slow
def test_bound_fails_without_the_optimizer_state(two_process_runs):
    """Negative control: the comparison above notices a resume that loses the AdamW moments."""
    full, root = two_process_runs
    resumed = train(1, *LAYOUT, "--train-iters", "6", "--load", str(root), forget_optimizer=True)
    assert resumed.losses[1:] != pytest.approx(full.losses[4:], rel=BOUND)


@pytest.mark.parametrize(
    ("saved", "now", "error"),
    [
        pytest.param({"tp": 1, "pp": 1, "ep": 2, "cp": 1, "etp": 1, "dp": 2},
                     {"tp": 1, "pp": 1, "ep": 2, "cp": 1, "etp": 1, "dp": 4}, None, id="dp_only"),
        pytest.param({"tp": 2, "pp": 1, "ep": 1, "cp": 1, "etp": 2, "dp": 1},
                     {"tp": 1, "pp": 1, "ep": 1, "cp": 1, "etp": 1, "dp": 2},
                     "reshards only over data parallelism; keep TP, PP and EP", id="tp_change"),
    ],
)  # fmt: skip
def test_gpu_optimizer_layout_change_is_refused_before_loading(megatron_cpu, saved, now, error):
    from megatron_hybrid.training.optimizer_state import LayoutChangeError, check_layout

    common = {"world_size": 1, "parallel_layout": saved}
    if error is None:
        assert check_layout(common, "ckpt", now, cpu_optimizer=False) is True
    else:
        with pytest.raises(LayoutChangeError, match=error):
            check_layout(common, "ckpt", now, cpu_optimizer=False)
    assert check_layout(common, "ckpt", now, cpu_optimizer=True) is True  # the CPU one reshards
