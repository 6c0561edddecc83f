"""The import graph is the architecture: dataprep and ftcore stand side by side on the ground
floor (neither imports the other), training rests on both, the Airflow plugin on everything.
Every import counts, the lazy ones inside functions included; ftcore's docstring names each
package it needs beyond the standard library; and a class name is defined once in the library."""

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = {"dataprep", "training", "ftcore", "ftrec_airflow"}
FOLDERS = {"dataprep": ROOT / "dataprep", "training": ROOT / "training", "ftcore": ROOT / "ftcore"}
MAY_IMPORT = {"dataprep": set(), "ftcore": set(), "training": {"dataprep", "ftcore"}}


def imports(folder: Path) -> dict[str, set[str]]:
    """Top-level package name -> the files of `folder` that import it (absolute imports)."""
    found: dict[str, set[str]] = {}
    for f in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for n in names:
                found.setdefault(n.split(".")[0], set()).add(str(f.relative_to(folder.parent)))
    return found


@pytest.mark.parametrize("package", sorted(FOLDERS))
def test_a_package_imports_only_the_floors_below_it(package):
    found = imports(FOLDERS[package])
    wrong = {n: sorted(fs) for n, fs in found.items() if n in PROJECT - {package} - MAY_IMPORT[package]}
    assert not wrong, f"{package} may import {sorted(MAY_IMPORT[package]) or 'no project package'}: {wrong}"


def test_ftcore_says_what_it_depends_on():
    third_party = {n for n in imports(FOLDERS["ftcore"]) if n not in sys.stdlib_module_names and n not in PROJECT}
    assert third_party, "the scan found no third-party import in ftcore: torch at least"
    doc = ast.get_docstring(ast.parse((FOLDERS["ftcore"] / "__init__.py").read_text())) or ""
    omitted = [n for n in sorted(third_party) if n not in doc]
    assert not omitted, f"ftcore/__init__.py's docstring omits {omitted}"


def test_the_scan_sees_lazy_imports(tmp_path):
    (tmp_path / "m.py").write_text("def f():\n    from ftcore.util import files\n    import training.model\n")
    got = imports(tmp_path)
    assert set(got) == {"ftcore", "training"}


def test_one_name_per_class():
    """A class name means one thing across the library (a reader greps for it and finds it)."""
    where: dict[str, list[str]] = {}
    for folder in [*FOLDERS.values(), ROOT / "plugins" / "ftrec_airflow"]:
        for f in sorted(folder.rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text(), str(f))):
                if isinstance(node, ast.ClassDef):
                    where.setdefault(node.name, []).append(str(f.relative_to(ROOT)))
    assert len(where) > 50, "the scan found too few classes: it checks nothing"
    twice = {name: files for name, files in where.items() if len(files) > 1}
    assert not twice, f"class names defined more than once: {twice}"


def _module(f: Path) -> str:
    rel = f.relative_to(ROOT / "plugins" if "plugins" in f.parts else ROOT).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def test_no_type_only_back_pointers():
    """An import under `if TYPE_CHECKING:` is for a heavy or optional module, never the way
    back to a module that imports this one (an owner handing itself down: give the part what
    it uses instead)."""
    files = [f for folder in [*FOLDERS.values(), ROOT / "plugins" / "ftrec_airflow"] for f in folder.rglob("*.py")]
    direct = {_module(f): {n for n, _ in _imported(f)} for f in files}
    back = []
    for f in files:
        for name, type_only in _imported(f):
            if type_only and _module(f) in direct.get(name, set()):
                back.append(f"{_module(f)} -> {name}")
    assert "training.replica" in direct and len(direct) > 100, "the scan found too few modules"
    assert not back, f"type-only imports of a module that imports this one: {back}"


def _imported(f: Path) -> list[tuple[str, bool]]:
    """(module, under TYPE_CHECKING) for each absolute `from X import` / `import X` of `f`."""
    out = []
    tree = ast.parse(f.read_text(), str(f))
    guarded = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
        for n in ast.walk(node)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module, id(node) in guarded))
        elif isinstance(node, ast.Import):
            out += [(a.name, id(node) in guarded) for a in node.names]
    return out


def environ_uses(folder: Path) -> list[str]:
    """`file:line` (under `folder`'s parent) of every touch of the process environment in
    `folder`: os.environ, os.getenv, os.putenv, os.unsetenv, and `from os import environ`."""
    touches = {"environ", "getenv", "putenv", "unsetenv", "environb"}
    found = []
    for f in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            hit = isinstance(node, ast.Attribute) and node.attr in touches and getattr(node.value, "id", "") == "os"
            hit |= (
                isinstance(node, ast.ImportFrom) and node.module == "os" and any(a.name in touches for a in node.names)
            )
            if hit:
                found.append(f"{f.relative_to(folder.parent)}:{node.lineno}")
    return found


def test_ftcore_reads_and_writes_its_environment_in_one_place():
    """ftcore/environment.py is ftcore's one door to the environment (its typed readers, RankEnv's
    from_env and to_env): a new read or write elsewhere, at import time or not, fails here."""
    uses = environ_uses(FOLDERS["ftcore"])
    elsewhere = [u for u in uses if not u.startswith("ftcore/environment.py:")]
    assert not elsewhere, f"read or write the environment through ftcore/environment.py: {elsewhere}"
    assert uses, "the scan saw not even the door itself (ftcore/environment.py)"


def test_the_environment_scan_sees_each_form(tmp_path):
    (tmp_path / "m.py").write_text("import os\nfrom os import getenv\nx = os.environ.get('X'), os.getenv('Y')\n")
    assert environ_uses(tmp_path) == [f"{tmp_path.name}/m.py:{n}" for n in (2, 3, 3)]
