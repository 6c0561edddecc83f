"""training: the model, the training loop, evaluation, checkpoints, tracking and the launcher."""
