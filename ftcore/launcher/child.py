"""A launcher child's entry point: `run MODULE ARGS` (python -m MODULE ARGS, ended with the
launcher) or `spare WORKER [PRELOAD...]` (a warm process that runs WORKER.main(argv) once told)."""

import datetime
import importlib
import json
import runpy
import sys

from ftcore import environment
from ftcore.launcher.procs import SPARE_READY
from ftcore.util.procs import die_with_parent


def run_module(argv: list[str]) -> int:
    """Run `python -m MODULE ARGS` as a child that ends when the launcher ends."""
    die_with_parent()
    sys.argv = [argv[0], *argv[1:]]
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    return 0


def warm_up() -> None:
    """First use of an optimizer, autograd and gloo pulls in more modules (seconds): pay now."""
    import torch
    import torch.distributed as dist

    from ftcore import netaddr

    m = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.zeros(2, 4)).sum().backward()
    opt.step()
    fd, port = netaddr.listen_fd("127.0.0.1")
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, master_listen_fd=fd)
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, absent from the stubs
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = datetime.timedelta(seconds=5)
    dist.ProcessGroupGloo(dist.PrefixStore("warm", store), 0, 1, opts)
    del store


def spare(worker: str, preload: list[str]) -> int:
    """A warm process: imports done, waits for its group assignment on stdin, then runs."""
    die_with_parent()
    import torch  # noqa: F401  # the point: pay for imports and lazy initialisation before a failure

    mod = importlib.import_module(worker)
    for name in preload:
        importlib.import_module(name)
    warm_up()
    print(SPARE_READY, flush=True)
    line = sys.stdin.readline()
    if not line:
        return 0
    msg = json.loads(line)
    environment.adopt(msg["env"])
    return int(mod.main(msg["argv"]) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["spare"] and len(argv) >= 2:
        return spare(argv[1], argv[2:])
    if argv[:1] == ["run"] and len(argv) >= 2:
        return run_module(argv[1:])
    print("usage: python -m ftcore.launcher.child {run MODULE [ARGS...] | spare WORKER [PRELOAD...]}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
