"""Simulated hosts on one machine: Linux network namespaces on one private switch.

Each host is a network namespace with its own loopback and one veth port on a bridge that
lives in a namespace of its own, so nothing touches the machine's real network: the
addresses (10.201.0.0/24) exist only inside these namespaces. A loopback assumption fails
here exactly as it would across machines. Every process is started in its own session and
ended by PID; `close()` kills whatever is left in each namespace, then deletes them all.
"""

import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

SUBNET = "10.201.0"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"ftprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"cannot create a network namespace: {getattr(e, 'stderr', '') or e}".strip()
    _ip("netns", "delete", probe)
    return None


class Hosts:
    def __init__(self, names: list[str]):
        self.tag = secrets.token_hex(2)
        self.switch = f"ft{self.tag}sw"
        self.ns = {n: f"ft{self.tag}{n}" for n in names}
        self.addr = {n: f"{SUBNET}.{i + 1}" for i, n in enumerate(names)}
        self.procs: list[subprocess.Popen] = []
        try:
            _ip("netns", "add", self.switch)
            _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.switch, "link", "set", "br0", "up")
            for i, n in enumerate(names):
                ns, host_if, port = self.ns[n], f"v{self.tag}{i}", f"p{self.tag}{i}"
                _ip("netns", "add", ns)
                _ip("link", "add", host_if, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.switch)
                _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{self.addr[n]}/24", "dev", host_if)
                _ip("-n", ns, "link", "set", host_if, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def start(self, host: str, argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        """`argv` inside `host`'s namespace, in its own session, output to `log`."""
        with open(log, "ab") as f:
            p = subprocess.Popen(
                ["ip", "netns", "exec", self.ns[host], *argv],
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.procs.append(p)
        return p

    def cut(self, host: str, off: bool = True) -> None:
        """Take `host`'s port on the switch down (or back up): its packets vanish, no socket
        closes, nothing in the host notices (a partition, not a crash)."""
        i = list(self.ns).index(host)
        _ip("-n", self.switch, "link", "set", f"p{self.tag}{i}", "down" if off else "up")

    def pids(self, host: str) -> list[int]:
        r = subprocess.run(["ip", "netns", "pids", self.ns[host]], capture_output=True, text=True, timeout=10)
        return [int(x) for x in r.stdout.split()]

    def kill_host(self, host: str) -> list[int]:
        """kill -9 every process of the host: a whole machine lost."""
        pids = self.pids(host)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def listening(self, host: str) -> list[tuple[str, int]]:
        """(local address, pid) of every listening TCP socket in the host's namespace."""
        r = subprocess.run(
            ["ip", "netns", "exec", self.ns[host], "ss", "-Hltnp"], capture_output=True, text=True, timeout=10
        )
        out = []
        for line in r.stdout.splitlines():
            cols = line.split()
            local = cols[3]
            for part in line.split("pid=")[1:]:
                out.append((local, int(part.split(",")[0])))
        return out

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for n in self.ns:
            if self._exists(self.ns[n]):
                self.kill_host(n)
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for ns in [*self.ns.values(), self.switch]:
            if self._exists(ns):
                subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=10)

    @staticmethod
    def _exists(ns: str) -> bool:
        return os.path.exists(f"/var/run/netns/{ns}")

    def __enter__(self) -> "Hosts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
