"""Bad input: each case is a clear error (file, line/column, what to do) or a counted rejection."""

import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dataprep import readers, schema
from dataprep.build import build_shards
from dataprep.errors import DataprepError
from dataprep.verify import verify_shards

ROOT = Path(__file__).resolve().parent.parent


def _good_lines(users=20, per=6):
    return "".join(f"{u} {100 + (u * 7 + k) % 40}\n" for u in range(1, users + 1) for k in range(per))


def _build(p, fmt="sasrec", **kw):
    kw.setdefault("world_size", 2)
    kw.setdefault("batch_size", 2)
    return build_shards(str(p), fmt, str(p.parent / "out"), **kw)


def _rejects(p):
    return pq.read_table(p.parent / "out" / schema.REJECTS_FILE).to_pylist()


@pytest.mark.parametrize(
    "bad,reason",
    [
        ("5 7 9\n", "malformed_line"),
        ("5\n", "malformed_line"),
        ("5 abc\n", "non_integer_id"),
        ("5 1.5\n", "non_integer_id"),
        ("5 99999999999999999999999\n", "id_out_of_range"),
        ("-5 7\n", "negative_id"),
    ],
)
def test_bad_line_is_a_counted_rejection_with_its_line(tmp_path, bad, reason):
    p = tmp_path / "in.txt"
    good = _good_lines()
    cut = good.index("\n", 50) + 1
    p.write_text(good[:cut] + bad + good[cut:] + bad)
    m = _build(p, max_reject_fraction=0.1)
    verify_shards(str(p.parent / "out"))
    line = good[:cut].count("\n") + 1
    rej = [r for r in _rejects(p) if r["reason"] == reason]
    assert [r["line"] for r in rej] == [line, good.count("\n") + 2]
    assert rej[0]["source"] == str(p) and bad.strip()[:10] in rej[0]["detail"]
    assert m["rejects"][reason] == 2 and m["counts"]["rows_rejected"] == 2
    assert m["counts"]["events_read"] == good.count("\n")


def test_too_many_bad_lines_is_an_error_naming_first_line(tmp_path):
    p = tmp_path / "in.txt"
    p.write_text(_good_lines(5) + "x y\n" * 10)
    with pytest.raises(DataprepError, match=r"in\.txt: 10 of 40 lines rejected \(first: line 31, non_integer_id"):
        _build(p)
    assert not (tmp_path / "out").exists()


def test_wrong_format_is_an_error(tmp_path):
    p = tmp_path / "in.txt"
    p.write_text("".join(f"{u} 1 2 3 4 5\n" for u in range(1, 30)))
    with pytest.raises(DataprepError, match="is --format right"):
        _build(p, "sasrec")


def test_empty_and_blank_files(tmp_path):
    p = tmp_path / "in.txt"
    p.write_text("")
    with pytest.raises(DataprepError, match=r"in\.txt: empty file"):
        _build(p)
    p.write_text("\n\n  \n")
    with pytest.raises(DataprepError, match=r"in\.txt: empty file"):
        _build(p, "iclrec")


def test_blank_lines_are_skipped_and_counted(tmp_path):
    p = tmp_path / "in.txt"
    p.write_text("\n" + _good_lines() + "\n\n")
    m = _build(p)
    assert m["counts"]["blank_lines"] == 3 and m["rejects"] == {}


def test_missing_input(tmp_path):
    with pytest.raises(DataprepError, match="input not found"):
        _build(tmp_path / "nope.txt")


def test_events_missing_column_names_it(tmp_path):
    p = tmp_path / "ev.parquet"
    pq.write_table(pa.table({"user_id": [1, 2], "item": [3, 4], "when": [5, 6]}), p)
    with pytest.raises(DataprepError, match=r"ev\.parquet: no column 'timestamp' among its 3 columns; set --time-col"):
        _build(p, "events")
    with pytest.raises(DataprepError, match="no column 'it'.*--item-col"):
        _build(p, "events", item_col="it", time_col="when")


def test_events_nulls_negative_and_duplicates(tmp_path):
    rows = [(u, 10 + (u + k) % 7, 1000 + k) for u in range(1, 21) for k in range(6)]
    users = [r[0] for r in rows] + [None, 3, -4, 2]
    items = [r[1] for r in rows] + [5, None, 6, rows[6][1]]
    ts = [r[2] for r in rows] + [1, 2, 3, rows[6][2]]  # the last row repeats row 6 exactly
    p = tmp_path / "ev.parquet"
    pq.write_table(
        pa.table({"user_id": pa.array(users, pa.int64()), "item_id": pa.array(items, pa.int64()), "timestamp": ts}), p
    )
    m = _build(p, "events", max_reject_fraction=0.1)
    assert m["rejects"] == {"duplicate_event": 1, "missing_value": 2, "negative_id": 1}
    dup = [r for r in _rejects(p) if r["reason"] == "duplicate_event"][0]
    assert dup["line"] == len(rows) + 4 and dup["user"] == "2"


