"""Readers: each format's parsing details (ids, order, headers, folders, several files)."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dataprep import readers, sequences
from dataprep.errors import DataprepError


def _seqs(ev):
    seq = sequences.build_sequences(ev)
    raw_u, raw_i = seq.user_raw.to_pylist(), seq.item_raw.to_pylist()
    return {
        raw_u[u]: [raw_i[i - 1] for i in seq.values[seq.offsets[u] : seq.offsets[u + 1]]] for u in range(seq.num_users)
    }


def test_sasrec_fast_path_and_tokenizer_agree(tmp_path):
    lines = [f"{u} {i}" for u in (3, 1, 2) for i in (9, 8, 7, 6)]
    clean, messy = tmp_path / "clean.txt", tmp_path / "messy.txt"
    clean.write_text("\n".join(lines) + "\n")
    messy.write_text("\n".join(line.replace(" ", "\t  ") for line in lines) + "\n\n")  # tabs, runs of blanks
    a, b = readers.read(str(clean), "sasrec"), readers.read(str(messy), "sasrec")
    assert _seqs(a) == _seqs(b) == {1: [9, 8, 7, 6], 2: [9, 8, 7, 6], 3: [9, 8, 7, 6]}
    assert a.line.tolist() == b.line.tolist() == list(range(1, 13))


def test_iclrec_user_on_several_lines_keeps_line_order(tmp_path):
    p = tmp_path / "i.txt"
    p.write_text("5 1 2\n6 3 4 5\n5 3\n")
    assert _seqs(readers.read(str(p), "iclrec")) == {5: [1, 2, 3], 6: [3, 4, 5]}


def test_several_files_are_read_in_order(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("1 10\n1 11\n")
    b.write_text("1 12\n2 10\n2 11\n2 12\n")
    ev = readers.read([str(a), str(b)], "sasrec")
    assert _seqs(ev) == {1: [10, 11, 12], 2: [10, 11, 12]}
    assert ev.source.tolist() == [0, 0, 1, 1, 1, 1] and ev.line.tolist() == [1, 2, 1, 2, 3, 4]


def test_movielens_dat_and_csv_sort_by_time(tmp_path):
    rows = [(1, 31, 5, 300), (1, 29, 3, 100), (1, 30, 4, 200), (2, 10, 1, 5), (2, 11, 1, 5), (2, 12, 1, 4)]
    dat, csv = tmp_path / "ratings.dat", tmp_path / "ratings.csv"
    dat.write_text("".join(f"{u}::{i}::{r}::{t}\n" for u, i, r, t in rows))
    csv.write_text("userId,movieId,rating,timestamp\n" + "".join(f"{u},{i},{r}.0,{t}\n" for u, i, r, t in rows))
    want = {1: [29, 30, 31], 2: [12, 10, 11]}  # same-second ratings keep file order
    dat.write_text("".join(f"{u}::{i}::{r}.5::{t}\n" for u, i, r, t in rows))  # MovieLens-10M half stars
    assert _seqs(readers.read(str(dat), "movielens")) == want
    assert _seqs(readers.read(str(csv), "movielens")) == want


def test_events_parquet_folder_string_ids_and_times(tmp_path):
    d = tmp_path / "events"
    d.mkdir()
    t = pa.array(["2024-01-01T00:00:03", "2024-01-01T00:00:01", "2024-01-01T00:00:02"]).cast(pa.timestamp("s"))
    pq.write_table(pa.table({"who": ["ann", "ann", "ann"], "what": ["x", "y", "z"], "when": t}), d / "part-0.parquet")
    pq.write_table(pa.table({"who": ["bob"] * 3, "what": ["z", "y", "x"], "when": t}), d / "part-1.parquet")
    ev = readers.read(str(d), "events", user_col="who", item_col="what", time_col="when")
    assert _seqs(ev) == {"ann": ["y", "z", "x"], "bob": ["y", "x", "z"]}


def test_events_float_ids_must_be_whole(tmp_path):
    p = tmp_path / "e.parquet"
    pq.write_table(pa.table({"user_id": [1.0, 1.0, 1.0], "item_id": [2.0, 3.0, 4.0], "timestamp": [1, 2, 3]}), p)
    assert _seqs(readers.read(str(p), "events")) == {1: [2, 3, 4]}
    pq.write_table(pa.table({"user_id": [1.0, 1.5, 1.0], "item_id": [2.0, 3.0, 4.0], "timestamp": [1, 2, 3]}), p)
    with pytest.raises(DataprepError, match="column 'user_id' holds non-integer numbers"):
        readers.read(str(p), "events")


def test_events_aliases_when_names_are_default(tmp_path):
    p = tmp_path / "e.csv"
    p.write_text("userId,movieId,ts\n1,5,3\n1,6,1\n1,7,2\n")
    assert _seqs(readers.read(str(p), "events")) == {1: [6, 7, 5]}


def test_unknown_reader_option():
    with pytest.raises(DataprepError, match="unknown reader option"):
        readers.read("x", "sasrec", sep=";")


def test_dense_ids_are_sorted_raw_ids_and_zero_is_padding(tmp_path):
    p = tmp_path / "s.txt"
    p.write_text("".join(f"7 {i}\n" for i in (500, 20, 3000)) + "".join(f"2 {i}\n" for i in (20, 500, 41)))
    seq = sequences.build_sequences(readers.read(str(p), "sasrec"))
    assert seq.item_map().to_pydict() == {"id": [1, 2, 3, 4], "raw_id": ["20", "41", "500", "3000"]}
    assert seq.user_map().to_pydict() == {"id": [1, 2], "raw_id": ["2", "7"]}
    assert np.diff(seq.offsets).tolist() == [3, 3] and seq.values.tolist() == [1, 3, 2, 3, 1, 4]


def test_csv_times_of_each_kind_and_lines_kept_across_blank_lines(tmp_path):
    p = tmp_path / "e.csv"
    p.write_text(
        "user_id,item_id,timestamp\n\n1,5,2024-01-01T00:00:02+01:00\n1,6,2024-01-01 00:00:01\n"
        "\n1,7,2023-12-31T23:00:01.5Z\n"
    )  # zone, naive (read as UTC), fraction
    ev = readers.read(str(p), "events")  # in UTC: 5 at 23:00:02, 6 at 00:00:01 next day, 7 at 23:00:01.5
    assert _seqs(ev) == {1: [7, 5, 6]} and ev.line.tolist() == [3, 4, 6] and ev.rejects == []
    assert ev.counts == {"lines": 5, "blank_lines": 2}
    p.write_text("user_id,item_id,timestamp\n1,5,3\n1,6,1.25\n1,7,2\n")  # one fraction: all are seconds
    assert _seqs(readers.read(str(p), "events")) == {1: [6, 7, 5]}


def test_ids_up_to_int64_max_read_the_same_on_both_text_paths(tmp_path):
    top = 2**63 - 1
    p = tmp_path / "s.txt"
    p.write_text(f"{top} 1\n{top} 2\n{top} 3\n")
    assert _seqs(readers.read(str(p), "sasrec")) == {top: [1, 2, 3]}
    p.write_text(f"{top} 1\n{top} 2\n{top} 3\nx y\n{top + 1} 3\n")  # a bad line: the tokenizer path
    ev = readers.read(str(p), "sasrec")
    assert _seqs(ev) == {top: [1, 2, 3]}
    assert [(r["line"], r["reason"]) for t in ev.rejects for r in t.to_pylist()] == [
        (5, "id_out_of_range"),
        (4, "non_integer_id"),
    ]


def test_csv_ids_above_int64_are_opaque_strings(tmp_path):
    p = tmp_path / "e.csv"
    p.write_text("user_id,item_id,timestamp\n" + "".join(f"99999999999999999999,{i},{i}\n" for i in (5, 6, 7)))
    ev = readers.read(str(p), "events")
    assert ev.user.type == pa.string() and _seqs(ev) == {"99999999999999999999": [5, 6, 7]}


def test_csv_row_not_utf8_costs_that_row_not_the_id_type(tmp_path):
    p = tmp_path / "e.csv"
    p.write_bytes(b"user_id,item_id,timestamp\n" + b"".join(b"7,%d,%d\n" % (i, i) for i in (5, 6, 7)) + b"\xff7,8,9\n")
    ev = readers.read(str(p), "events")
    assert ev.user.type == pa.int64() and _seqs(ev) == {7: [5, 6, 7]}
    assert [(r["line"], r["reason"]) for t in ev.rejects for r in t.to_pylist()] == [(5, "not_utf8")]


def test_csv_events_stream_in_parts_and_restart_when_a_late_part_changes_a_kind(tmp_path):
    """iter_file reads a CSV in parts (pyarrow's streaming reader) that concatenate to the whole
    read; a text id in the last part only makes it ask for a second read with the whole file's
    kinds (events.Restart), and that read types every part as the whole read does."""
    from dataprep.readers.events import Restart

    rows = [f"{u % 97},{u % 31},{1_600_000_000 + u}" for u in range(30_000)]
    p = tmp_path / "ev.csv"
    p.write_text("\n".join(["user_id,item_id,timestamp", *rows, "x7,3,1600000000"]) + "\n")
    whole = readers.read(str(p), "events")
    parts = []
    with pytest.raises(Restart) as e:
        for part in readers.iter_file(str(p), "events", 1000):
            parts.append(part)
    assert len(parts) > 5 and e.value.kinds == ("text", "int", "int64") and not e.value.replace
    parts = list(readers.iter_file(str(p), "events", 1000, kinds=e.value.kinds))
    assert len(parts) > 5
    user = pa.concat_arrays([c["user"] for c, _, _ in parts])
    assert user.type == pa.string() and user.equals(whole.user)
    assert np.array_equal(np.concatenate([c["line"] for c, _, _ in parts]), whole.line)
    assert np.array_equal(np.concatenate([c["ts"] for c, _, _ in parts]), whole.ts)
