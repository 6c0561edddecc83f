"""The replica-group launcher: R groups x K ranks on ftcore, restarted group by group.

    python -m training launch --shards DIR --replica-groups R --ranks-per-group K \
        [--lighthouse HOST:PORT --job-id ID] [--groups 0,1] [--faults PLAN] [--out DIR] [-- trainer args]

The trainer's front end of ftcore's launcher (ftcore/launcher/: supervision, warm spares, the
hosted lighthouse, faults): it runs `python -m training train` in every rank, and at the end
prints each group's checksum and writes OUT/timeline.json (logged to the trainer's MLflow run) and its
bounded summary OUT/timeline.summary.json (training/timeline_summary.py), which the Lighthouse tab reads.
"""

import argparse
import functools
import json
import os
import shlex
import sys
from dataclasses import dataclass

from ftcore import environment, final_state, launcher
from ftcore.faults import PlanError
from ftcore.launcher import TOY, GroupFailed, LaunchError, Proc
from training import config, timeline_summary
from training.checkpoint_key import KEY_ENV, use_default

__all__ = [
    "TOY",
    "TRAINER",
    "GroupFailed",
    "TrainerLaunchConfig",
    "LaunchError",
    "TrainerLauncher",
    "Proc",
    "main",
    "parse",
]

SHM_DIR = "/dev/shm"  # comm.transport=smfree's default shm_dir
TRAINER = "training.__main__"


@dataclass
class TrainerLaunchConfig(launcher.LaunchConfig):
    worker: str = TRAINER


class TrainerLauncher(launcher.Launcher):
    """ftcore's launcher running the trainer (or another --worker), with the trainer's consumers
    of its records: checksums of the final states, the timeline, MLflow."""

    def worker_argv(self, g: int) -> list[str]:
        if self.cfg.worker != TRAINER:
            return super().worker_argv(g)
        out = os.path.join(self.out, f"replica_{g}")
        return ["train", "--shards", self.cfg.shards or "", "--out", out, *self.cfg.extra]

    def worker_module(self) -> str:
        return "training" if self.cfg.worker == TRAINER else self.cfg.worker

    @functools.cached_property
    def ft_env(self) -> dict[str, str]:
        """The trainer's [ft] settings as its ranks' variables (trainer_ft), read once: every rank
        of the run, a restarted group's too, gets the same, whatever its --config file says later."""
        return trainer_ft(self.cfg.extra) if self.cfg.worker == TRAINER else {}

    def job_env(self) -> dict[str, str]:
        return {**super().job_env(), **self.ft_env}

    def spare_preload(self) -> list[str]:
        return ["training.train"] if self.cfg.worker == TRAINER else []

    def after_kill(self) -> None:
        from training.comm import shm  # a SIGKILLed rank cannot remove its shared-memory outboxes

        shm.sweep(SHM_DIR)

    def finish(self, code: int) -> int:
        sums = self.report()
        if not code and (not self.done or len(sums) < len(self.done)):
            code = 1
        self.write_timeline(sums, code)
        return code

    def report(self) -> dict[int, str]:
        """A checksum of every group's final state (all its rank files); warns when they differ."""
        sums = {}
        for g in self.mine:
            paths = self.final_state(g)
            if paths:
                sums[g] = final_state.checksum(paths)
                where = paths[0] if len(paths) == 1 else f"{paths[0]} + {len(paths) - 1} rank file(s)"
                print(
                    f"[launch] replica_{g} checksum {sums[g]} ({where}), restarts {self.restarts.get(g, 0)}", flush=True
                )
        if len(set(sums.values())) > 1:
            print("[launch] WARNING: replica groups ended with different states", flush=True)
        return sums

    def write_timeline(self, sums: dict[int, str], code: int) -> None:
        events = []
        lh_file = os.path.join(self.out, "lighthouse-events.jsonl")
        if os.path.exists(lh_file):
            with open(lh_file) as f:
                events = [json.loads(line) for line in f if line.strip().startswith("{")]
        elif self.cfg.lighthouse:  # a standing lighthouse: its recent events of this job
            events = (self.status() or {}).get("events", [])
        # A relaunch into the same OUT (an Airflow retry) appends to the files of the earlier
        # attempts: the timeline is this launch's.
        events = [e for e in events if e.get("t", 0) >= self.started]
        records = step_records(self.out)
        steps = [s for s in records if s.get("t", 0) >= self.started]
        earlier = [s for s in records if s.get("t", 0) < self.started]
        summary = {
            **summarize(events + self.events, steps),
            **job_steps(steps, earlier),
            **per_group(events, steps, self.restarts),
        }
        timeline = {
            "exit_code": code,
            "checksums": {str(g): s for g, s in sums.items()},
            "restarts": self.restarts,
            "summary": summary,
            "launcher_events": self.events,
            "lighthouse_events": events,
            "steps": sorted(steps, key=lambda r: r["t"]),
        }
        timeline_summary.write(self.out, timeline)  # and its bounded summary, which the Lighthouse tab reads
        print(f"[launch] timeline {os.path.join(self.out, 'timeline.json')}: {json.dumps(summary)}", flush=True)
        log_to_mlflow(self.out, summary, os.path.join(self.out, "timeline.json"))


