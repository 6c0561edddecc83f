"""The bucketed build writes the in-memory build's shard set byte for byte (dataprep.bucketed)."""

import filecmp
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest

from dataprep import assemble, bucketed, counts, readers, schema, workdir
from dataprep.build import build_shards
from dataprep.errors import DataprepError

SHARED = Path(__file__).resolve().parent.parent.parent / "shared" / "data"


def _events(rng: np.random.Generator, users: int, n: int, first_user: int = 0) -> dict:
    """Events of `users` users with heavy-tailed counts, exact duplicates, time ties and repeats."""
    u = first_user + np.minimum(rng.zipf(1.3, n), users) - 1
    item = rng.integers(0, 400, n) * 7 + 3
    ts = 1_600_000_000_000 + rng.integers(0, 10**9, n)
    dup = rng.random(n) < 0.03  # a copy of the previous event (same user, item, time)
    dup[0] = False
    for a in (u, item, ts):
        a[dup] = a[np.flatnonzero(dup) - 1]
    tie = rng.random(n) < 0.03  # same user and time as the previous event, another item
    tie[0] = False
    u[tie], ts[tie] = u[np.flatnonzero(tie) - 1], ts[np.flatnonzero(tie) - 1]
    return {"user_id": u, "item_id": item, "timestamp": ts}


def _bad_rows(cols: dict, rng: np.random.Generator, frac: float = 0.01) -> pa.Table:
    """Nulls (missing_value) and negative ids (negative_id) in a few rows."""
    n = len(cols["user_id"])
    arrays = {k: pa.array(v, mask=rng.random(n) < frac / 3) for k, v in cols.items()}
    neg = np.flatnonzero(rng.random(n) < frac / 3)
    item = np.asarray(cols["item_id"]).copy()
    item[neg] = -item[neg] - 1
    arrays["item_id"] = pa.array(item, mask=np.asarray(arrays["item_id"].is_null()))
    return pa.table(arrays)


@pytest.fixture(scope="module")
def parquet_inputs(tmp_path_factory) -> list[str]:
    d = tmp_path_factory.mktemp("ev")
    rng = np.random.default_rng(5)
    a = _bad_rows(_events(rng, 3000, 60_000), rng)
    b = _events(rng, 3000, 30_000, first_user=2000)  # users overlapping the first file's
    tb = pa.table(b).set_column(2, "timestamp", pa.array(b["timestamp"] * 1000).cast(pa.timestamp("us")))
    pq.write_table(a, d / "a.parquet", row_group_size=7000)
    pq.write_table(tb, d / "b.parquet", row_group_size=9000)
    return [str(d / "a.parquet"), str(d / "b.parquet")]


def _manifest_text(path: Path) -> str:
    """manifest.json as written, but for when the set was made and how long each stage took."""
    m = json.loads(path.read_text())
    m["created_at"], m["timings"] = "-", {k: 0 for k in m["timings"]}
    return json.dumps(m, indent=2) + "\n"


def _assert_same(a: Path, b: Path) -> None:
    """Every file byte for byte; manifest.json too, but for its time of creation and timings."""
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    for f in files:
        if f.name == "manifest.json":
            assert _manifest_text(a / f) == _manifest_text(b / f)
        else:
            assert filecmp.cmp(a / f, b / f, shallow=False), f"{f} differs"


def _both(tmp_path: Path, inputs, fmt: str, monkeypatch=None, **kw) -> tuple[dict, list[dict]]:
    ref = build_shards(inputs, fmt, str(tmp_path / "ref"), **kw)
    out = []
    for nb in (1, 4):
        m = build_shards(inputs, fmt, str(tmp_path / f"b{nb}"), buckets=nb, **kw)
        _assert_same(tmp_path / "ref", tmp_path / f"b{nb}")
        out.append(m)
    return ref, out


@pytest.mark.parametrize("name", ["beauty.txt", "video.txt"])
def test_shared_data_same_bytes(tmp_path, name):
    path = SHARED / name
    if not path.exists():
        pytest.skip(f"{path} absent (the shared data folder is not laid out here)")
    ref, _ = _both(tmp_path, str(path), "iclrec", world_size=4, batch_size=64, max_len=50, seed=3)
    assert ref["num_users"] > 1000


