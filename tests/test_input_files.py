"""Property tests of read_items (issue 30): random CSV, TSV, JSON, JSON Lines and Parquet files with
quoting, commas, tabs, line breaks, unicode, missing and extra fields, empty cells and repeated ids.
Each file either reads back exactly what was written (prompt, answer, id, foil) or raises the one
ValueError that the file calls for, naming the file and the line (record, row) where it applies.

derandomize=True: the same examples on every machine, so CI is reproducible."""
import csv
import io
import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import iglens_tables as igt

SETTINGS = settings(max_examples=50, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# text with what breaks naive readers: the delimiters, quotes, line breaks (also U+2028, a lone \r),
# leading spaces, non-ASCII; no NUL (no text format holds it) and no lone surrogates (not UTF-8)
TEXT = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12),
    st.sampled_from(["Capital, France?", '"quoted"', 'say "hi", then', "tab\there", "two\nlines", "cr\rhere",
                     "crlf\r\nhere", " Paris", "Côte d’Ivoire", "東京", "a\u2028b", "", " ", "1.0", "nan", "None"]))
ID = st.one_of(st.integers(0, 5), st.sampled_from(["a", "b", "a b", " a", "1", "x,y", 'q"', "", " ", "é"]))
COLUMNS = ("id", "prompt", "answer", "foil")


@st.composite
def items(draw, ints_only_or_text=False):
    """1-5 rows of {column: value}; a column's value may be None (an empty cell or a missing key)."""
    n = draw(st.integers(1, 5))
    rows = []
    for _ in range(n):
        rows.append(dict(id=draw(st.none() | ID) if draw(st.booleans()) else draw(ID), prompt=draw(TEXT),
                         answer=draw(st.none() | TEXT), foil=draw(st.none() | TEXT)))
    return rows


def _expected_error(path, rows, where, has_id=True):
    """The error the file calls for once it parses (no rows aside), as a regex-free substring list, or None."""
    if has_id:
        ids = [None if row["id"] is None else str(row["id"]) for row in rows]
        missing = [at for i, at in zip(ids, where) if i is None or not i.strip()]
        if missing:
            return [repr(str(path)), f"have no id in column 'id' (the first at {missing[0]})"]
    else:
        ids = [str(i) for i in range(len(rows))]
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        return [repr(str(path)), f"ids must be unique, these repeat: {repeated[:5]}",
                f"{repeated[0]!r} at {where[ids.index(repeated[0])]}"]
    return None


def _check(path, rows, where, has_id=True, error=None):
    """read_items(path): the rows as written, or the ValueError that ``error`` (or the rows) call for."""
    error = error or _expected_error(path, rows, where, has_id)
    if error is not None:
        with pytest.raises(ValueError) as raised:
            igt.read_items(path)
        for part in error:
            assert part in str(raised.value), (part, str(raised.value))
        return
    table = igt.read_items(path)
    want = [dict(row=k, id=str(row["id"]) if has_id else str(k), prompt=row["prompt"] or "",
                 answer=row["answer"] or None, foil=row["foil"] or None) for k, row in enumerate(rows)]
    assert table.to_dict("records") == want


def _lines_before(text: str) -> int:
    """Lines in ``text`` as the CSV reader counts them (\\n, \\r and \\r\\n end a line)."""
    return len(io.StringIO(text, newline="").readlines())


@pytest.mark.parametrize("suffix", [".csv", ".tsv"])
@SETTINGS
@given(rows=items(), has_id=st.booleans(), blank_lines=st.booleans(),
       shape=st.lists(st.sampled_from([0, 0, 0, 1, -1]), min_size=5, max_size=5))
