"""`pip install .` into a fresh virtual environment makes the plugin visible to Airflow:
`airflow plugins` lists `ftrec`, loaded once, through the wheel's `airflow.plugins` entry
point, with every ftrec package imported from that environment and none from this checkout.

How, and why this way: the ftrec wheel is built from a copy of the working tree (`pip wheel
--no-deps`, no build isolation: no download) and installed with `--no-deps` into a new venv
of the base interpreter (`python -m venv`, no system site-packages). Its third-party
packages (Airflow, MLflow, torch, ...) are borrowed from the dev venv instead of downloaded:
a `.pth` file in the new venv adds a folder of symlinks to the dev venv's site-packages
entries, less everything of ftrec itself (its dist-info, its editable finder and `.pth`).
A plain path in a `.pth` runs no `.pth` files of that folder, so nothing can put the checkout
on `sys.path`; and with ftrec's dist-info left out there is one `ftrec` distribution, the
wheel's (Airflow would load a second one's entry point too). A real `pip install .[airflow]`
from the index would fetch and unpack the same pinned packages (over a GB with torch) for
minutes; what can differ is only what the wheel carries, which is what this checks. Runs in
well under a minute.
"""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("dataprep", "training", "ftcore", "ftrec_airflow")
SITE = Path(next(p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()))

pytestmark = pytest.mark.slow


def _run(argv: list, timeout: float, **kw) -> subprocess.CompletedProcess:
    # subprocess.run kills the child on timeout; each of these is a single process
    r = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout, **kw)
    assert r.returncode == 0, f"{argv[:4]}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def _not_ftrec(name: str) -> bool:
    return not (name.startswith(("ftrec-", "ftrec.", "__editable__", "__editable___ftrec")) or name.endswith(".pth"))


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("fresh-venv")
    src = tmp / "src"  # the working tree's files, so the build leaves nothing in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp / "dist", src], 300
    )
    (wheel,) = (tmp / "dist").glob("ftrec-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        eps = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "ftrec_airflow/plugin.py" in names and "ftrec_airflow/lighthouse_app.py" in names
    assert not any(n.startswith("plugins/") or n.startswith("dags/") for n in names)
    assert "[airflow.plugins]" in eps and "ftrec = ftrec_airflow.plugin:FtrecPlugin" in eps

    v = tmp / "v"
    _run([sys.executable, "-m", "venv", "--without-pip", v], 120)
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            v / "bin" / "python",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            wheel,
        ],
        300,
    )
    (site,) = (v / "lib").glob("python3*/site-packages")
    deps = tmp / "deps"  # the dev venv's third-party packages, without ftrec
    deps.mkdir()
    for entry in SITE.iterdir():
        if _not_ftrec(entry.name):
            (deps / entry.name).symlink_to(entry)
    (site / "zz_borrowed_deps.pth").write_text(f"{deps}\n")
    return v


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "PYTHON", "FTREC_"))}
    (tmp / "home" / "plugins").mkdir(parents=True, exist_ok=True)
    return {
        **env,
        "AIRFLOW_HOME": str(tmp / "home"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(tmp / "home" / "plugins"),
        "PYTHONNOUSERSITE": "1",
    }


WHERE = """
import importlib, importlib.metadata as md, json, sys
mods = {m: importlib.import_module(m).__file__ for m in %r}
dists = [str(d._path) for d in md.distributions() if d.metadata["Name"] == "ftrec"]
eps = [str(e) for e in md.entry_points(group="airflow.plugins")]
from ftrec_airflow import settings
home = {"root": str(settings.PROJECT_ROOT), "checkout": settings.IN_CHECKOUT, "work": str(settings.work_root())}
print("JSON" + json.dumps({"mods": mods, "dists": dists, "eps": eps, "path": sys.path, "home": home}))
"""


def test_the_wheel_alone_gives_airflow_the_plugin(venv, tmp_path):
    py = venv / "bin" / "python"
    r = _run([py, "-c", WHERE % (PACKAGES + ("ftrec_airflow.plugin",),)], 120, cwd=tmp_path, env=_env(tmp_path))
    where = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("JSON"))[4:])
    inside = str(venv.resolve())
    for mod, path in where["mods"].items():
        assert str(Path(path).resolve()).startswith(inside), f"{mod} from {path}, not the fresh venv"
    assert len(where["dists"]) == 1 and where["dists"][0].startswith(str(venv))
    assert not any(str(ROOT) == p or p.startswith(str(ROOT) + os.sep) for p in where["path"]), where["path"]
    # no checkout around an installed ftrec: the current directory plays the project's part
    assert where["home"] == {"root": str(tmp_path), "checkout": False, "work": str(tmp_path / "work")}

    # what the wheel declares (torch, mlflow, ... pins) is met by what that venv has
    _run([sys.executable, "-m", "pip", "--python", py, "check"], 120, cwd=tmp_path, env=_env(tmp_path))

    r = _run([py, "-m", "airflow", "plugins", "-o", "json"], 180, cwd=tmp_path, env=_env(tmp_path))
    plugins = json.loads(r.stdout[r.stdout.index("[") :])
    ftrec = [p for p in plugins if p["name"] == "ftrec"]
    assert len(ftrec) == 1, plugins  # once: the entry point, no plugins folder
    assert "ftrec_airflow.plugin:FtrecPlugin" in ftrec[0]["source"] and ftrec[0]["source"].startswith("ftrec==")
    assert {v["destination"] for v in ftrec[0]["external_views"]} == {"dag_run", "nav"}
    assert ftrec[0]["fastapi_apps"][0]["url_prefix"] == "/ftrec"