def test_parquet_events_same_bytes(tmp_path, parquet_inputs, monkeypatch):
    monkeypatch.setattr(bucketed, "MIN_BATCH_ROWS", 5000)  # many batches per file
    monkeypatch.setattr(bucketed, "PIECE_ROWS", 7)  # and per rank piece: steps span batches
    monkeypatch.setattr(assemble, "block_rows", lambda ctx: 40)  # a rank file written in blocks of ~3 steps
    ref, _ = _both(
        tmp_path, parquet_inputs, "events", world_size=3, batch_size=16, max_len=20, seed=2, tail="drop", max_events=400
    )
    r = ref["rejects"]
    assert r["duplicate_event"] > 100 and r["missing_value"] > 50 and r["negative_id"] > 50
    assert r["too_short"] > 10 and r["history_too_long"] >= 1 and r["tail_dropped"] >= 1
    assert ref["format_version"] == 2 and ref["timestamps"]["input_unit"] == "us"  # b's timestamp column


def test_a_parquet_files_row_groups_are_read_in_spans_same_bytes(tmp_path, parquet_inputs, monkeypatch):
    """A large Parquet file is read in spans of its row groups, each a task of its own: every
    row group once, in order, rows counted from the file's start; the set is the in-memory
    build's, byte for byte, rejects' row numbers included (bad rows lie in every span)."""
    monkeypatch.setattr(readers, "SPAN_ROWS", 10_000)
    spans = readers.spans(parquet_inputs, "events")
    for f, path in enumerate(parquet_inputs):
        md = pq.ParquetFile(path).metadata
        starts = np.cumsum([0] + [md.row_group(g).num_rows for g in range(md.num_row_groups)]).tolist()
        mine = [s for s in spans if s["file"] == f]
        assert len(mine) >= 2
        assert [g for s in mine for _, a, b in s["groups"] for g in range(a, b)] == list(range(md.num_row_groups))
        assert [s["rows"] for s in mine] == [starts[s["groups"][0][1]] for s in mine]
        assert all(len(s["groups"]) == 1 and s["groups"][0][0] == path for s in mine)
    lines: list[str] = []
    kw = dict(world_size=3, batch_size=16, max_len=20, seed=2)
    ref = build_shards(parquet_inputs, "events", str(tmp_path / "ref"), **kw)
    build_shards(parquet_inputs, "events", str(tmp_path / "spans"), buckets=3, log=lines.append, **kw)
    _assert_same(tmp_path / "ref", tmp_path / "spans")
    assert sum(x.startswith("dataprep: scanned") and " rows " in x for x in lines) == len(spans), lines
    assert ref["rejects"]["missing_value"] > 50 and ref["rejects"]["negative_id"] > 50
    monkeypatch.setattr(readers, "SPAN_ROWS", 1)
    monkeypatch.setattr(readers, "MOST_SPANS", 3)  # at most 3 a file, however small SPAN_ROWS is
    assert [s["file"] for s in readers.spans(parquet_inputs, "events")] == [0, 0, 0, 1, 1, 1]


def test_inputs_read_whole_where_spans_do_not_apply(tmp_path, monkeypatch):
    """One span, the file whole: a file of one row group, a CSV file, a Parquet file whose
    string times are typed over the whole column, a file with no rows."""
    monkeypatch.setattr(readers, "SPAN_ROWS", 10)
    cols = {"user_id": np.arange(100) % 7, "item_id": np.arange(100), "timestamp": np.arange(100)}
    pq.write_table(pa.table(cols), tmp_path / "one.parquet")
    pcsv.write_csv(pa.table(cols), tmp_path / "a.csv")
    text_times = pa.table({**cols, "timestamp": [str(x) for x in cols["timestamp"]]})
    pq.write_table(text_times, tmp_path / "text.parquet", row_group_size=20)
    pq.write_table(pa.table(cols).slice(0, 0), tmp_path / "empty.parquet")
    paths = [str(tmp_path / n) for n in ("one.parquet", "a.csv", "text.parquet", "empty.parquet")]
    assert readers.spans(paths, "events") == [{"file": f} for f in range(4)]
    pq.write_table(pa.table(cols), tmp_path / "many.parquet", row_group_size=20)
    assert len(readers.spans([str(tmp_path / "many.parquet")], "events")) == 5