def step_records(out: str) -> list[dict]:
    """Every step attempt every rank recorded under OUT (its records/*.jsonl files)."""
    steps = []
    for root, _, files in os.walk(out):
        for name in files:
            if name.endswith(".jsonl") and os.path.basename(root) == "records":
                with open(os.path.join(root, name)) as f:
                    for line in f:
                        try:
                            steps.append(json.loads(line))
                        except json.JSONDecodeError:
                            pass
    return steps


def summarize(events: list[dict], steps: list[dict]) -> dict:
    """Recovery figures from the events and step records (pure data; MLflow-free)."""
    fails = [e["t"] for e in events if e["kind"] in ("failure_detected",)]
    quorums = [e for e in events if e["kind"] == "quorum_formed"]
    heals = [e for e in events if e["kind"] == "heal_finished"]
    committed = [s for s in steps if s.get("committed")]
    return {
        "failures_detected": len(fails),
        "quorum_changes": len(quorums),
        "heals": len(heals),
        "step_attempts": len(steps),
        "failed_attempts": sum(1 for s in steps if not s.get("committed") and not s.get("idle")),
        "idle_rounds": sum(1 for s in steps if s.get("idle")),
        "mean_participants": (sum(s["participants"] for s in committed) / len(committed)) if committed else 0.0,
    }


def job_steps(steps: list[dict], earlier: list[dict]) -> dict:
    """The job's committed steps over all its launches (its step number: a resumed launch goes on
    from its checkpoint's), this launch's, and those this launch committed again after a resume
    (an earlier launch of the folder had committed them past the checkpoint it resumed from)."""
    mine = {s["step"] for s in steps if s.get("committed")}
    resumed = bool(mine) and min(mine) > 1  # a fresh job commits step 1 first
    before = {s["step"] for s in earlier if s.get("committed")} if resumed else set()
    return {
        "committed_steps": max(mine, default=0),
        "launch_committed_steps": len(mine),
        "redone_steps": len(mine & before),
    }


def per_group(events: list[dict], steps: list[dict], restarts: dict[int, int]) -> dict:
    """Each replica group's own facts, as `group<g>/...` (the job's one MLflow run holds them)."""
    out = {}
    for g, n in sorted(restarts.items()):
        out[f"group{g}/restarts"] = n
        out[f"group{g}/committed_steps"] = len({s["step"] for s in steps if s.get("group") == g and s.get("committed")})
        out[f"group{g}/heals"] = sum(
            1 for e in events if e.get("kind") == "heal_finished" and e.get("group") == g and e.get("rank", 0) == 0
        )
        out[f"group{g}/slow_exclusions"] = sum(
            1 for e in events if e.get("kind") == "group_excluded" and e.get("group") == g
        )
    return out


def log_to_mlflow(out: str, summary: dict, timeline: str) -> None:
    """Recovery metrics and the timeline on the trainer's MLflow run, when there is one."""
    result = os.path.join(out, "replica_0", "result.json")
    if not os.path.exists(result):
        return
    try:
        with open(result) as f:
            res = json.load(f)
        if not res.get("mlflow_run_id") or not res.get("tracking_uri"):
            return
        import mlflow

        client = mlflow.MlflowClient(tracking_uri=res["tracking_uri"])
        for k, v in summary.items():
            client.log_metric(res["mlflow_run_id"], k if k.startswith("group") else f"ft/{k}", float(v))
        client.log_artifact(res["mlflow_run_id"], timeline)
        from training.timeline import png

        chart = os.path.join(out, "timeline.png")  # committed steps per group, faults and heals marked
        with open(timeline) as f:
            if png(json.load(f), chart):
                client.log_artifact(res["mlflow_run_id"], chart)
    except Exception as e:  # tracking is best effort; the run itself succeeded
        print(f"[launch] could not log recovery events to MLflow: {e}", flush=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training launch", description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", help="shard set (python -m dataprep shards)")
    p.add_argument("--replica-groups", type=int, default=2, help="R: replica groups (units of failure)")
    p.add_argument("--ranks-per-group", type=int, default=1, help="K: ranks per replica group")
    p.add_argument(
        "--lighthouse",
        help="HOST:PORT of a standing lighthouse (default: start one here); its token "
        "comes from FTCORE_TOKEN_FILE or FTCORE_TOKEN",
    )
    p.add_argument(
        "--job-id",
        default=os.environ.get("FTCORE_JOB_ID") or "default",
        help="this job's id on the lighthouse (jobs sharing a standing lighthouse need distinct ids)",
    )
    p.add_argument(
        "--groups",
        help="comma-separated replica groups this launcher runs (default: all of "
        "0..R-1; the others run elsewhere against the same --lighthouse)",
    )
    p.add_argument(
        "--print-commands",
        action="store_true",
        help="print each replica group as one torchrun command (for a cluster) and exit",
    )
    p.add_argument("--faults", help="fault plan, TOML or JSON (see ftcore/faults.py)")
    p.add_argument("--out", default="work/launch", help="output folder: replica_<g>/, timeline.json, ledger/")
    p.add_argument(
        "--worker",
        default=TRAINER,
        help=f"module with main(argv) run by each rank (default: the trainer; {TOY} is a self-contained toy)",
    )
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--max-restarts", type=int, default=5, help="per group")
    p.add_argument(
        "--replace-after",
        type=float,
        default=15.0,
        help="seconds a live group may stay unhealthy before it is killed and restarted",
    )
    p.add_argument("--lr-policy", choices=("none", "linear", "sqrt"), default="sqrt")
    p.add_argument("--timeout", type=float, default=3600.0, help="give up (non-zero exit) after this many seconds")
    p.add_argument("--no-spares", action="store_true", help="restart groups cold (for benchmarks)")
    p.add_argument(
        "--oversubscribe-gpus",
        action="store_true",
        help="let replica groups share GPUs when the host has fewer than groups x ranks (tests, "
        "one-GPU checks); the ranks of one group always get distinct GPUs",
    )
    return p


