"""What an install of ftrec weighs, per extra, and what mlflow-skinny would save.

    .venv/bin/python benchmarks/install_weight.py

Walks the dependency closure of ftrec's requirements (base, [airflow], [kubernetes]) through
the metadata of the packages installed in this venv and adds up the on-disk size of every
file their RECORD lists: what `pip install` leaves on disk here, not download sizes. For
MLflow it also weighs the closure with `mlflow-skinny` in place of `mlflow`, plus the
packages the trainer itself then needs (pandas for the pyfunc model's signature and input
example, sqlalchemy and alembic for the embedded SQLite store), which `mlflow` brings today.
"""

import importlib.metadata as md
import os

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

MIB = 1 << 20
DISTS: dict[str, md.Distribution] = {canonicalize_name(d.metadata["Name"]): d for d in md.distributions()}


def size(name: str) -> int:
    d = DISTS[name]
    total = 0
    for f in d.files or []:
        try:
            total += os.path.getsize(str(d.locate_file(f)))  # a Path here; typed as a SimplePath
        except OSError:
            pass
    return total


def closure(roots: list[str]) -> set[str]:
    seen: set[str] = set()
    todo = [canonicalize_name(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen or name not in DISTS:
            continue
        seen.add(name)
        for r in DISTS[name].requires or []:
            req = Requirement(r)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(req.name))
    return seen


def mib(names: set[str]) -> float:
    return sum(size(n) for n in names) / MIB


def main() -> None:
    ftrec = DISTS["ftrec"]
    reqs = ftrec.requires or []
    base_reqs = [Requirement(r).name for r in reqs if "extra ==" not in r]
    extra = {x: [Requirement(r).name for r in reqs if f'extra == "{x}"' in r] for x in ("airflow", "kubernetes")}
    base = closure(base_reqs)
    airflow = closure(base_reqs + extra["airflow"])
    k8s = closure(base_reqs + extra["airflow"] + extra["kubernetes"])
    skinny_roots = [r for r in base_reqs if canonicalize_name(r) != "mlflow"] + ["mlflow-skinny"]
    skinny = closure(skinny_roots + ["pandas", "sqlalchemy", "alembic"])
    print(f"{'install':52s} {'packages':>8s} {'MiB':>7s}")
    print(
        f"{'pip install ftrec (base)':52s} {len(base):8d} {mib(base):7.0f}   of which torch {size('torch') / MIB:.0f}"
    )
    print(f"{'pip install ftrec[airflow]':52s} {len(airflow):8d} {mib(airflow):7.0f}")
    print(
        f"{'pip install ftrec[airflow,kubernetes]':52s} {len(k8s):8d} {mib(k8s):7.0f}   "
        f"+{mib(k8s - airflow):.0f}: {', '.join(sorted(k8s - airflow))}"
    )
    print(
        f"{'base, mlflow-skinny + pandas, sqlalchemy, alembic':52s} {len(skinny):8d} {mib(skinny):7.0f}   "
        f"-{mib(base - skinny):.0f}: {', '.join(sorted(base - skinny, key=size, reverse=True)[:10])}, ..."
    )
    airflow_skinny = closure(skinny_roots + ["pandas", "sqlalchemy", "alembic"] + extra["airflow"])
    print(
        f"{'[airflow], the same':52s} {len(airflow_skinny):8d} {mib(airflow_skinny):7.0f}   "
        f"-{mib(airflow - airflow_skinny):.0f}: "
        f"{', '.join(sorted(airflow - airflow_skinny, key=size, reverse=True)[:6])}, ..."
    )


if __name__ == "__main__":
    main()
