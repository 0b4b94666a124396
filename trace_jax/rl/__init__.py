"""The learner side of FP4 RL: advantages, losses with IS correction, the aligned train step
(none / qat / trace), routing replay, weight sync, mismatch metrics."""

from trace_jax.rl.objectives import (group_advantages, mismatch_metrics, policy_loss,
                                     token_weights)
from trace_jax.rl.train_step import (ALIGNMENTS, RLConfig, TrainBatch, TrainState,
                                     batch_from_rollout, code_agreement, init_state, learner,
                                     loss_fn,
                                     make_optimizer, make_train_step, offload_to_host,
                                     split_microbatches, to_device, trainer_context)

__all__ = [
    "ALIGNMENTS", "RLConfig", "TrainBatch", "TrainState", "batch_from_rollout", "code_agreement",
    "group_advantages", "learner", "init_state", "loss_fn", "make_optimizer", "make_train_step",
    "mismatch_metrics", "offload_to_host", "policy_loss", "split_microbatches", "to_device",
    "token_weights", "trainer_context",
]