def _csv_rows(users=20, per=6):
    return [(u, 100 + (u * 7 + k) % 40, 1000 + k) for u in range(1, users + 1) for k in range(per)]


@pytest.mark.parametrize(
    "fmt,name,header",
    [
        ("events", "ev.csv", b"user_id,item_id,timestamp"),
        ("movielens", "ratings.csv", b"userId,movieId,rating,timestamp"),
    ],
)
def test_csv_bad_rows_are_counted_rejections_with_their_lines(tmp_path, fmt, name, header):
    mk = (lambda u, i, t: f"{u},{i},{t}".encode()) if fmt == "events" else (lambda u, i, t: f"{u},{i},4.0,{t}".encode())
    good = [mk(*r) for r in _csv_rows()]
    bad = [
        (mk(3, 7, "abc"), "bad_timestamp"),
        (mk(3, 8, ""), "missing_value"),
        (mk(3, 9, "1,2") + b",2", "malformed_line"),
        (b"3,10", "malformed_line"),
        (mk(3, 11, 5).replace(b"11", b"\xff1"), "not_utf8"),
        (b"", None),
    ]
    lines = good[:30] + [b for b, _ in bad] + good[30:]
    p = tmp_path / name
    p.write_bytes(header + b"\n" + b"\n".join(lines) + b"\n")
    m = _build(p, fmt, max_reject_fraction=0.1)
    got = sorted((r["line"], r["reason"]) for r in _rejects(p) if r["line"] is not None)
    assert got == [(32 + k, reason) for k, (_, reason) in enumerate(bad) if reason]  # header = line 1
    assert m["counts"]["events_read"] == len(good) and m["counts"]["blank_lines"] == 1
    assert "'abc'" in [r for r in _rejects(p) if r["reason"] == "bad_timestamp"][0]["detail"]


def test_csv_all_times_bad_is_an_error_naming_the_first(tmp_path):
    p = tmp_path / "ev.csv"
    p.write_text("user_id,item_id,timestamp\n1,2,yesterday\n1,3,today\n")
    with pytest.raises(
        DataprepError,
        match=r"ev\.csv: 2 of 2 lines rejected \(first: line 2, bad_timestamp, "
        r"column 'timestamp': \(value not shown\)",
    ):
        _build(p, "events")


def test_csv_iso_times_with_a_bad_one(tmp_path):
    p = tmp_path / "ev.csv"
    rows = [(u, i, f"2024-01-{1 + t % 28:02d}T10:00:{t % 60:02d}") for u, i, t in _csv_rows()]
    rows[5] = (1, 5, "2024-02-30T10:00:00")  # right shape, no such day
    rows[9] = (2, 5, "1700000000")  # epoch in an ISO column
    p.write_text("user_id,item_id,timestamp\n" + "".join(f"{u},{i},{t}\n" for u, i, t in rows))
    m = _build(p, "events", max_reject_fraction=0.1)
    assert sorted((r["line"], r["reason"]) for r in _rejects(p)) == [(7, "bad_timestamp"), (11, "bad_timestamp")]
    assert m["counts"]["events_read"] == len(rows) - 2


def test_movielens_dat_bad_timestamp_is_its_own_reason(tmp_path):
    p = tmp_path / "ratings.dat"
    rows = [f"{u}::{i}::4::{t}" for u, i, t in _csv_rows()]
    rows[3], rows[4] = "1::5::4::abc", "1::6::4::12.5"
    p.write_text("\n".join(rows) + "\n")
    m = _build(p, "movielens", max_reject_fraction=0.1)
    assert [(r["line"], r["reason"]) for r in _rejects(p)] == [(4, "bad_timestamp"), (5, "bad_timestamp")]
    assert m["rejects"] == {"bad_timestamp": 2}


