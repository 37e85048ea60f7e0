"""Reset megatron-core's process-global state between models (tests and CPU demos).

The implementation lives in :mod:`megatron_hybrid.process_groups`, which the ``train`` and
``check-checkpoint`` commands use too; tests import it from here.
"""

from megatron_hybrid.process_groups import initialize_model_parallel, reset_megatron_state

__all__ = ["initialize_model_parallel", "reset_megatron_state"]
