"""ftcore's launcher: R replica groups x K ranks of a worker module on one host, with a hosted
lighthouse, warm spares, group restarts and the external part of a fault plan.

The worker is a parameter: any module with main(argv) (ftcore.examples.toy, the trainer);
training/launch.py is the trainer's front end and consumes the launch's records."""

from ftcore.launcher.config import TOY, GroupFailed, LaunchConfig, LaunchError
from ftcore.launcher.procs import Proc
from ftcore.launcher.supervisor import Launcher

__all__ = ["TOY", "GroupFailed", "LaunchConfig", "LaunchError", "Launcher", "Proc"]