def test_ids_above_int64_are_kept_as_text_in_csv_and_parquet(tmp_path):
    big = 99999999999999999999
    rows = _csv_rows()
    p = tmp_path / "ev.csv"
    p.write_text("user_id,item_id,timestamp\n" + "".join(f"{u},{i},{t}\n" for u, i, t in rows) + f"1,{big},5000\n")
    _build(p, "events")
    items = pq.read_table(tmp_path / "out" / schema.ITEM_MAP).column("raw_id").to_pylist()
    assert str(big) in items and "100" in items
    q = tmp_path / "q" / "ev.parquet"
    q.parent.mkdir()
    pq.write_table(
        pa.table(
            {
                "user_id": pa.array([u for u, _, _ in rows] + [1], pa.uint64()),
                "item_id": pa.array([i for _, i, _ in rows] + [2**64 - 1], pa.uint64()),
                "timestamp": [t for _, _, t in rows] + [5000],
            }
        ),
        q,
    )
    _build(q, "events")
    assert str(2**64 - 1) in pq.read_table(q.parent / "out" / schema.ITEM_MAP).column("raw_id").to_pylist()


def _parquet_bytes(tmp_path):
    rows = _csv_rows()
    f = tmp_path / "good.parquet"
    pq.write_table(
        pa.table(
            {
                "user_id": [u for u, _, _ in rows],
                "item_id": [i for _, i, _ in rows],
                "timestamp": [t for _, _, t in rows],
            }
        ),
        f,
    )
    return f.read_bytes()