def parse(argv: list[str]) -> TrainerLaunchConfig:
    """The launcher's flags (argv before `--`; what follows goes to every rank), checked."""
    extra = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    a = _parser().parse_args(argv)
    if a.replica_groups < 1 or a.ranks_per_group < 1:
        raise LaunchError("--replica-groups and --ranks-per-group must be >= 1")
    groups = None
    if a.groups:
        try:
            groups = sorted({int(g) for g in a.groups.split(",") if g.strip()})
        except ValueError:
            raise LaunchError(f"--groups {a.groups!r}: give comma-separated group ids, for example 0,2") from None
        if not groups or not all(0 <= g < a.replica_groups for g in groups):
            raise LaunchError(f"--groups {a.groups}: every id must be in 0..{a.replica_groups - 1} (--replica-groups)")
        if a.lighthouse is None and len(groups) < a.replica_groups:
            raise LaunchError("--groups runs part of the job: give the --lighthouse the other groups use")
    from ftcore.messages import JOB_ID

    if not JOB_ID.fullmatch(a.job_id):
        raise LaunchError(f"--job-id {a.job_id!r}: use letters, digits and ._:/+@=- (up to 128, FTCORE_JOB_ID)")
    if a.worker == TRAINER and not a.shards:
        raise LaunchError("--shards is required to launch the trainer (a folder from `python -m dataprep shards`)")
    if a.worker == TRAINER:
        trainer_ft(extra)  # the trainer's settings are checked here, before any rank starts
    if a.shards and not os.path.isfile(os.path.join(a.shards, "manifest.json")):
        raise LaunchError(f"--shards {a.shards}: no manifest.json there; build it with `python -m dataprep shards`")
    return TrainerLaunchConfig(
        a.shards,
        a.replica_groups,
        a.ranks_per_group,
        a.lighthouse,
        a.job_id,
        groups,
        a.faults,
        a.out,
        a.worker,
        a.min_replicas,
        a.max_restarts,
        0.1,
        a.replace_after,
        a.timeout,
        not a.no_spares,
        a.lr_policy,
        extra,
        a.print_commands,
        oversubscribe_gpus=a.oversubscribe_gpus,
    )


def trainer_ft(extra: list[str]) -> dict[str, str]:
    """The [ft] settings the ranks' trainer arguments change (their --config and --set), as the
    environment that carries them to every rank and to the lighthouse hosted here; the whole
    trainer config is checked now, before any rank starts."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--config")
    p.add_argument("--set", action="append", nargs="+", default=[])
    a, _ = p.parse_known_args(extra)
    try:
        cfg = config.load_config(a.config, [kv for group in a.set for kv in group])
    except config.ConfigError as e:
        raise LaunchError(f"the trainer's settings after --: {e}") from None
    return environment.ft_env(cfg.ft.changed())


def _checkpoint_key(out: str) -> None:
    """The ranks' checkpoint key: FTREC_CHECKPOINT_KEY_FILE, else OUT/checkpoint.key (made once)."""
    if not os.environ.get(KEY_ENV, "").strip():
        made = use_default(out)
        print(
            f"[launch] no {KEY_ENV}: checkpoints are sealed with {made} (reading them elsewhere needs it)", flush=True
        )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        cfg = parse(argv)
        job = TrainerLauncher(cfg)
    except (LaunchError, PlanError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.worker == TRAINER:
        _checkpoint_key(cfg.out)
    if cfg.print_commands:
        try:  # the commands name OUT/job-token: written under the run folder's lease
            job.lease.acquire()
            job.host.write_tokens()
        except LaunchError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        finally:
            job.lease.release()
        # a rank under torchrun seals and reads checkpoints with the key this launch uses
        key = f"{KEY_ENV}={shlex.quote(os.environ[KEY_ENV])} " if cfg.worker == TRAINER else ""
        for g in job.mine:
            print(key + job.torchrun_command(g))
        return 0
    try:
        return job.run()
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        job.stop.set()
        job.end_all()
        return 2
    except KeyboardInterrupt:
        job.stop.set()
        job.end_all()
        return 130


if __name__ == "__main__":
    sys.exit(main())
