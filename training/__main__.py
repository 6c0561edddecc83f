"""`python -m training {train,eval,launch,config,...}` (or `ftrec ...`): the trainer's command line.

train: one process, or one rank under torchrun; eval: a checkpoint on valid/test users;
launch: R replica groups x K ranks with fault tolerance; config --show: every setting;
data: `python -m dataprep ...`; calibrate: the model's cost model for dataprep.
Settings: the defaults, a TOML file (`--config`), then `--set section.key=value`.
A user error (bad config, shard set, checkpoint) prints one line and exits with status 2.
"""

import argparse
import json
import sys


def ft_not_applied(changed: dict) -> str:
    from ftcore.environment import FT_SETTINGS, ft_defaults

    now = ft_defaults()
    said = ", ".join(f"ft.{k}={v!r} but this rank runs with {now[k]!r} ({FT_SETTINGS[k]})" for k, v in changed.items())
    return (
        f"{said}: [ft] settings reach a rank through its environment; start the ranks with "
        "`python -m training launch`, which sets it, or export those variables"
    )


def _train(args) -> int:
    from training.config import load_config
    from training.train import train

    overrides = [kv for group in (args.set or []) for kv in group]
    cfg = load_config(args.config, overrides)
    if args.shards:
        cfg.data.shards = args.shards
    if args.out:
        cfg.train.out = args.out
    if args.resume:
        cfg.train.resume = True
    unapplied = cfg.ft.changed()  # [ft] acts through the rank's environment: the launcher sets it
    if unapplied:
        print(f"error: {ft_not_applied(unapplied)}", file=sys.stderr)
        return 2
    from ftcore.lighthouse_client import JobFinished

    try:
        result = train(cfg)
    except JobFinished as e:  # restarted after the job ended: nothing to rejoin, nothing to write
        print(f"[train] {e}", flush=True)
        return 0
    if result:
        print(json.dumps({k: v for k, v in result.items() if k != "metrics"}, sort_keys=True))
    return 0


def _eval(args) -> int:
    from training.evaluate import evaluate_checkpoint

    overrides = [kv for group in (args.set or []) for kv in group]
    scores = evaluate_checkpoint(args.checkpoint, args.shards, overrides)
    text = json.dumps(scores, indent=1, sort_keys=True)
    if args.out:
        from ftcore.util.files import atomic_write_text

        atomic_write_text(args.out, text)
    print(text)
    return 0


def _config(args) -> int:
    from training.config import describe, load_config

    if not args.show:
        print("error: config: say what to do: --show lists every setting", file=sys.stderr)
        return 2
    print(describe(load_config(args.config, [kv for group in (args.set or []) for kv in group])))
    return 0


def _launch(argv: list[str]) -> int:
    try:
        from training.launch import main
    except ImportError as e:
        print(
            f"error: `training launch` needs training/launch.py (ftcore's launcher), which is not "
            f"available here ({e}); use `torchrun ... -m training train` for one replica group",
            file=sys.stderr,
        )
        return 2
    return main(argv) or 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "launch":  # the launcher parses its own flags
        return _launch(argv[1:])
    if argv and argv[0] == "calibrate":  # the configured model's cost model (training/calibrate.py)
        from training import calibrate

        return calibrate.main(argv[1:])
    if argv and argv[0] == "data":  # the console script `ftrec` also fronts dataprep
        from dataprep import cli

        return cli.main(argv[1:])
    p = argparse.ArgumentParser(
        prog="python -m training",
        description=__doc__.splitlines()[0],
        epilog="Every trainer setting, its default and what it does: python -m training config --show",
    )
    sub = p.add_subparsers(dest="command", required=True)
    set_help = "override a setting; the value in TOML syntax, bare text is a string (config --show lists them)"
    t = sub.add_parser("train", help="train on a shard set")
    t.add_argument("--shards", help="shard-set folder (python -m dataprep shards)")
    t.add_argument(
        "--config",
        help="TOML file with [data] [model] [loss] [optim] [train] [eval] [mlflow] [comm] "
        "sections (`config --show` prints one with every setting)",
    )
    t.add_argument("--out", help="work folder: checkpoints/, result.json, mlflow.db")
    t.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in OUT")
    t.add_argument("--set", action="append", nargs="+", metavar="SECTION.KEY=VALUE", help=set_help)
    e = sub.add_parser("eval", help="evaluate a checkpoint (leave-one-out, full and sampled)")
    e.add_argument("--checkpoint", required=True, help="OUT/checkpoints/step-XXXXXXXX")
    e.add_argument("--shards", required=True)
    e.add_argument("--out", help="write the metrics as JSON here")
    e.add_argument(
        "--set",
        action="append",
        nargs="+",
        metavar="eval.KEY=VALUE",
        help="override an eval setting (the value in TOML syntax, bare text is a string)",
    )
    c = sub.add_parser("config", help="the settings: `config --show` lists each with its default and meaning")
    c.add_argument("--show", action="store_true", help="print every setting, its value and its one line, as TOML")
    c.add_argument("--config", help="show the values this TOML file gives instead of the defaults")
    c.add_argument("--set", action="append", nargs="+", metavar="SECTION.KEY=VALUE", help=set_help)
    sub.add_parser("launch", help="R replica groups x K ranks with fault tolerance (see `launch --help`)")
    sub.add_parser("data", help="dataprep: shards, verify, synth (see `data --help`)")
    args = p.parse_args(argv)

    from training.checkpoint import CheckpointError
    from training.config import ConfigError
    from training.data import DataError

    try:
        return {"train": _train, "eval": _eval, "config": _config}[args.command](args)
    except (ConfigError, DataError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