@pytest.mark.parametrize("damage", ["random", "truncated", "pages"])
def test_corrupt_parquet_is_an_error_naming_the_file(tmp_path, damage):
    good = _parquet_bytes(tmp_path)
    data = {
        "random": bytes(range(100)),
        "truncated": good[: len(good) // 2],
        "pages": good[:4] + bytes(len(good) // 2 - 4) + good[len(good) // 2 :],
    }[damage]  # footer intact
    p = tmp_path / "x.parquet"
    p.write_bytes(data)
    with pytest.raises(DataprepError, match=rf"^{p}: not a readable Parquet file") as e:
        _build(p, "events")
    assert "free space" not in str(e.value)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dataprep",
            "shards",
            "--input",
            str(p),
            "--format",
            "events",
            "--out",
            str(tmp_path / "o"),
            "--world-size",
            "1",
            "--batch-size",
            "2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: {p}: not a readable Parquet file")
    assert "free space" not in r.stderr and "Traceback" not in r.stderr


def test_corrupt_parquet_in_a_folder_names_that_file(tmp_path):
    good = _parquet_bytes(tmp_path)
    d = tmp_path / "events"
    d.mkdir()
    (d / "part-0.parquet").write_bytes(good)
    (d / "part-1.parquet").write_bytes(good[:4] + bytes(len(good) // 2 - 4) + good[len(good) // 2 :])
    with pytest.raises(DataprepError, match=rf"^{d / 'part-1.parquet'}: not a readable Parquet file"):
        readers.read(str(d), "events")


def test_parquet_time_column_of_the_wrong_type(tmp_path):
    rows = _csv_rows()
    p = tmp_path / "ev.parquet"
    u, i = [r[0] for r in rows], [r[1] for r in rows]
    ts = [str(r[2]) for r in rows]
    ts[7] = "soon"
    pq.write_table(pa.table({"user_id": u, "item_id": i, "timestamp": ts}), p)  # strings: parsed row by row
    m = _build(p, "events", max_reject_fraction=0.1)
    assert [(r["line"], r["reason"]) for r in _rejects(p)] == [(8, "bad_timestamp")]
    assert m["rejects"] == {"bad_timestamp": 1}
    pq.write_table(pa.table({"user_id": u, "item_id": i, "timestamp": [True] * len(u)}), p)
    with pytest.raises(DataprepError, match=rf"{p}: column 'timestamp' has type bool; timestamps must be"):
        readers.read(str(p), "events")


def test_short_users_are_counted_rejections(tmp_path):
    p = tmp_path / "in.txt"
    p.write_text(_good_lines() + "900 1\n900 2\n")
    m = _build(p)
    assert m["rejects"] == {"too_short": 1}
    r = _rejects(p)[0]
    assert r["user"] == "900" and "2 events" in r["detail"]


def test_histories_far_over_max_len_are_truncated_and_counted_or_rejected(tmp_path):
    p = tmp_path / "in.txt"
    p.write_text(_good_lines() + "".join(f"777 {i}\n" for i in range(1, 5001)))
    m = _build(p, max_len=10)
    assert m["counts"]["samples_truncated"] == 1 and m["counts"]["items_truncated"] == 5000 - 3 - 10
    m = build_shards(str(p), "sasrec", str(tmp_path / "out2"), world_size=2, batch_size=2, max_events=1000)
    assert m["rejects"] == {"history_too_long": 1} and m["num_users"] == 20


def test_world_size_larger_than_data_allows(tmp_path):
    p = tmp_path / "in.txt"
    p.write_text(_good_lines(users=5))
    with pytest.raises(DataprepError, match="--world-size 8 is larger than the data allows: only 5 training samples"):
        _build(p, world_size=8)
    with pytest.raises(DataprepError, match="fewer than one global batch"):
        _build(p, world_size=2, batch_size=4, tail="drop")
    assert not (tmp_path / "out").exists()


def test_bad_settings_and_cost_model(tmp_path):
    p = tmp_path / "in.txt"
    p.write_text(_good_lines())
    with pytest.raises(DataprepError, match="--batch-size must be >= 1"):
        _build(p, batch_size=0)
    with pytest.raises(DataprepError, match="--format 'csv': unknown"):
        _build(p, "csv")
    (tmp_path / "cm.json").write_text('{"a": -1, "b": 0, "c0": 1}')
    with pytest.raises(DataprepError, match="cm.json: cost model coefficient a=-1"):
        _build(p, cost_model=str(tmp_path / "cm.json"))
    with pytest.raises(DataprepError, match="cost model file not found"):
        _build(p, cost_model=str(tmp_path / "none.json"))


def test_out_is_a_non_empty_foreign_folder(tmp_path):
    p = tmp_path / "in.txt"
    p.write_text(_good_lines())
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(DataprepError, match="not empty and holds no shard set"):
        _build(p)
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


def test_cli_bad_input_prints_one_line_without_traceback(tmp_path):
    p = tmp_path / "in.txt"
    p.write_text("1 2 3\n" * 10)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "dataprep",
            "shards",
            "--input",
            str(p),
            "--format",
            "sasrec",
            "--out",
            str(tmp_path / "o"),
            "--world-size",
            "2",
            "--batch-size",
            "2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {p}: 10 of 10 lines rejected (first: line 1, malformed_line")
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("fmt", ["sasrec", "iclrec"])
def test_a_line_that_is_not_utf8_is_a_counted_rejection_not_the_whole_file(tmp_path, fmt):
    p = tmp_path / "in.txt"
    good = (
        _good_lines().encode()
        if fmt == "sasrec"
        else "".join(
            f"{u} " + " ".join(str(100 + (u * 7 + k) % 40) for k in range(6)) + "\n" for u in range(1, 21)
        ).encode()
    )
    cut = good.index(b"\n", 50) + 1
    p.write_bytes(good[:cut] + b"5 \xff\xfe 7\n" + good[cut:])
    m = _build(p, fmt=fmt, max_reject_fraction=0.1)
    rej = [r for r in _rejects(p) if r["reason"] == "not_utf8"]
    assert [r["line"] for r in rej] == [good[:cut].count(b"\n") + 1] and rej[0]["source"] == str(p)
    assert m["rejects"]["not_utf8"] == 1


def test_a_device_is_refused_at_once_not_read_until_killed(tmp_path):
    with pytest.raises(DataprepError, match="not a regular file"):
        build_shards("/dev/zero", "sasrec", str(tmp_path / "out"), world_size=1, batch_size=2)


def test_a_parquet_folder_builds_and_its_fingerprint_follows_its_content(tmp_path):
    """A folder of Parquet parts is one input: it builds (its fingerprint hashes its data files,
    not the folder), and changing one part changes the fingerprint."""
    rows = _csv_rows()
    d = tmp_path / "events"
    d.mkdir()
    for k, part in enumerate((rows[:60], rows[60:])):
        pq.write_table(
            pa.table(
                {
                    "user_id": [u for u, _, _ in part],
                    "item_id": [i for _, i, _ in part],
                    "timestamp": [t for _, _, t in part],
                }
            ),
            d / f"part-{k}.parquet",
        )
    (d / "_SUCCESS").write_text("")  # a marker pyarrow skips: not data
    m = build_shards(str(d), "events", str(tmp_path / "out"), world_size=2, batch_size=2)
    assert m["num_users"] == 20
    from dataprep.fingerprint import fingerprint

    before = fingerprint([str(d)])
    (d / "_SUCCESS").write_text("changed")
    assert fingerprint([str(d)]) == before
    pq.write_table(pa.table({"user_id": [1], "item_id": [101], "timestamp": [5]}), d / "part-1.parquet")
    assert fingerprint([str(d)]) != before
