"""What a ``train`` run writes about itself: progress lines, metrics.jsonl, TensorBoard events,
loss_curve.png, and the :class:`TrainingSummary` it returns.

Rank 0 prints a progress line every ``--log-interval`` steps (:class:`ProgressLine`) and
writes, into ``--log-dir`` (default: the ``--save`` folder; nothing without either):

- ``metrics.jsonl``: one JSON object per applied step, ``{"step", "loss", "lr", "grad_norm",
  "tokens_per_second"}``, and one per evaluation, ``{"step", "validation_loss"}``. A resumed run
  first drops the records after its checkpoint's iteration (steps a crashed run logged but never
  saved), so the file always describes the run that leads to the checkpoints;
- ``loss_curve.png`` at the end of the run: the training loss (and validation loss) over every
  step in the file (matplotlib, the ``viz`` extra; a note says so when it is missing);
- with ``--tensorboard-dir``, the same values as TensorBoard scalars under Megatron-LM's names
  (``lm loss``, ``learning-rate``, ``grad-norm``, ``throughput``, ``lm loss validation``).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from megatron_hybrid.checkpointing.store import LOG_FILES
from megatron_hybrid.training.throughput import DevicePeak, tflops_per_gpu, throughput_text

__all__ = [
    "LOSS_CURVE_FILE",
    "METRICS_FILE",
    "WARMUP_STEPS",
    "MetricsLog",
    "ProgressLine",
    "TrainingSummary",
    "read_metrics",
]

# The checkpoint store's names: a save root may hold them beside its checkpoints.
METRICS_FILE, LOSS_CURVE_FILE = LOG_FILES


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics file (none if it does not exist)."""
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _replace(path: Path, text: str) -> None:
    temporary = path.with_name(path.name + ".partial")
    temporary.write_text(text)
    os.replace(temporary, path)


class MetricsLog:
    """The run's metrics, on rank 0 (other ranks get an inert one).

    Args:
        folder: where ``metrics.jsonl`` and ``loss_curve.png`` go (None: neither).
        tensorboard_dir: TensorBoard's folder (None: none).
        start: the iteration the run starts from (records after it are dropped).
        enabled: whether this rank writes.
        title: the loss curve's title.
    """

    def __init__(self, folder, tensorboard_dir, *, start: int, enabled: bool, title: str = ""):
        self.enabled, self.title = enabled, title
        self.folder = Path(folder) if folder and enabled else None
        self.writer = None
        if not enabled:
            return
        if self.folder is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= start]
            _replace(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(tensorboard_dir))

    @property
    def path(self) -> Path:
        return self.folder / METRICS_FILE

    def _append(self, record: dict) -> None:
        if self.folder is not None:
            with open(self.path, "a") as stream:
                stream.write(json.dumps(record) + "\n")

    def step(
        self,
        step: int,
        *,
        loss: float,
        lr: float,
        grad_norm: float,
        tokens_per_second: float,
        tflops_per_gpu: float | None = None,
    ):
        """One applied step; ``tflops_per_gpu`` (GPUs only) is recorded where given."""
        if not self.enabled:
            return
        row = dict(step=step, loss=loss, lr=lr, grad_norm=grad_norm,
                   tokens_per_second=tokens_per_second)  # fmt: skip
        if tflops_per_gpu is not None:
            row["tflops_per_gpu"] = tflops_per_gpu
        self._append(row)
        if self.writer is not None:
            scalars = [("lm loss", loss), ("learning-rate", lr), ("grad-norm", grad_norm),
                       ("throughput", tokens_per_second)]  # fmt: skip
            if tflops_per_gpu is not None:
                scalars.append(("tflops-per-gpu", tflops_per_gpu))
            for name, value in scalars:
                self.writer.add_scalar(name, value, step)

    def validation(self, step: int, loss: float) -> None:
        if not self.enabled:
            return
        self._append(dict(step=step, validation_loss=loss))
        if self.writer is not None:
            self.writer.add_scalar("lm loss validation", loss, step)

    def close(self) -> str | None:
        """Flush TensorBoard and draw the loss curve; return a note when it cannot be drawn."""
        if not self.enabled:
            return None
        if self.writer is not None:
            self.writer.close()
        if self.folder is None:
            return None
        return draw_loss_curve(read_metrics(self.path), self.folder / LOSS_CURVE_FILE, self.title)


