"""GRPO end to end on a toy task, on a CPU in under two minutes: the RL trainer's API in use.

    python examples/grpo_toy.py --out grpo_run                  # full weights
    python examples/grpo_toy.py --out grpo_run --lora-rank 8    # LoRA adapters only

A tiny Qwen3.5-MoE (two attention layers with routed-expert MoEs; ``--gdn``: the first one a
GatedDeltaNet, as in the real model) is made by transformers with random weights and saved in
``OUT/model``; ``load_hf_model`` builds the
policy from it and, separately, the "engine" that samples (a second copy, as an inference engine
holds one). Every step: the engine gets the policy's weights through ``iter_hf_weights`` (merged,
with LoRA), samples a group of answers per prompt, a verifiable rule rewards them, advantages are
normalised within each group, and ``PolicyTrainer.step`` applies the clipped policy loss.

The task: a prompt is ``[MARK, q]`` with ``q`` one of ``--questions`` question tokens; the answer
(one token) is right when it lies in the upper half of the vocabulary for an even ``q``, in the
lower half for an odd one. A policy that ignores the prompt is right half of the time whatever it
outputs (the questions are drawn evenly), so a mean reward well above 0.5 means it learned the
rule. Prints the reward per step, writes ``OUT/rewards.json`` and ``OUT/reward_curve.png``.

Needs transformers to make the model (the ``test`` extra; or ``--model`` a folder made
before, e.g. by a CPU run: ``OUT/model``) and matplotlib for the picture (``viz``; without it
the picture is skipped with a note). Runs on one GPU as it is (the CUDA runtime is picked when
one is visible).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

MARK = 1  # the first prompt token
CHANCE = 0.5  # the mean reward of any policy that ignores the question


def make_model(folder: Path, args: argparse.Namespace) -> Path:
    """A tiny Qwen3.5-MoE with transformers' random initialisation, saved with save_pretrained."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    config = Qwen3_5MoeTextConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        num_hidden_layers=2,
        layer_types=["linear_attention" if args.gdn else "full_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=args.hidden_size // 4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        num_experts=args.experts,
        num_experts_per_tok=2,
        moe_intermediate_size=args.hidden_size // 2,
        shared_expert_intermediate_size=args.hidden_size // 2,
        tie_word_embeddings=False,
        max_position_embeddings=64,
        # Weights of scale 1/sqrt(fan-in) rather than transformers' 0.02: the logits then move
        # when the layers below the (frozen, with LoRA) output layer do.
        initializer_range=args.hidden_size**-0.5,
    )
    torch.manual_seed(args.seed)
    model = Qwen3_5MoeForCausalLM._from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


