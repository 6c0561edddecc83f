"""Real heal fetches and relay heartbeats under a flood of idle, tokenless sockets (issue #41).

    python benchmarks/preauth_flood.py                      # this tree's ftcore
    python benchmarks/preauth_flood.py --at 38c15cd         # heal.py and relay.py as of a commit

200 idle sockets from loopback, topped up at 50 a second as the server closes them
(tests/conftest.py IdleFlood), while 20 heal fetches and 30 relay heartbeats with the job's
token are made one after another. Prints how many succeeded and writes
bench-results/preauth_flood.json.
"""

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
from conftest import IdleFlood  # noqa: E402

from ftcore.lighthouse_client import call  # noqa: E402
from ftcore.messages import RankInfo  # noqa: E402

TOKEN = "tok"


def _modules(at: str | None, tmp: Path):
    """ftcore.heal and ftcore.relay: this tree's, or the files as of commit `at`."""
    if at is None:
        from ftcore import heal, relay

        return heal, relay
    out = []
    for name in ("heal", "relay"):
        path = tmp / f"{name}_{at}.py"
        path.write_bytes(
            subprocess.run(["git", "show", f"{at}:ftcore/{name}.py"], cwd=ROOT, check=True, capture_output=True).stdout
        )
        spec = importlib.util.spec_from_file_location(f"{name}_{at}", path)
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        out.append(mod)
    return tuple(out)


def heal_fetches(heal, n: int = 20) -> int:
    srv = heal.HealServer(token=TOKEN)
    srv.offer(2, {"w": torch.arange(4.0)})
    ok = 0
    try:
        with IdleFlood(srv.address, n=200):
            time.sleep(0.5)
            for _ in range(n):
                try:
                    ok += torch.equal(heal.fetch(srv.address, 2, TOKEN, timeout=10)["w"], torch.arange(4.0))
                except heal.HealError:
                    pass
                time.sleep(0.05)
    finally:
        srv.close()
    return ok


def relay_beats(relay, n: int = 30) -> int:
    r = relay.Relay("127.0.0.1:9", RankInfo(group=0, rank=0, world=2, job="a"), TOKEN, "127.0.0.1")
    rank1 = RankInfo(group=0, rank=1, world=2, job="a")
    ok = 0
    try:
        with IdleFlood(r.address, n=200):
            time.sleep(0.5)
            for _ in range(n):
                ok += call(r.address, "/heartbeat", rank1.to_wire(), TOKEN, timeout=10)[0] == 200
                time.sleep(0.05)
    finally:
        r.close()
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--at", help="a commit: its ftcore/heal.py and ftcore/relay.py instead of this tree's")
    ap.add_argument("--json", default=str(ROOT / "bench-results" / "preauth_flood.json"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        heal, relay = _modules(a.at, Path(d))
        row = {
            "code": a.at or "tree",
            "heal_ok": heal_fetches(heal),
            "heal_of": 20,
            "relay_ok": relay_beats(relay),
            "relay_of": 30,
        }
    print(f"{'code':8} {'heal fetches':>13} {'relay beats':>12}")
    print(f"{row['code']:8} {row['heal_ok']:>10}/20 {row['relay_ok']:>9}/30")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(row, indent=1) + "\n")


if __name__ == "__main__":
    main()