def test_mixed_id_types_and_consecutive_dedup_same_bytes(tmp_path, parquet_inputs):
    rng = np.random.default_rng(9)
    c = _events(rng, 500, 8000, first_user=100)
    t = pa.table({"user_id": [f"u{x}" for x in c["user_id"]], "item_id": c["item_id"], "timestamp": c["timestamp"]})
    pcsv.write_csv(t, tmp_path / "c.csv")
    inputs = [parquet_inputs[1], str(tmp_path / "c.csv")]  # int and text user ids: all compared as text
    _both(tmp_path, inputs, "events", world_size=2, batch_size=8, dedup="consecutive")


def test_workers_same_bytes(tmp_path, parquet_inputs):
    build_shards(parquet_inputs, "events", str(tmp_path / "ref"), world_size=2, batch_size=32)
    build_shards(parquet_inputs, "events", str(tmp_path / "w"), world_size=2, batch_size=32, buckets=3, workers=2)
    _assert_same(tmp_path / "ref", tmp_path / "w")


def test_memory_budget_parsed_and_picks_buckets(tmp_path, parquet_inputs, monkeypatch):
    assert bucketed.parse_size("512MB") == 512 << 20 and bucketed.parse_size("4gb") == 4 << 30
    assert bucketed.parse_size("1.5G") == 3 << 29 and bucketed.parse_size(100 << 20) == 100 << 20
    for bad in ("lots", "12 parsecs", "1MB"):
        with pytest.raises(DataprepError, match="--memory-budget"):
            bucketed.parse_size(bad)
    small: list[str] = []
    kw = dict(world_size=2, batch_size=32, memory_budget="64MB")
    build_shards(parquet_inputs, "events", str(tmp_path / "s"), log=small.append, **kw)
    assert not any("buckets" in x for x in small)  # fits: built in memory
    # as if each event took 40x the bytes: the in-memory build no longer fits 64MB; B from the budget
    monkeypatch.setattr(bucketed, "IN_MEMORY_BYTES_PER_EVENT", 40 * bucketed.IN_MEMORY_BYTES_PER_EVENT)
    monkeypatch.setattr(bucketed, "BYTES_PER_EVENT", 2000)
    lines: list[str] = []
    build_shards(parquet_inputs, "events", str(tmp_path / "b"), log=lines.append, **kw)
    events = sum(pq.ParquetFile(p).metadata.num_rows for p in parquet_inputs)  # a few are rejects: same B
    # one process runs THREADS buckets at once, each in its share of the budget: more buckets than
    # the whole budget needs, at most what a share needs (a heavy user may merge two bounds)
    (nb,) = [int(x.split(" buckets")[0].rsplit(" ", 1)[1]) for x in lines if " buckets (--memory-budget" in x]
    assert -(-events * 2000 // (64 << 20)) < nb <= -(-events * 2000 // ((64 << 20) // bucketed.THREADS)), lines
    assert any(x.startswith("dataprep: bucket 1/") for x in lines)
    _assert_same(tmp_path / "s", tmp_path / "b")


def test_user_errors_same_as_in_memory(tmp_path):
    """What the in-memory build refuses, the bucketed one refuses with the same message."""
    bad = tmp_path / "bad.parquet"  # one row in ten has no item: over --max-reject-fraction
    items = pa.array(np.arange(1000), mask=np.arange(1000) % 10 == 3)
    pq.write_table(pa.table({"user_id": np.arange(1000) % 50, "item_id": items, "timestamp": np.arange(1000)}), bad)
    short = tmp_path / "short.parquet"  # every user has 2 events: none is long enough
    pq.write_table(
        pa.table({"user_id": np.arange(100) % 50, "item_id": np.arange(100), "timestamp": np.arange(100)}), short
    )
    for path, match in ((bad, "lines rejected"), (short, "leave-one-out needs")):
        msgs = []
        for kw in ({}, {"buckets": 3}):
            with pytest.raises(DataprepError, match=match) as e:
                build_shards(str(path), "events", str(tmp_path / "out"), world_size=2, batch_size=4, **kw)
            msgs.append(str(e.value))
        assert msgs[0] == msgs[1]
    assert not list(tmp_path.glob(".out.tmp-*"))  # the staging folder went with the error


def test_uri_input_through_pyarrow_fs(tmp_path, parquet_inputs, monkeypatch):
    """A `scheme://` Parquet input (here file://, read through pyarrow.fs like s3:// or gs://)
    gives the local input's set: same fingerprint, every data file byte for byte."""
    folder = tmp_path / "in"
    folder.mkdir()
    for p in parquet_inputs:
        (folder / Path(p).name).write_bytes(Path(p).read_bytes())
    kw = dict(world_size=2, batch_size=16)
    local = build_shards(str(folder), "events", str(tmp_path / "local"), **kw)
    monkeypatch.setattr(readers, "SPAN_ROWS", 25_000)  # a span across the folder's two files
    assert any(len(s["groups"]) == 2 for s in readers.spans([folder.as_uri()], "events"))
    for name, extra in (("uri", {}), ("uri_bucketed", {"buckets": 3})):
        m = build_shards(folder.as_uri(), "events", str(tmp_path / name), **kw, **extra)
        assert m["input"]["fingerprint"] == local["input"]["fingerprint"]
        assert m["input"]["paths"] == [folder.as_uri()]
        for f in local["files"]:
            if f == "rejects.parquet":  # names its source: the URI here
                a, b = (pq.read_table(tmp_path / x / f).drop_columns(["source"]) for x in ("local", name))
                assert a.equals(b) and a.num_rows > 100
            else:
                assert filecmp.cmp(tmp_path / "local" / f, tmp_path / name / f, shallow=False), f
    with pytest.raises(DataprepError, match="input not found"):
        build_shards((tmp_path / "nope.parquet").as_uri(), "events", str(tmp_path / "x"), **kw)
    with pytest.raises(DataprepError, match="only Parquet events are read from a URI"):
        build_shards(Path(parquet_inputs[0]).as_uri(), "sasrec", str(tmp_path / "y"), **kw)


def test_eval_and_maps_keep_write_tables_row_groups(tmp_path, monkeypatch):
    """Pieces of uneven sizes written in row groups of ROW_GROUP_ROWS give pq.write_table's bytes
    for the whole table (the shared data has fewer users than one row group of 1Mi)."""
    monkeypatch.setattr(assemble, "ROW_GROUP_ROWS", 1000)
    rng = np.random.default_rng(3)
    n = 3500
    lens = rng.integers(1, 30, n)
    offs = pa.array(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
    whole = pa.table(
        {
            "user_id": pa.array(np.arange(1, n + 1, dtype=np.int64)),
            "history": pa.ListArray.from_arrays(offs, pa.array(rng.integers(1, 99, lens.sum()).astype(np.int32))),
            "valid_target": pa.array(rng.integers(1, 99, n).astype(np.int32)),
            "test_target": pa.array(rng.integers(1, 99, n).astype(np.int32)),
            "history_timestamps": pa.ListArray.from_arrays(offs, pa.array(rng.integers(0, 10**9, lens.sum()))),
            "valid_timestamp": pa.array(rng.integers(0, 10**9, n)),
        },
        schema=schema.eval_schema(True),
    )
    pq.write_table(whole, tmp_path / "ref.parquet", row_group_size=1000, **schema.write_options(whole.schema))
    cuts = [0, 1, 999, 1000, 2600, n]
    pieces = []
    for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False)):
        pieces.append(tmp_path / f"p{i}.arrow")
        workdir.write_ipc(pieces[-1], whole.slice(a, b - a))
    assemble._write_eval(tmp_path / "eval.parquet", whole.schema, pieces, cuts)
    assert filecmp.cmp(tmp_path / "ref.parquet", tmp_path / "eval.parquet", shallow=False)
    assert pq.ParquetFile(tmp_path / "eval.parquet").num_row_groups == 4
    maps = pa.table({"id": np.arange(1, n + 1), "raw_id": [f"u{i}" for i in range(n)]}, schema=schema.MAP_SCHEMA)
    pq.write_table(maps, tmp_path / "mref.parquet", row_group_size=1000)
    w = assemble._RowGroups(tmp_path / "maps.parquet", schema.MAP_SCHEMA)
    for a, b in zip(cuts, cuts[1:], strict=False):
        w.add(maps.slice(a, b - a))
    w.close()
    assert filecmp.cmp(tmp_path / "mref.parquet", tmp_path / "maps.parquet", shallow=False)


