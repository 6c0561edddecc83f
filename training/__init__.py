"""training: the model, the training loop, evaluation, checkpoints, tracking and the launcher.

Tour (each module is one concept; train.py reads top to bottom as the loop):
- config.py      typed config: dataclasses, TOML file, `--set section.key=value`
- data.py        shard set checks, shard-rank mapping, prefetching reader, data cursor
- model.py       SeqRec: causal self-attention over jagged histories (sasrec | hstu)
- loss.py        sampled softmax (shared negatives) | BCE, over the group's global token count
- state.py       TrainState (model, optimizer, scheduler, step, cursor, RNG), optimizer, lr schedule
- distributed.py torch.distributed set-up for one replica group, gradient all-reduce
- checkpoint.py  atomic, weights-only checkpoints
- evaluate.py    leave-one-out HR/NDCG/MRR, full ranking and sampled protocols
- metrics.py     per-rank step timing (compute / wait), windows for logging, plots
- tracking.py    asynchronous, failure-tolerant MLflow
- train.py       the loop; __main__.py the CLI (train, eval, launch); benchmarks/training_bench.py measures it
- ft.py, launch.py (ftcore) and comm/ (FreeScale communication) plug into the loop.
"""
