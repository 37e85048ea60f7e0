"""Whether DeepEP's ``HybridEPBuffer`` can be made on this machine, apart from the tests.

    torchrun --nproc_per_node N tests/functional/hybridep_probe.py HIDDEN TOKENS EXPERTS

Every rank builds the buffer megatron-core 0.19.2's flex dispatcher builds
(``fused_a2a.init_hybrid_ep_buffer`` over the whole world, ``EXPERTS / N`` local experts) and
the job exits 0. With DeepEP hybrid-ep 94a9f8f the constructor has died with SIGSEGV on one H100
and on four H200 (``hybrid_ep_buffer.py``, ``hybrid_ep_cpp.HybridEPBuffer(...)``): a crash no
test process survives, so ``test_hybridep_gpu.py`` asks this job first and skips with what it
saw instead of losing its whole job (and every test queued behind it) to each crash.
"""

from __future__ import annotations

import os
import sys

import torch


def main(argv: list[str]) -> int:
    hidden, tokens, experts = (int(x) for x in argv)
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", local))
    from megatron.core.transformer.moe import fused_a2a

    world = torch.distributed.get_world_size()
    fused_a2a.init_hybrid_ep_buffer(
        torch.distributed.group.WORLD,
        hidden_dim=hidden,
        num_tokens=tokens,
        num_local_experts=experts // world,
    )
    torch.cuda.synchronize()
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        print(f"HybridEPBuffer made on {world} rank(s)", flush=True)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