def test_sparse_int_ids_same_bytes(tmp_path):
    """Ids spread far apart (looked up by binary search, not by a table indexed by id)."""
    rng = np.random.default_rng(11)
    c = _events(rng, 800, 20_000)
    t = pa.table({"user_id": c["user_id"] * 10**12 + 7, "item_id": c["item_id"] * 10**9, "timestamp": c["timestamp"]})
    pq.write_table(t, tmp_path / "sparse.parquet")
    _both(tmp_path, str(tmp_path / "sparse.parquet"), "events", world_size=2, batch_size=8)


def _csv_text(cols: dict, rng: np.random.Generator) -> list[str]:
    """CSV records of `cols`, with blank lines and lines of the wrong field count here and there."""
    rows = [f"{u},{i},{t}" for u, i, t in zip(cols["user_id"], cols["item_id"], cols["timestamp"], strict=True)]
    for k in sorted(rng.choice(len(rows), 40, replace=False), reverse=True):
        rows.insert(int(k), "" if k % 2 else "7,8")
    return ["user_id,item_id,timestamp", *rows]


@pytest.fixture(scope="module")
def csv_inputs(tmp_path_factory) -> dict[str, Path]:
    """CSV files read in parts: clean integers; late text ids, an ISO-time file with a bad time,
    bytes that are not UTF-8 late in a file (each read again whole-file alike, see Restart)."""
    d = tmp_path_factory.mktemp("csv")
    rng = np.random.default_rng(11)
    lines = _csv_text(_events(rng, 2000, 40_000), rng)
    (d / "clean.csv").write_text("\n".join(lines) + "\n")
    late = lines[:-3] + ["u-late,5,1600000000000", *lines[-3:]]  # a text user id in the last part only
    (d / "late_text.csv").write_text("\n".join(late) + "\n")
    c = _events(rng, 800, 12_000, first_user=5000)
    iso = [f"{u},{i},{np.datetime64(int(t), 'ms')}Z" for u, i, t in zip(*c.values(), strict=True)]
    iso[-20] = iso[-20].rsplit(",", 1)[0] + ",not a time"
    (d / "iso.csv").write_text("\n".join(["user_id,item_id,timestamp", *iso]) + "\n")
    (d / "latin1.csv").write_bytes("\n".join(lines[:-5]).encode() + "\n9,caf\xe9,1600000000001\n".encode("latin-1"))
    return {p.stem: p for p in d.iterdir()}


