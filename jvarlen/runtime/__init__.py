"""Train state, the jitted step, checkpoints, metrics and the training loop."""

from jvarlen.runtime.state import TrainState, create_train_state, make_optimizer
from jvarlen.runtime.step import loss_and_grads, loss_sums, make_train_step

__all__ = [
    "TrainState",
    "create_train_state",
    "loss_and_grads",
    "loss_sums",
    "make_optimizer",
    "make_train_step",
]
