"""training: the model, the training loop, evaluation, checkpoints, tracking and the launcher.

train.py reads top to bottom as the loop; components.py holds what acts after a step;
replica.py (ftcore) and comm/ (FreeScale communication) plug into the loop.
docs/training.md has a tour of the modules.
"""
