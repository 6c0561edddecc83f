"""`--overwrite` replaces only a shard set dataprep wrote, never a folder that merely holds a manifest.json."""

import json
import subprocess
import sys

import pytest

from dataprep import schema
from dataprep.build import build_shards
from dataprep.errors import DataprepError
from dataprep.synth import write_synthetic


@pytest.fixture(scope="module")
def synth_file(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("syn") / "s.txt", users=300, items=100, seed=1, max_history=50)


@pytest.fixture
def built(tmp_path, synth_file):
    out = tmp_path / "set"
    build_shards(synth_file, "sasrec", str(out), world_size=2, batch_size=8)
    return out


def _refused(out, synth_file):
    with pytest.raises(DataprepError) as e:
        build_shards(synth_file, "sasrec", str(out), world_size=4, batch_size=8, overwrite=True)
    assert "--overwrite" not in str(e.value) and "not a dataprep shard-set manifest" in str(e.value)


@pytest.mark.parametrize("content", ["{}", "not json", '{"files": {}}', "[1, 2]", '{"format_version": 1}'])
def test_a_folder_with_a_foreign_manifest_is_never_replaced(tmp_path, synth_file, content):
    out = tmp_path / "mine"
    out.mkdir()
    (out / schema.MANIFEST).write_text(content)
    (out / "thesis.tex").write_text("years of work")
    _refused(out, synth_file)
    assert (out / "thesis.tex").read_text() == "years of work"
    assert (out / schema.MANIFEST).read_text() == content


def test_a_shard_set_with_an_unlisted_file_is_not_replaced(built, synth_file):
    (built / "maps" / "notes.txt").write_text("a user's file")
    _refused(built, synth_file)
    assert (built / "maps" / "notes.txt").exists()


def test_a_copied_real_manifest_does_not_license_deleting_other_files(built, tmp_path, synth_file):
    out = tmp_path / "mine"
    out.mkdir()
    (out / schema.MANIFEST).write_text((built / schema.MANIFEST).read_text())
    (out / "data.csv").write_text("1,2,3")
    _refused(out, synth_file)
    assert (out / "data.csv").exists()


def test_a_real_shard_set_is_still_replaced(built, synth_file):
    m = build_shards(synth_file, "sasrec", str(built), world_size=4, batch_size=8, overwrite=True)
    assert m["config"]["world_size"] == 4
    assert json.loads((built / schema.MANIFEST).read_text())["config"]["world_size"] == 4


def test_cli_refusal_is_one_line_without_overwrite_hint(tmp_path, synth_file):
    out = tmp_path / "mine"
    out.mkdir()
    (out / schema.MANIFEST).write_text("{}")
    (out / "keep.txt").write_text("x")
    for extra in ([], ["--overwrite"]):
        r = subprocess.run(
            [sys.executable, "-m", "dataprep", "shards", "--input", synth_file, "--format", "sasrec", "--out", str(out)]
            + ["--world-size", "2", "--batch-size", "8", *extra],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
        assert "not a dataprep shard-set manifest" in r.stderr and "--overwrite" not in r.stderr
    assert (out / "keep.txt").exists()