@pytest.mark.parametrize("files", [["clean"], ["late_text", "iso"], ["latin1"]])
def test_csv_read_in_parts_same_bytes(tmp_path, csv_inputs, monkeypatch, files):
    """CSV events stream through the bucketed build in parts of a few thousand rows and
    give the in-memory build's set: reader rejects with their lines, kinds chosen over the whole
    file (a late text id, ISO times), bytes that are not UTF-8 late in a file."""
    parts: list[int] = []
    iter_file = bucketed.readers.iter_file

    def counted(*a, **kw):
        for part in iter_file(*a, **kw):
            parts.append(len(part[0]["line"]))
            yield part

    monkeypatch.setattr(bucketed, "batch_rows", lambda budget: 1000)
    monkeypatch.setattr(bucketed.readers, "iter_file", counted)
    ref, _ = _both(tmp_path, [str(csv_inputs[f]) for f in files], "events", world_size=2, batch_size=16, max_len=20)
    # parts of 64 KB of text (the smallest block), never the whole file at once: two builds
    assert len(parts) > 2 * 3 * len(files) and max(parts) < 4000
    r = ref["rejects"]
    assert r.get("malformed_line", 0) > 10 or files == ["iso"]
    if "iso" in files:
        assert r["bad_timestamp"] == 1
    if "latin1" in files:
        assert r["not_utf8"] == 1