def rewards(prompts: list[torch.Tensor], answers: list[torch.Tensor], vocab: int) -> torch.Tensor:
    """1.0 where the answer is in the half of the vocabulary the question's parity asks for."""
    upper = torch.stack([a[0] >= vocab // 2 for a in answers])
    even = torch.stack([p[-1] % 2 == 0 for p in prompts])
    return (upper == even).float()


def group_advantages(reward: torch.Tensor, group: int) -> torch.Tensor:
    """GRPO's advantages: each reward minus its group's mean, over the group's deviation."""
    grouped = reward.view(-1, group)
    mean, std = grouped.mean(-1, keepdim=True), grouped.std(-1, keepdim=True)
    return ((grouped - mean) / (std + 1e-6)).view(-1)


def plot(rewards_per_step: list[float], path: Path, title: str) -> bool:
    """Draw the reward curve; False (with a note) where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no {path.name} (install the viz extra)", flush=True)
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(rewards_per_step) + 1), rewards_per_step, marker="o", label="mean reward")
    ax.axhline(CHANCE, color="grey", linestyle="--", label="chance (ignores the question)")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_ylim(0, 1.05)
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the model and results")
    parser.add_argument("--model", type=Path, default=None, help="a Hugging Face folder made "
                        "before (OUT/model of an earlier run) instead of a new one: for "
                        "machines without transformers")  # fmt: skip
    parser.add_argument("--steps", type=int, default=20, help="GRPO steps (0: only make the "
                        "model folder OUT/model, for a machine without transformers)")  # fmt: skip
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8, help="answers sampled per prompt")
    parser.add_argument("--questions", type=int, default=8, help="distinct question tokens")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: 1e-2, "
                        "3e-2 with LoRA)")  # fmt: skip
    parser.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this "
                        "rank instead of the full weights (0: full weights)")  # fmt: skip
    parser.add_argument("--kl-coef", type=float, default=0.0, help="KL penalty to the initial "
                        "weights (a frozen reference model; 0: none)")  # fmt: skip
    parser.add_argument("--gdn", action="store_true", help="make the first layer a "
                        "GatedDeltaNet (slow on a CPU: its torch path runs sequence by "
                        "sequence)")  # fmt: skip
    parser.add_argument("--vocab-size", type=int, default=64)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.model is not None:
        config = json.loads((args.model / "config.json").read_text())
        args.vocab_size = config.get("text_config", config)["vocab_size"]
    if args.steps < 0:
        parser.error("--steps must be >= 0")
    if args.questions + 2 > args.vocab_size or args.questions < 2:
        parser.error("--questions must be at least 2 and fit in the vocabulary")
    if args.lr is None:
        args.lr = 3e-2 if args.lora_rank else 1e-2
    return args


def main(argv=None) -> dict:
    """Run the loop; return ``{"rewards": [...], "first", "last", "sync_error", ...}`` (also
    written to rewards.json). ``sync_error`` is the largest difference between the engine's and
    the policy's log-probs of the last batch after a final weight sync."""
    from megatron_hybrid.hf import load_hf_model, load_hf_weights
    from megatron_hybrid.logprobs import forward_logprobs
    from megatron_hybrid.peft import LoRAConfig, apply_lora
    from megatron_hybrid.rl import PolicyTrainer, sample

    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    folder = args.model or make_model(args.out / "model", args)
    if args.steps == 0:
        print(f"made {folder}", flush=True)
        return {"model": str(folder)}
    policy = load_hf_model(folder)  # sets up the process groups (one CPU process, or torchrun)
    if args.lora_rank:
        apply_lora(policy, LoRAConfig(rank=args.lora_rank, alpha=2 * args.lora_rank))
    engine = load_hf_model(folder)
    reference = load_hf_model(folder) if args.kl_coef else None
    trainer = PolicyTrainer(policy, optimizer="adam", lr=args.lr, clip_grad=1.0)
    vocab, group = args.vocab_size, args.group_size
    questions = torch.arange(2, 2 + args.questions)
    draw = torch.Generator().manual_seed(args.seed)
    history, began = [], time.perf_counter()
    for step in range(args.steps):
        # Weight sync: the engine's copy gets the policy's current weights by Hugging Face name.
        load_hf_weights(engine, dict(trainer.iter_hf_weights(merge_lora=bool(args.lora_rank))))
        picked = questions[torch.randint(0, len(questions), (args.prompts,), generator=draw)]
        prompts = [torch.tensor([MARK, int(q)]) for q in picked for _ in range(group)]
        answers = sample(engine, prompts, max_new_tokens=1, seed=args.seed * 100_003 + step)
        reward = rewards(prompts, answers, vocab)
        advantages = group_advantages(reward, group)
        sequences = [torch.cat([p, a]) for p, a in zip(prompts, answers, strict=True)]
        masks = [torch.tensor([0.0] * (len(p) - 1) + [1.0] * len(a))
                 for p, a in zip(prompts, answers, strict=True)]  # fmt: skip
        old = trainer.logprobs(sequences)  # the weights the answers were sampled with
        ref = forward_logprobs(reference, sequences) if reference is not None else None
        metrics = trainer.step(
            sequences,
            loss_masks=masks,
            advantages=[float(a) for a in advantages],
            old_logprobs=old,
            ref_logprobs=ref,
            kl_coef=args.kl_coef,
        )
        history.append(float(reward.mean()))
        print(
            f"step {step + 1:>3}/{args.steps} | reward {history[-1]:.3f} | loss "
            f"{metrics.loss:+.4f} | entropy {metrics.entropy:.3f} | kl {metrics.kl:.4f} | grad "
            f"norm {metrics.grad_norm:.3f} | {time.perf_counter() - began:.1f} s",
            flush=True,
        )
    # The engine holds what the policy computes: synced, both score the last batch alike.
    load_hf_weights(engine, dict(trainer.iter_hf_weights(merge_lora=bool(args.lora_rank))))
    engine_lp = forward_logprobs(engine, sequences)
    sync_error = max(
        (a - b).abs().max().item()
        for a, b in zip(engine_lp, trainer.logprobs(sequences), strict=True)
    )
    window = min(5, len(history))
    result = dict(
        rewards=history,
        first=statistics.fmean(history[:window]),
        last=statistics.fmean(history[-window:]),
        chance=CHANCE,
        lora_rank=args.lora_rank,
        sync_error=sync_error,
        seconds=time.perf_counter() - began,
    )
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        (args.out / "rewards.json").write_text(json.dumps(result, indent=1) + "\n")
        mode = f"LoRA rank {args.lora_rank}" if args.lora_rank else "full weights"
        drawn = plot(history, args.out / "reward_curve.png", f"GRPO toy task ({mode})")
        print(
            f"reward {result['first']:.3f} (first {window} steps) -> {result['last']:.3f} (last "
            f"{window}); chance {CHANCE}; engine vs policy log-probs {sync_error:.1e}; "
            f"{result['seconds']:.0f} s; wrote {args.out / 'rewards.json'}"
            + (f" and {args.out / 'reward_curve.png'}" if drawn else ""),
            flush=True,
        )
    return result


if __name__ == "__main__":
    if not torch.cuda.is_available():
        # The toy's tensors are tiny: a CPU thread pool only adds synchronisation to each op.
        torch.set_num_threads(1)
    main()
    sys.exit(0)