def test_delimited_files(suffix, rows, has_id, blank_lines, shape):
    """CSV/TSV written with proper quoting, a row given an extra field (an unquoted comma) or one
    too few where ``shape`` says: as written, or the first bad row's line named."""
    columns = COLUMNS if has_id else COLUMNS[1:]
    out = io.StringIO()
    # "\r\n" ends a row (the csv module's default): with "\n" it leaves a lone "\r" in a cell unquoted
    writer = csv.writer(out, delimiter="," if suffix == ".csv" else "\t")
    writer.writerow(columns)
    where, bad = [], None
    for row, change in zip(rows, shape):
        if blank_lines:
            out.write("\n")
        where.append(f"line {_lines_before(out.getvalue()) + 1}")
        cells = ["" if row[c] is None else str(row[c]) for c in columns]
        cells = cells + ["extra"] if change == 1 else cells[:-1] if change == -1 else cells
        if change and bad is None:
            bad = [f"{where[-1]} has {len(cells)} fields, the header has {len(columns)}", "double quotes"]
        writer.writerow(cells)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"items{suffix}"
        path.write_text(out.getvalue(), encoding="utf-8")
        # an empty cell is None, as read back; ints are written as text
        read = [{c: (None if row[c] is None or (c != "id" and row[c] == "") else row[c]) for c in COLUMNS}
                for row in rows]
        _check(path, read, where, has_id, error=[repr(str(path))] + bad if bad else None)


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
@SETTINGS
@given(rows=items(), keep=st.lists(st.sets(st.sampled_from(COLUMNS)), min_size=5, max_size=5),
       blank_lines=st.booleans(), extra=st.booleans())
def test_json_files(suffix, rows, keep, blank_lines, extra):
    """JSON / JSON Lines records, each holding some of the keys (``keep``), ints written as ints, an
    ignored extra key: as written (a missing key: an empty cell), or the error named at its line."""
    records = []
    for row, keys in zip(rows, keep):
        record = {c: row[c] for c in COLUMNS if c in keys | {"prompt"}}
        records.append({**record, "note": [1, 2]} if extra else record)
    has_id = any("id" in r for r in records)
    read = [{c: record.get(c) for c in COLUMNS} for record in records]
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"items{suffix}"
        if suffix == ".json":
            text, where = json.dumps(records, ensure_ascii=False, indent=1), [f"record {k + 1}" for k in range(len(rows))]
        else:
            lines, where = [], []
            for record in records:
                lines += [""] if blank_lines else []
                lines.append(json.dumps(record, ensure_ascii=False))
                where.append(f"line {len(lines)}")
            text = "\n".join(lines) + "\n"
        path.write_text(text, encoding="utf-8")
        _check(path, read, where, has_id)


@SETTINGS
@given(rows=items(), as_bytes=st.sets(st.sampled_from(COLUMNS[1:])), int_ids=st.booleans(),
       broken=st.none() | st.integers(0, 4))
def test_parquet_files(rows, as_bytes, int_ids, broken):
    """Parquet with text or bytes columns (UTF-8, decoded; one cell not UTF-8 where ``broken`` says:
    refused, naming its row and column) and ids of ints or text."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    if int_ids:
        rows = [{**row, "id": None if row["id"] is None else hash(str(row["id"])) % 7} for row in rows]
    else:
        rows = [{**row, "id": None if row["id"] is None else str(row["id"])} for row in rows]
    columns = {"id": pa.array([row["id"] for row in rows], pa.int64() if int_ids else pa.string())}
    error = None
    for c in COLUMNS[1:]:
        values = [row[c] for row in rows]
        if c in as_bytes:
            values = [None if v is None else v.encode() for v in values]
            if c == "prompt" and broken is not None and broken < len(rows):
                values[broken] = b"\xff" + (values[broken] or b"")
                error = [f"row {broken}, column 'prompt': bytes that are not UTF-8"]
        columns[c] = pa.array(values, pa.binary() if c in as_bytes else pa.string())
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "items.parquet"
        pq.write_table(pa.table(columns), path)
        where = [f"row {k}" for k in range(len(rows))]
        first = _expected_error(path, rows, where)  # the ids are read before the prompts
        _check(path, rows, where, error=first or (error and [repr(str(path))] + error))


def test_the_oracle_sees_a_shifted_column(tmp_path):
    """The property holds for a reason: the file that pandas used to misread is refused here."""
    path = tmp_path / "items.csv"
    path.write_text("id,prompt,answer\n1,Capital of France, the country?,Paris\n")
    with pytest.raises(ValueError, match=r"line 2 has 4 fields, the header has 3"):
        igt.read_items(path)