def test_scan_counts_dense_then_hashed_agree_with_value_counts():
    """scan's id counts: a count array while ids are dense (a later batch's ids below the first's
    too), hashed once they spread or are text."""
    rng = np.random.default_rng(3)
    parts = [rng.integers(0, 5000, 20_000), rng.integers(0, 9000, 20_000), rng.integers(0, 1 << 40, 3000)]
    lower = [rng.integers(3000, 5000, 20_000), rng.integers(10, 4000, 20_000), rng.integers(0, 20, 50)]
    for arrays, dense in ((parts[:2], True), (lower, True), (parts, False), ([np.array(["a", "b", "a"])], False)):
        c = counts.Counts()
        for a in arrays:
            c.add(pa.array(a))
        assert c.hashed is not dense
        want = pc.value_counts(pa.concat_arrays([pa.array(a) for a in arrays])).flatten()
        got = c.table()  # sorted by id
        assert got.column("u").to_pylist() == sorted(want[0].to_pylist())
        assert dict(zip(want[0].to_pylist(), want[1].to_pylist(), strict=True)) == dict(
            zip(got.column("u").to_pylist(), got.column("n").to_pylist(), strict=True)
        )


@pytest.mark.parametrize("kind", ["one sorted file", "dense ids", "sparse ids", "text ids", "an empty file"])
def test_files_id_counts_merge_as_a_group_by_sorted_by_id(kind):
    """ids(): every file's (id, events) -> one row an id with its events summed, sorted by id,
    as Arrow's group-by and sort made them (numpy paths for integer ids: a sorted single table
    passes as it is, dense ids through a count array, sparse ones through a sort)."""
    rng = np.random.default_rng(5)

    def part(u):
        return pa.table({"u": u, "n": rng.integers(1, 50, len(u))})

    ids = {
        "one sorted file": [np.arange(3, 9000, 2)],
        "dense ids": [rng.permutation(7000), rng.permutation(np.arange(2000, 12000)), np.arange(5, 50)],
        "sparse ids": [rng.choice(1 << 50, 4000, replace=False), rng.choice(1 << 50, 3000, replace=False)],
        "text ids": [np.array(["b", "a", "c"]), np.array(["c", "d"])],
        "an empty file": [np.zeros(0, np.int64), rng.permutation(100)],
    }[kind]
    parts = [part(u) for u in ids]
    if kind == "sparse ids":
        parts.append(part(ids[0][:500]))  # ids shared across files
    want = pa.concat_tables(parts).group_by("u").aggregate([("n", "sum")]).sort_by("u")
    got = counts.sum_counts(parts)
    assert got.column("u").equals(want.column("u")) and got.column("n").equals(want.column("n_sum"))
    assert got.schema.field("n").type == pa.int64()


def test_heap_kept_for_a_build_then_released():
    """dataprep.heap: glibc keeps freed memory while a build runs (where the C library is
    glibc) and takes its default thresholds back after; elsewhere it does nothing."""
    import platform

    from dataprep import heap

    try:
        assert heap.keep() == (platform.libc_ver()[0] == "glibc")
        a = np.ones(4 << 20)  # 32 MB: from the heap, not a fresh mapping, while kept
        del a
    finally:
        heap.release()
    heap.release()  # twice is harmless


def test_writing_a_rank_file_raises_the_open_files_limit_or_says_what_to_change():
    """write(r) holds one file per bucket: a low soft limit is raised toward the hard one; a
    hard limit too low for the buckets is a DataprepError naming ulimit -n and --memory-budget."""
    import subprocess
    import sys

    code = (
        "import resource\n"
        "from dataprep import workdir\n"
        "from dataprep.errors import DataprepError\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (300, {hard}))\n"
        "try:\n"
        "    workdir.open_files(1000)\n"
        "    print('soft', resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
        "except DataprepError as e:\n"
        "    print('error', e)\n"
    )
    root = Path(__file__).resolve().parent.parent

    def run(hard: int) -> str:
        p = subprocess.run([sys.executable, "-c", code.format(hard=hard)], cwd=root, capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        return p.stdout.strip()

    assert run(5000) == "soft 2256"
    out = run(400)
    assert out.startswith("error") and "ulimit -n" in out and "--memory-budget" in out and "2256" in out, out