def draw_loss_curve(records: list[dict], path: Path, title: str = "") -> str | None:
    """The training (and validation) loss over the steps of ``records``, as a PNG at ``path``;
    returns a note instead when matplotlib is missing or there is nothing to draw."""
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    valid = [(r["step"], r["validation_loss"]) for r in records if "validation_loss" in r]
    if not train and not valid:
        return None
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return f"{path.name} not drawn: needs matplotlib (pip install 'megatron_hybrid[viz]')"
    figure = Figure(figsize=(7, 4), dpi=100)
    axes = figure.add_subplot()
    if train:
        axes.plot(*zip(*train, strict=True), label="training loss", linewidth=1)
    if valid:
        axes.plot(*zip(*valid, strict=True), "o-", label="validation loss")
    axes.set_xlabel("iteration")
    axes.set_ylabel("loss")
    axes.set_title(title, fontsize=9)
    axes.grid(alpha=0.3)
    axes.legend()
    temporary = path.with_name(path.name + ".partial.png")
    figure.savefig(temporary)
    os.replace(temporary, path)
    return None


class ProgressLine:
    """Rank 0's per-step line: an updating bar on a terminal, plain lines in logs."""

    def __init__(self, total: int, enabled: bool, interval: int = 1):
        self.total, self.enabled, self.interval = total, enabled, interval
        self.tty = enabled and sys.stdout.isatty()

    def update(
        self,
        iteration: int,
        loss: float,
        lr: float,
        norm: float,
        tok_s: float,
        extra: str | None = None,
    ) -> None:
        """One step's line (every ``interval`` steps and the last); ``extra`` is appended (the
        step's TFLOP/s per GPU and MFU on GPUs)."""
        if not self.enabled or (iteration % self.interval and iteration != self.total):
            return
        done = int(20 * iteration / max(self.total, 1))
        bar = "#" * done + "." * (20 - done)
        line = (
            f"[{bar}] step {iteration:>5}/{self.total} | loss {loss:.4f} | lr {lr:.3g} | "
            f"grad norm {norm:.3f} | {tok_s:,.0f} tok/s"
        ) + (f" | {extra}" if extra else "")
        print(f"\r{line}" if self.tty else line, end="" if self.tty else "\n", flush=True)

    def note(self, text: str) -> None:
        """A line of its own between progress updates."""
        if self.enabled:
            print(f"\n{text}" if self.tty else text, flush=True)

    def close(self) -> None:
        if self.tty:
            print()


#: Steps at the start of a run that pay for one-time work (kernel autotuning and compilation,
#: lazy allocations, the first collectives) and are timed apart from the rest.
WARMUP_STEPS = 1


@dataclass(frozen=True)
class TrainingSummary:
    """What a run did, returned by :func:`run_training`.

    Attributes:
        first_iteration, last_iteration: the iterations the run went from and to.
        losses, grad_norms: per applied step (skipped non-finite steps left out).
        saved: the last checkpoint folder written, if any.
        step_seconds, step_tokens: wall time and real tokens of each applied step.
        step_flops: model FLOPs of each applied step (real tokens; ``training.throughput``).
        gpus: GPUs the run used (0 on the CPU: no TFLOP/s or MFU reported).
        peak: the peak MFU divides by (None: unknown, no MFU).
        learning_rates: the rate of each applied step.
        validation_losses: ``(iteration, loss)`` of each evaluation.
    """

    first_iteration: int
    last_iteration: int
    losses: list[float]
    grad_norms: list[float]
    saved: str | None
    step_seconds: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    step_flops: list[float] = field(default_factory=list)
    gpus: int = 0
    peak: DevicePeak | None = None
    learning_rates: list[float] = field(default_factory=list)
    validation_losses: list[tuple[int, float]] = field(default_factory=list)

    @property
    def warmup_seconds(self) -> float:
        """Wall time of the first :data:`WARMUP_STEPS` applied steps."""
        return sum(self.step_seconds[:WARMUP_STEPS])

    @property
    def median_step_seconds(self) -> float | None:
        """Median time of the steps after warm-up (None: the run had none)."""
        timed = self.step_seconds[WARMUP_STEPS:]
        return statistics.median(timed) if timed else None

    @property
    def tokens_per_second(self) -> float:
        """Median tokens/s of the steps after warm-up (the warm-up's own rate if none came
        after it; 0 without steps)."""
        pairs = list(zip(self.step_tokens, self.step_seconds, strict=True))
        timed = pairs[WARMUP_STEPS:] or pairs
        return statistics.median(t / s for t, s in timed) if timed else 0.0

    @property
    def throughput(self) -> str | None:
        """Median TFLOP/s per GPU and MFU of the steps after warm-up (the warm-up's if none came
        after it), as ``train`` prints them; None on the CPU or without FLOPs."""
        if not self.gpus or len(self.step_flops) != len(self.step_seconds):
            return None
        flops, seconds = self.step_flops[WARMUP_STEPS:], self.step_seconds[WARMUP_STEPS:]
        if not seconds:
            flops, seconds = self.step_flops, self.step_seconds
        return throughput_text(tflops_per_gpu(flops, seconds, self.gpus), self.peak)
