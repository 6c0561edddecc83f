"""`free_port()`: a TCP port on loopback that was free a moment ago.

One definition for the tests, the rank spawner (training/comm/spawn.py) and the
benchmark scripts. Standard library only, so that scripts which never touch torch
(benchmarks/lighthouse_*.py) can import it without paying for torch.
"""

import socket


def free_port() -> int:
    """A port the OS just handed out on 127.0.0.1 and released again: free now, though another
    process may take it before the caller binds it (fine on a test or benchmark host)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
