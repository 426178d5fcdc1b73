"""The dataset's tables on disk: the input file read into items, and the results written as shards.

Imports :mod:`iglens_core` and holds what :func:`iglens_data.attribute_dataset` reads and writes:
:func:`read_items` (a ``.csv``, ``.tsv``, ``.json``, ``.jsonl`` or ``.parquet`` file, or a DataFrame,
as a table of row, id, prompt, answer, foil; every malformed file a ValueError naming it), parquet
shards written atomically (:func:`write_shard`) and merged once every rank is done
(:func:`merge_shards`), the paths of the errors and parts tables beside the results, and
:func:`attribution_from_frame` (one item's attribution rebuilt from its rows, e.g. to draw it again).
:class:`ItemRecords` keeps a notebook's per-item tables the same way, so that a run longer than a
sitting resumes, or is split into shards run side by side (:func:`in_shard`, :func:`recorded`); :func:`object_frame`
turns a nested per-item result into such a table.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from urllib.parse import quote
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence, Union

import numpy as np
import torch

from iglens_core import Attribution, Components, model_fingerprint, plain_number, tie_tolerance
from iglens_stats import top_parts


DATASET_FORMATS = (".csv", ".tsv", ".json", ".jsonl", ".parquet")


def _read_table(path: Path):
    """The file at ``path`` as a DataFrame of its cells as written (object columns: text, ints,
    floats, bytes, None), read by its extension (see :data:`DATASET_FORMATS`); text formats must
    be UTF-8. ``attrs["where"]`` names each row's place in the file (``line 3``; ``record 2`` of a
    JSON list; ``row 2`` of a Parquet table). Every failure is a ValueError naming the file."""
    import json
    import pandas as pd
    suffix = path.suffix.lower()
    if suffix not in DATASET_FORMATS:
        raise ValueError(f"dataset {str(path)!r}: unknown extension {path.suffix!r}, expected one of "
                         f"{', '.join(DATASET_FORMATS)}")
    if path.is_dir():
        raise ValueError(f"dataset {str(path)!r} is a directory; give one {suffix} file")
    if suffix == ".parquet":
        import pyarrow.parquet as pq
        try:
            columns = pq.read_table(path).to_pydict()
        except (OSError, ValueError) as err:  # pyarrow's ArrowInvalid is a ValueError
            raise ValueError(f"dataset {str(path)!r} is not a readable parquet file: {err}") from None
        frame = pd.DataFrame(columns, dtype=object)
        frame.attrs["where"] = [f"row {i}" for i in range(len(frame))]
        return frame
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")  # a byte-order mark is allowed
    except UnicodeDecodeError as err:
        raise ValueError(f"dataset {str(path)!r} is not UTF-8: byte {raw[err.start]:#04x} at offset "
                         f"{err.start} (e.g. Latin-1); re-save it as UTF-8") from None
    if not text.strip():
        raise ValueError(f"dataset {str(path)!r} is empty")
    if suffix in (".csv", ".tsv"):
        return _read_delimited(path, text, "," if suffix == ".csv" else "\t")
    if suffix == ".json":
        try:
            records = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"dataset {str(path)!r} is not valid JSON: {err}") from None
        if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
            found = type(records).__name__ if not isinstance(records, list) else "a list holding non-objects"
            raise ValueError(f"dataset {str(path)!r} must hold a list of records (JSON objects, one per "
                             f"item), found {found}")
        where = [f"record {i + 1}" for i in range(len(records))]
    else:
        records, where = [], []
        for number, line in enumerate(text.split("\n"), 1):  # JSON strings may hold U+2028: no splitlines
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"dataset {str(path)!r} is not valid JSON Lines: line {number}, column "
                                 f"{err.colno}: {err.msg}") from None
            if not isinstance(record, dict):
                raise ValueError(f"dataset {str(path)!r} must hold a list of records (JSON objects, one per "
                                 f"item, one per line), found {type(record).__name__} at line {number}")
            records.append(record)
            where.append(f"line {number}")
    frame = pd.DataFrame(records, dtype=object)  # ints stay ints where a row lacks a key
    frame.attrs["where"] = where
    return frame


def _read_delimited(path: Path, text: str, sep: str):
    """A CSV or TSV file, every cell text as written: each row must have the header's number of fields
    (an unquoted comma in a prompt would shift the columns); blank lines are skipped."""
    import csv
    import io
    import pandas as pd
    name = "CSV" if sep == "," else "TSV"
    quoting = (f"a field holding {'a comma' if sep == ',' else 'a tab'}, a double quote or a line break "
               'must be in double quotes, its own quotes doubled: "Paris, ""the capital"""')
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=sep, strict=True)
    header, rows, where, start = None, [], [], 1
    try:
        for record in reader:
            if record and not (len(record) == 1 and not record[0].strip()):
                if header is None:
                    header = record
                    repeated = sorted({c for c in header if header.count(c) > 1})
                    if repeated:
                        raise ValueError(f"dataset {str(path)!r}: the header (line {start}) repeats the "
                                         f"column names {repeated}")
                elif len(record) != len(header):
                    raise ValueError(
                        f"dataset {str(path)!r} is not valid {name}: line {start} has {len(record)} fields, "
                        f"the header has {len(header)} ({header}); {quoting}")
                else:
                    rows.append(record)
                    where.append(f"line {start}")
            start = reader.line_num + 1
    except csv.Error as err:
        raise ValueError(f"dataset {str(path)!r} is not valid {name}: line {reader.line_num}: {err}; "
                         f"{quoting}") from None
    frame = pd.DataFrame(rows, columns=header, dtype=object)
    frame.attrs["where"] = where
    return frame


def _cell(value, column: str, source: str, where: str, what: str = "text"):
    """One cell as text, or None where it is empty (None, NaN, NA); bytes are decoded as UTF-8.

    Raises:
        ValueError: a list or array (e.g. token ids), a mapping, or bytes that are not UTF-8, naming
            the file, the row's place and the column.
    """
    import numpy as np
    import pandas as pd
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"{source}, {where}, column {column!r}: bytes that are not UTF-8 text (byte "
                             f"{bytes(value)[err.start]:#04x} at offset {err.start})") from None
    if isinstance(value, (list, tuple, dict, set, np.ndarray)) or np.ndim(value) != 0:
        shown = repr(value.tolist() if isinstance(value, np.ndarray) else value)
        raise ValueError(f"{source}, {where}, column {column!r}: {what} expected, got a "
                         f"{type(value).__name__} ({shown[:60]}); token ids are not read: store the text")
    if value is None or value is pd.NA or value is pd.NaT or (
            isinstance(value, (float, np.floating)) and math.isnan(value)):
        return None
    return value if isinstance(value, str) else str(value)


def read_items(items, *, prompt_column: str = "prompt", answer_column: Optional[str] = None,
               id_column: Optional[str] = None, foil_column: Optional[str] = None,
               corrupted_column: Optional[str] = None) -> "pd.DataFrame":
    """A dataset as a table of ``row``, ``id``, ``prompt``, ``answer``, ``foil`` (and ``corrupted``).

    The answer text is used exactly as given: it is tokenised on its own (no space added or
    stripped) and appended to the prompt's tokens. With the chat template the answer starts the
    assistant's turn, where a bare word (``Paris``) is the natural form; for raw-text prompts
    (``chat=False``, ``--no-chat``) a continuation word usually needs its leading space
    (`` Paris``), since ``"Paris"`` and ``" Paris"`` are different tokens. A fact file whose
    object column lacks the space must add it itself if that is the continuation it means.

    Args:
        items: a path to a ``.csv``, ``.tsv``, ``.json`` (a list of records), ``.jsonl`` (one
            record a line) or ``.parquet`` file (text files UTF-8), or a DataFrame / dict of
            columns. It needs a prompt column; an answer column is optional (empty, null or NaN:
            the model's greedy answer), and so is an id column (default: the row number).
            Other columns are ignored.
        prompt_column: the name of the prompt column.
        answer_column: the name of the answer column; None: ``answer`` if there is one. A name
            given must exist.
        id_column: the name of the id column; None: ``id`` if there is one. A name given must exist.
        foil_column: the name of an optional foil column (one token's text, e.g. `` Lyon``;
            empty: no foil); None: ``foil`` if there is one. A name given must exist.
        corrupted_column: the name of a column of corrupted prompts (the counterfactual graph's
            ``--corrupted-column``), read into a ``corrupted`` column; None: none. A name given must exist.

    Returns:
        A DataFrame: ``row`` (int, position in the input), ``id`` (str, unique), ``prompt`` (str),
        ``answer`` (str, or None for greedy), ``foil`` (str, or None); with ``corrupted_column``, ``corrupted``
        (str, or None).

    Raises:
        ValueError: an unknown extension, a directory, a file that is not UTF-8 or does not parse
            (a CSV/TSV row with more or fewer fields than the header: an unquoted comma), a missing
            column, no rows, a row without an id, repeated ids, a cell that is not text (a list
            such as token ids, bytes that are not UTF-8; other bytes are decoded); each names the
            file, and the line (record, row) and column where it applies.
    """
    import pandas as pd
    source = f"dataset {str(items)!r}" if isinstance(items, (str, Path)) else "the dataset"
    frame = _read_table(Path(items)) if isinstance(items, (str, Path)) else pd.DataFrame(items)
    if len(frame) == 0:
        raise ValueError(f"{source} has no rows (columns {list(frame.columns)})")
    where = frame.attrs.get("where") or [f"row {i}" for i in range(len(frame))]
    named = {"prompt": prompt_column, "answer": answer_column, "id": id_column, "foil": foil_column,
             "corrupted": corrupted_column}
    for role, column in named.items():
        if column is not None and column not in frame.columns:
            flag = f"--{role}-column / {role}_column="
            raise ValueError(f"{source} needs {'an' if role == 'answer' else 'a'} {role} column {column!r} ({flag} names another), "
                             f"got columns {list(frame.columns)}")
    answer_column = answer_column or ("answer" if "answer" in frame.columns else None)
    id_column = id_column or ("id" if "id" in frame.columns else None)
    foil_column = foil_column or ("foil" if "foil" in frame.columns else None)

    def cells(column, what="text"):
        if column is None:
            return [None] * len(frame)
        return [_cell(value, column, source, at, what) for value, at in zip(frame[column].tolist(), where)]

    if id_column:
        ids = cells(id_column, "an id (text or an integer)")
        missing = [at for i, at in zip(ids, where) if i is None or not i.strip()]
        if missing:
            raise ValueError(f"{source}: {len(missing)} rows have no id in column {id_column!r} (the first "
                             f"at {missing[0]}); give every row an id, or none (ids: the row numbers)")
    else:
        ids = [str(i) for i in range(len(frame))]
    repeated = sorted(i for i, n in Counter(ids).items() if n > 1)
    if repeated:
        first = [at for i, at in zip(ids, where) if i == repeated[0]]
        raise ValueError(f"{source}: dataset ids must be unique, these repeat: {repeated[:5]} "
                         f"({repeated[0]!r} at {' and '.join(first[:2])})")
    prompts, answers, foils = cells(prompt_column), cells(answer_column), cells(foil_column)
    table = pd.DataFrame(dict(row=range(len(frame)), id=ids,
                              prompt=[p or "" for p in prompts], answer=[a or None for a in answers],
                              foil=[f or None for f in foils]))
    if corrupted_column is not None:
        table["corrupted"] = [c or None for c in cells(corrupted_column)]
    # the columns read, as resolved (a resumed run must read the same ones)
    table.attrs["columns"] = dict(prompt_column=prompt_column, answer_column=answer_column,
                                  id_column=id_column, foil_column=foil_column, corrupted_column=corrupted_column)
    return table


def write_shard(frame, path: Path) -> None:
    """Write one parquet shard atomically: a temporary file, renamed (a kill leaves no half shard)."""
    tmp = path.with_name(f".{path.name}.tmp")
    frame.to_parquet(tmp, index=False)
    os.replace(tmp, path)


def read_shards(parts: Path, kind: str, prefix: str = ""):
    """All ``kind`` ("results" or "errors") shards whose name starts with ``prefix``, or None."""
    import pandas as pd
    files = sorted(parts.glob(f"{prefix}*.{kind}.parquet"))
    return pd.concat([pd.read_parquet(f) for f in files], ignore_index=True) if files else None


def result_tables(results, errors, pieces=None):
    """The dataset's results, errors and parts frames (None: empty), without the shard column, in input order."""
    import pandas as pd
    results = results if results is not None else pd.DataFrame(columns=RESULT_COLUMNS)
    errors = errors if errors is not None else pd.DataFrame(columns=["row", "id", "error"])
    pieces = pieces if pieces is not None else pd.DataFrame(columns=PART_COLUMNS)
    results = results.drop(columns="shard", errors="ignore").sort_values(["row", "token_index", "segment"])
    errors = errors.drop(columns="shard", errors="ignore").sort_values("row")
    # an item's rows keep their written order (kind, rank) within its token
    pieces = pieces.drop(columns="shard", errors="ignore").sort_values(["row", "token_index"], kind="stable")
    return results.reset_index(drop=True), errors.reset_index(drop=True), pieces.reset_index(drop=True)


def in_shard(index: int, shard: str) -> bool:
    """Whether item ``index`` (0-based) belongs to ``shard``: ``"r/k"`` takes the items ``i % k == r``
    (``0 <= r < k``, ASCII digits); ``""`` takes them all."""
    if not isinstance(shard, str):
        raise ValueError(f"shard must be a string 'r/k' (0 <= r < k) or '', got {shard!r}")
    value = plain_number(index)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"index must be an item's 0-based position, an integer >= 0, got {index!r}")
    if not shard:
        return True
    parts = re.fullmatch(r"\s*([0-9]+)\s*/\s*([0-9]+)\s*", shard, re.ASCII)
    if parts is None or not int(parts[1]) < int(parts[2]):
        raise ValueError(f"shard must be 'r/k' with integers 0 <= r < k in ASCII digits (items i % k == r), or '', "
                         f"got {shard!r}")
    return int(value) % int(parts[2]) == int(parts[1])


class ItemRecords:
    """Per-item tables of a long run, one parquet file per item and table, so that it resumes.

    ``folder`` holds ``settings.json`` (the settings that decide the numbers, JSON values; numpy numbers
    and arrays are stored as numbers and lists, and NaN reopens as NaN) and ``<item id>.<table>.parquet``
    (the id URL-quoted; one longer than :data:`RECORD_NAME_CHARS` shortened, with a SHA-256 of the whole
    id), written atomically (:func:`write_shard`). A corrupted settings.json, model.json, table or done
    marker is a ValueError naming the file and what to delete. A run with the same
    settings loads the items already there instead of computing them again; shards run side by
    side (:func:`in_shard`) write disjoint items into one folder, and a last run without a shard
    reads them all. Different settings raise a ValueError listing each difference. Given the ``model``,
    the folder also keeps its :func:`iglens_core.model_fingerprint` (``model.json``, written by the first
    run that passes one), and a model whose sampled weights differ (1e-2 relative, so another dtype of
    the same weights passes) raises a ValueError: a model converted again under the same name does not
    resume into another's records.
    """

    def __init__(self, folder: Union[str, Path], settings: dict, model=None):
        self.folder = Path(folder)
        if not isinstance(settings, dict):
            raise ValueError(f"settings must be a dict of JSON values, got {type(settings).__name__}")
        try:  # as stored: tuples become lists, numpy scalars and arrays numbers and lists
            settings = json.loads(json.dumps(settings, default=_plain))
        except (TypeError, ValueError) as err:
            raise ValueError(f"settings must hold JSON values (dicts with text keys, lists, numbers, text, True/False, "
                             f"None; numpy numbers and arrays), got {settings!r:.200}: {err}") from None
        if self.folder.exists() and not self.folder.is_dir():
            raise ValueError(f"folder {str(self.folder)!r} is a file: give a folder path (it holds settings.json and "
                             "one parquet file per item and table)")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"cannot make the records folder {str(self.folder)!r}: {err}") from None
        path = self.folder / "settings.json"
        if path.exists():
            stored = _read_json(path, "settings", "delete it only if the records there are of these settings, or give "
                                "another folder")
            if not isinstance(stored, dict):
                raise ValueError(f"{path} holds {type(stored).__name__}, not the settings' JSON object: delete it only "
                                 "if the records there are of these settings, or give another folder")
            differ = [f"{key}: {stored.get(key)!r} in {self.folder}, {settings.get(key)!r} now"
                      for key in sorted(set(stored) | set(settings)) if not _same(stored.get(key), settings.get(key))]
            if differ:
                raise ValueError(f"the records in {self.folder} were made with other settings ({'; '.join(differ)});"
                                 " run with the same settings, or give another folder")
        elif any(self.folder.glob("*.parquet")):
            raise ValueError(f"{self.folder} holds records but no settings.json, so resuming could mix runs: "
                             "give an empty folder")
        else:
            tmp = path.with_name(".settings.json.tmp")
            tmp.write_text(json.dumps(settings, indent=1, sort_keys=True), encoding="utf-8")
            os.replace(tmp, path)
        if model is not None:
            self._check_model(model)

    def _check_model(self, model) -> None:
        own = model_fingerprint(model)
        if own is None:  # offloaded weights: nothing to compare
            return
        path = self.folder / "model.json"
        if path.exists():
            stored = _read_json(path, "model fingerprint", "delete it to adopt this model's")
            try:
                stored = torch.tensor(stored, dtype=torch.float64)
            except (TypeError, ValueError, RuntimeError):
                raise ValueError(f"{path} does not hold a list of numbers (the model fingerprint): delete it to adopt "
                                 "this model's") from None
            if stored.shape != own.shape or not torch.allclose(stored, own, rtol=1e-2, atol=1e-8):
                raise ValueError(f"the records in {self.folder} were made with another model's weights (they differ at "
                                 "the sampled entries of ig.model_fingerprint, model.json there): give another folder")
        else:
            tmp = path.with_name(".model.json.tmp")
            tmp.write_text(json.dumps(own.tolist()), encoding="utf-8")
            os.replace(tmp, path)

    def _path(self, item_id, table: str) -> Path:
        """``<quoted id>.<table>.parquet``; an id whose quoted form is longer than :data:`RECORD_NAME_CHARS`
        keeps its first characters and a SHA-256 of the whole id (file names are at most 255 bytes)."""
        name = quote(str(item_id), safe="", errors="surrogatepass")
        if len(name) > RECORD_NAME_CHARS:  # "=" never appears in a quoted id: no clash with a short one
            digest = hashlib.sha256(str(item_id).encode("utf-8", "surrogatepass")).hexdigest()
            name = f"{name[:RECORD_NAME_CHARS - 65]}={digest}"
        return self.folder / f"{name}.{table}.parquet"

    def __contains__(self, item_id) -> bool:
        """Every table of the item was written (the ``done`` marker is written last)."""
        return self._path(item_id, "done").exists()

    def save(self, item_id, **tables) -> None:
        """Write the item's tables (DataFrames), then its ``done`` marker."""
        import pandas as pd
        for name, frame in tables.items():
            if name == "done" or not name.isidentifier() or len(name) > RECORD_TABLE_CHARS:
                raise ValueError(f"table names must be identifiers other than 'done', at most {RECORD_TABLE_CHARS} "
                                 f"characters, got {name!r}")
            write_shard(frame, self._path(item_id, name))
        write_shard(pd.DataFrame({"tables": [",".join(tables)]}), self._path(item_id, "done"))

    def load(self, item_id) -> dict:
        """``{table: DataFrame}`` of an item written by :meth:`save`."""
        if item_id not in self:
            raise KeyError(f"no complete record of item {item_id!r} in {self.folder}")
        marker = self._path(item_id, "done")
        done = _read_parquet(marker, item_id, marker)
        names = done["tables"][0] if "tables" in done.columns and len(done) == 1 else None
        if not isinstance(names, str):
            raise ValueError(f"the done marker {self._path(item_id, 'done')} of item {item_id!r} does not list its "
                             f"tables: delete it to compute the item again")
        return {name: _read_parquet(self._path(item_id, name), item_id, marker) for name in names.split(",") if name}


def recorded(keys: Sequence, compute: Callable, store: Optional["ItemRecords"] = None, shard: str = "",
             progress: Optional[Callable] = None) -> dict:
    """``{key: {table: DataFrame}}`` for the ``keys`` of ``shard`` (:func:`in_shard` on their positions),
    in order: read from ``store`` where it holds them, else ``compute(key)`` (a dict of DataFrames),
    saved there as soon as it returns (``store`` None: kept nowhere). ``progress`` wraps the keys (tqdm)."""
    chosen = [key for i, key in enumerate(keys) if in_shard(i, shard)]
    out = {}
    for key in progress(chosen) if progress is not None else chosen:
        if store is not None and key in store:
            out[key] = store.load(key)
            continue
        out[key] = compute(key)
        if store is not None:
            store.save(key, **out[key])
    return out


# a record's file name ".<item>.<table>.parquet.tmp" must fit 255 bytes: the quoted item id up to RECORD_NAME_CHARS
# (a longer one is shortened, a hash of the whole id kept), a table name up to RECORD_TABLE_CHARS
RECORD_NAME_CHARS, RECORD_TABLE_CHARS = 200, 40


def _plain(value):
    """A numpy number or numeric array in settings, as JSON holds it."""
    if isinstance(value, (np.ndarray, np.generic)) and value.dtype.kind in "biuf":
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not a JSON value")


def _same(a, b) -> bool:
    """JSON values equal, NaN equal to NaN (settings holding NaN must reopen)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _read_json(path: Path, what: str, fix: str):
    """The JSON in ``path``, or a ValueError naming the file, what it holds, and ``fix``."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
        raise ValueError(f"{path} (the records' {what}) is not readable JSON ({err}): {fix}") from None


def _read_parquet(path: Path, item_id, marker: Path):
    """One table of an item's record, or a ValueError naming the file and how to recompute the item."""
    import pandas as pd
    try:
        return pd.read_parquet(path)
    except (OSError, ValueError) as err:  # a missing file; pyarrow's ArrowInvalid is a ValueError
        raise ValueError(f"the record of item {item_id!r} is unreadable: {path} ({type(err).__name__}: {err}); delete "
                         f"{marker} to compute the item again") from None


def _encode(value):
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        return {"__array__": value.tolist(), "dtype": str(value.dtype), "shape": list(value.shape)}
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return value.item()
    raise ValueError(f"object_frame stores dicts, lists, numbers, text, None and numeric numpy arrays, "
                     f"got {type(value).__name__}")


def _decode(value: dict):
    if "__array__" not in value:
        return value
    return np.array(value["__array__"], dtype=value["dtype"]).reshape(value["shape"])


def object_frame(value):
    """A one-cell DataFrame holding ``value`` as JSON, so a nested per-item result (dicts and lists of
    numbers, text, None, numpy arrays and scalars) goes into :class:`ItemRecords`; :func:`frame_object`
    reads it back with every float bit for bit (NaN and infinities included) and arrays of their dtype.
    Dict keys come back as text and tuples as lists, as JSON holds them; anything else is a ValueError naming
    its type."""
    import pandas as pd
    return pd.DataFrame({"json": [json.dumps(value, default=_encode)]})


def frame_object(frame):
    """The value stored by :func:`object_frame`."""
    return json.loads(frame["json"].iloc[0], object_hook=_decode)


def errors_path(out: Union[str, Path]) -> Path:
    """Where :func:`attribute_dataset` writes the errors table: ``X.parquet`` -> ``X.errors.parquet``."""
    out = Path(out)
    return out.with_name(out.stem + ".errors" + (out.suffix or ".parquet"))


def parts_path(out: Union[str, Path]) -> Path:
    """Where :func:`attribute_dataset` writes the parts table: ``X.parquet`` -> ``X.components.parquet``."""
    out = Path(out)
    return out.with_name(out.stem + ".components" + (out.suffix or ".parquet"))


def merge_shards(parts: Path, out: Path, split: bool = False):
    """Rank 0: every shard -> the final results, errors (and, ``split``, parts) files, each item
    exactly once; the parts of an item come from the shard its results come from."""
    results, errors = read_shards(parts, "results"), read_shards(parts, "errors")
    pieces = read_shards(parts, "components") if split else None
    if results is not None:  # an id is in one shard only, unless two runs wrote the folder at once
        results = results[results["shard"] == results.groupby("id")["shard"].transform("min")]
        if pieces is not None:  # a parts shard whose results shard was never written: dropped
            pieces = pieces.merge(results[["id", "shard"]].drop_duplicates(), on=["id", "shard"])
    if errors is not None:
        errors = errors.drop_duplicates("id")
        errors = errors[~errors["id"].isin(set(results["id"]) if results is not None else set())]
    results, errors, pieces = result_tables(results, errors, pieces)
    write_shard(results, out)
    write_shard(errors, errors_path(out))
    if split:
        write_shard(pieces, parts_path(out))
    else:
        parts_path(out).unlink(missing_ok=True)  # a stale table of an earlier run with resolution=
    return results, errors, pieces


RESULT_COLUMNS = ["row", "id", "token_index", "position", "token", "segment", "layer", "label",
                   "value", "lens_start", "lens_end", "p_base", "p_final", "delta_p", "onset",
                   "residual", "quantity", "foil", "shard"]


FRAME_COLUMNS = ("token_index", "position", "segment", "layer", "label", "value", "lens_start", "lens_end",
                 "p_base", "p_final")  # what attribution_from_frame reads


def attribution_from_frame(frame, *, estimator: str = "prediction_aware", steps: int = 16,
                           baseline: str = "embedding") -> Attribution:
    """One item's attribution rebuilt from its rows of a tidy table (``Attribution.to_frame``, or
    :func:`attribute_dataset` results filtered to one ``id``), e.g. to draw it again.

    The table holds tokens as text only, so ``targets`` (and ``foils``, where the table names a
    foil) are all -1; ``quantity`` comes from the table's column (``"prob"`` without one).

    Raises:
        ValueError: a column missing (each one named), or rows that do not form a full (token,
            segment) grid of one item.
    """
    missing = [name for name in FRAME_COLUMNS if name not in frame.columns]
    if missing:
        raise ValueError(f"frame lacks the columns {missing} (an attribution's table, Attribution.to_frame "
                         f"or the dataset's results, has {list(FRAME_COLUMNS)}), got columns {list(frame.columns)}")
    if "id" in frame.columns and frame["id"].nunique() > 1:
        raise ValueError(f"frame holds {frame['id'].nunique()} items; pass the rows of one id")
    frame = frame.sort_values(["token_index", "segment"])
    T, K = frame["token_index"].nunique(), frame["segment"].nunique()
    if T * K != len(frame) or T == 0:
        raise ValueError(f"frame has {len(frame)} rows, not a full grid of {T} tokens x {K} segments")

    def grid(column: str) -> torch.Tensor:  # (T, K)
        return torch.tensor(frame[column].to_numpy(), dtype=torch.float64).view(T, K)

    values, lens_end = grid("value"), grid("lens_end")
    lens = torch.cat([grid("lens_start")[:, :1], lens_end], 1)  # (T, K+1), the baseline first
    first = frame[frame["segment"] == frame["segment"].min()]
    p_base = torch.tensor(first["p_base"].to_numpy(), dtype=torch.float64)
    p_final = torch.tensor(first["p_final"].to_numpy(), dtype=torch.float64)
    residual = float((values.sum(-1) - (p_final - p_base)).abs().max())
    quantity = str(frame["quantity"].iloc[0]) if "quantity" in frame.columns else "prob"
    has_foil = "foil" in frame.columns and bool(frame["foil"].notna().any())
    return Attribution(values, [int(x) for x in frame["layer"].to_numpy()[:K]],
                       [str(x) for x in frame["label"].to_numpy()[:K]], p_base, p_final, lens, residual,
                       torch.full((T,), -1), torch.tensor(first["position"].to_numpy()), estimator,
                       steps, baseline, quantity=quantity, foils=torch.full((T,), -1) if has_foil else None)


PART_COLUMNS = ["row", "id", "token_index", "position", "token", "kind", "rank", "block", "head", "neuron", "node",
                 "source_position", "source_token", "share", "delta_p", "parts_sum", "quantity", "foil", "shard"]


def _not_zero(size: np.ndarray) -> np.ndarray:
    """(m,) bool: which sizes ``|share|`` (m,) are not tied with 0 (above the row's
    :func:`iglens_core.tie_tolerance`, as :func:`iglens_stats.top_positive` decides)."""
    return size > tie_tolerance(size)[0]


def parts_frame(parts: "Components", tokenizer, input_ids: torch.Tensor, resolution: str, top_k: int,
                 row: int, item_id: str, foil: Optional[str]):
    """One item's rows of the parts table (:func:`iglens_data.attribute_dataset` with ``resolution``
    head, neuron or source) from its :class:`iglens_core.Components`."""
    import pandas as pd
    shares = (parts.neurons if resolution == "neuron" else parts.heads).double()  # (T, n, P + 1), bias last
    split = parts.sources.double() if resolution == "source" else shares[..., :-1]
    # the whole decomposition: the split parts, the biases, and the sublayer not split
    whole = (split.flatten(1).sum(-1) + shares[..., -1].sum(-1)
             + (parts.attn if resolution == "neuron" else parts.mlp).double().sum(-1))  # (T,)
    delta_p = parts.delta_p.double()
    ids = input_ids.reshape(-1).tolist()
    source_tokens = [tokenizer.decode([i]) for i in ids]
    tokens = [tokenizer.decode([i]) for i in parts.targets.tolist()]
    moved = parts.by_source().double() if resolution == "source" else None  # (T, S + 1)
    columns = {name: [] for name in PART_COLUMNS if name not in ("row", "id", "node", "quantity", "foil", "shard")}

    def add(t, kind, share, rank=None, block=None, head=None, neuron=None, source=None):
        for name, value in (("token_index", t), ("position", int(parts.positions[t])),
                            ("token", tokens[t]), ("kind", kind),
                            ("rank", rank), ("block", block), ("head", head), ("neuron", neuron),
                            ("source_position", source),
                            ("source_token", None if source is None else source_tokens[source]),
                            ("share", float(share)), ("delta_p", float(delta_p[t])),
                            ("parts_sum", float(whole[t]))):
            columns[name].append(value)

    for t in range(len(parts.targets)):
        grid = split[t]  # (n, H, S), (n, H) or (n, d_ff)
        picked = top_parts(grid, top_k)
        for rank, flat in enumerate(picked.tolist(), 1):
            at = np.unravel_index(flat, grid.shape)
            where = dict(block=int(at[0]) + 1)
            if resolution == "neuron":
                where.update(neuron=int(at[1]))
            else:
                where.update(head=int(at[1]), source=int(at[2]) if resolution == "source" else None)
            add(t, resolution, grid.reshape(-1)[flat], rank, **where)
        add(t, "rest", delta_p[t] - grid.reshape(-1)[torch.from_numpy(picked)].sum())
        if resolution == "source":
            heads = parts.heads[t, :, :-1].double()  # (n, H): each head's sources added up
            for flat in np.flatnonzero(_not_zero(heads.abs().reshape(-1).numpy())).tolist():
                block, head = divmod(flat, heads.shape[1])
                add(t, "head_total", heads[block, head], block=block + 1, head=head)
            for source in range(int(parts.positions[t]) + 1):  # the pattern reads no later position
                add(t, "source_total", moved[t, source], source=source)
            add(t, "source_rest", moved[t, -1])
    frame = pd.DataFrame(columns)
    for name in ("rank", "block", "head", "neuron", "source_position"):
        frame[name] = frame[name].astype("Int64")
    frame.insert(0, "id", item_id)
    frame.insert(0, "row", row)
    frame["quantity"] = parts.quantity
    frame["foil"] = foil
    return frame



# ---------------------------------------------------------------------------
# The graphs of many answer tokens as one long table (the dataset path's resolution="graph")
# ---------------------------------------------------------------------------

GRAPH_NODE_KINDS = ("embedding", "constants", "head", "neuron")  # graph_frame's node kinds, in tie-break order
_INTEGER_COLUMNS = ("rank", "block", "head", "neuron", "node", "source_position")
GRAPH_FRAME_COLUMNS = ["token_index", "position", "token", "kind", "rank", "block", "head", "neuron", "node",
                       "source_position", "source_token", "share", "delta_p", "parts_sum", "quantity"]
CONTRAST_COLUMNS = ["f_clean", "f_corrupted", "gap"]  # graph_frame's columns added for counterfactual graphs


def _is_contrast(thing) -> bool:
    """An iglens_counterfactual.CounterfactualGraph, known by its fields (this module does not import it)."""
    return all(hasattr(thing, name) for name in ("carried", "f_clean", "f_corrupted", "corrupted_ids", "gaps"))


def graph_frame(graphs: Iterable, tokenizer, top_k: int = 20):
    """Answer tokens' graphs as one long table, the rows of each graph in turn (pandas, float64 shares
    in the unit of f).

    One long table rather than a table per kind: it is what the dataset path writes through its shards
    (one parts table per run), and each view is one filter and one pivot away, e.g. the carried map of
    answer token j as causal tracing's (node, position) grid:
    ``rows[(rows.token_index == j) & (rows.kind == "carried")].pivot(index="node", columns="source_position",
    values="share")``.

    Rows per graph, in this order, by ``kind``:

    - ``"embedding"``, ``"constants"``, ``"head"``, ``"neuron"``: the graph's ``top_k`` nodes of largest
      ``|share|``, ranked together (``rank`` 1..k): token embeddings (at ``source_position``), all the
      constants (one leaf), heads (``block``, ``head``, at query ``source_position``) and neurons
      (``block``, ``neuron``, at ``source_position``), every position. The project's tie rule
      (:func:`iglens_stats.top_parts`): shares within :func:`iglens_core.tie_tolerance` of each other
      are ties, broken by the order embeddings by position, the constants, heads by (block, head,
      position), neurons by (block, position, neuron); a node tied with 0 is never written, so fewer
      than k may come.
    - ``"rest"``, one row: ``delta_p`` minus the k shares written, so that they and it add up to
      ``delta_p`` exactly. Nodes at different depths share credit (what a head moves also reaches it
      through the embeddings it reads), so the rest is not the sum of the nodes left out; the rows
      that partition Δ are the carried map's, below.
    - ``"carried"``: node L in 0..n (the residual state after block L; 0: the token embeddings) and
      position ``source_position`` s in 0..t (no later position carries anything): ``Graph.carried[L, s]``,
      what that state carries into the blocks above it.
    - ``"readable"``, ``"constants_above"``: per node L, ``Graph.readable[L]`` (the lens's cumulative term at
      t) and ``Graph.constants_above[L]`` (constants of blocks > L). For every node L, readable + the
      carried row + constants_above = ``parts_sum``; at node 0 that is the leaves: embeddings + constants.

    A counterfactual graph (:class:`iglens_counterfactual.CounterfactualGraph`, read at its last position t)
    gives the same rows over ``delta = f(clean) - f(corrupted)``: its top-k token embeddings, heads and neurons
    (those it has: without ``parts`` only embeddings; no constants, which cancel in the difference) and the
    rest; ``"carried"``, the (node, position) map of the share of ``delta``; and instead of readable and
    constants_above, ``"gaps_below"`` per node L, the quadrature gaps of blocks 1..L, so that for every node
    the carried row + gaps_below = ``parts_sum``. There ``delta_p`` is ``delta``, ``parts_sum`` the leaves'
    sum (``carried[0].sum() = delta + gap``), ``token_index`` null (the graph does not know the prompt's
    length; the dataset path fills it in), and the columns :data:`CONTRAST_COLUMNS` are added: ``f_clean``,
    ``f_corrupted`` (f of the float64 chain) and ``gap`` (every quadrature gap together).

    Columns: :data:`GRAPH_FRAME_COLUMNS`: ``token_index`` (answer token), ``position`` (its predicting
    position t), ``token`` (its text), ``kind``, ``rank``, ``block`` (1..n), ``head``, ``neuron``, ``node``
    (0..n), ``source_position`` (a sequence position), ``source_token`` (its text), ``share``,
    ``delta_p`` (``f(h_n) - f(h_0)``), ``parts_sum`` (``Graph.delta``: the top terms, which every node's
    rows add up to; equal to ``delta_p`` up to the estimator's residual, float rounding with
    ``"prediction_aware"``), ``quantity``; inapplicable entries are null.

    Args:
        graphs: :class:`iglens_graph.Graph` objects, e.g. :func:`iglens_graph.attribution_graphs`'s (read once, one
            graph at a time), or one Graph; or counterfactual graphs (one, or a list).
        tokenizer: for the tokens' text (anything with ``decode``).
        top_k: nodes written per graph, an integer >= 1.
    """
    import pandas as pd

    def is_graph(thing) -> bool:  # an iglens_graph.Graph, known by its fields (this module does not import it)
        return _is_contrast(thing) or all(hasattr(thing, name) for name in
                                          ("carried", "readable", "constants_above", "pruned", "tokens"))
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1:
        raise ValueError(f"top_k must be an integer >= 1 (nodes written per answer token), got {top_k!r}")
    if not callable(getattr(tokenizer, "decode", None)):
        raise ValueError(f"tokenizer must be the model's tokenizer (with .decode, for the tokens' text), "
                         f"got {type(tokenizer).__name__}")
    graphs = [graphs] if is_graph(graphs) else graphs
    if isinstance(graphs, (str, bytes, dict)) or not hasattr(graphs, "__iter__"):
        raise ValueError(f"graphs must be iglens_graph.Graph objects (one, a list, or attribution_graphs' iterator), "
                         f"got {type(graphs).__name__}")
    frames, ids, texts, contrast = [], None, None, False
    for i, graph in enumerate(graphs):
        if not is_graph(graph):
            raise ValueError(f"graphs[{i}] must be an iglens_graph.Graph (from attribution_graph or "
                             f"attribution_graphs) or a CounterfactualGraph, got {type(graph).__name__}")
        if ids is None or not torch.equal(ids, graph.input_ids):
            ids, texts = graph.input_ids, [tokenizer.decode([tok]) for tok in graph.input_ids.tolist()]
        frames.append(_graph_rows(graph, texts, int(top_k), tokenizer.decode([int(graph.target)])))
        contrast = contrast or _is_contrast(graph)
    columns = GRAPH_FRAME_COLUMNS + (CONTRAST_COLUMNS if contrast else [])
    if not frames:
        return pd.DataFrame({name: pd.Series(dtype="object") for name in GRAPH_FRAME_COLUMNS})
    return pd.concat(frames, ignore_index=True).reindex(columns=columns)


def _graph_rows(graph, texts: list[str], top_k: int, token: str):
    """One graph's rows of :func:`graph_frame` (``token``: the target's text), built column by column."""
    import pandas as pd
    contrast, (n, S) = _is_contrast(graph), (graph.carried.shape[0] - 1, graph.carried.shape[1])
    heads = graph.heads if graph.heads is not None else torch.zeros(n, 0, S, dtype=torch.float64)
    neurons = graph.neurons if graph.neurons is not None else torch.zeros(n, S, 0, dtype=torch.float64)
    H, t, null = heads.shape[1], S - 1 if contrast else graph.position, None
    constants = [] if contrast else [graph.constants]  # no constants in f(clean) - f(corrupted)
    sizes = [S, len(constants), n * H * S, neurons.numel()]  # in GRAPH_NODE_KINDS order
    flat = torch.cat([graph.embeddings.double(), torch.tensor(constants, dtype=torch.float64),
                      heads.reshape(-1).double(), neurons.reshape(-1).double()])
    starts = np.cumsum([0] + sizes)
    picked = top_parts(flat, top_k)
    rows = dict(kind=[], rank=[], block=[], head=[], neuron=[], node=[], source_position=[], share=[])

    def add(kind, share, rank=null, block=null, head=null, neuron=null, node=null, source=null):
        for name, value in (("kind", kind), ("rank", rank), ("block", block), ("head", head), ("neuron", neuron),
                            ("node", node), ("source_position", source), ("share", float(share))):
            rows[name].append(value)

    for rank, index in enumerate(picked.tolist(), 1):
        group = int(np.searchsorted(starts, index, side="right")) - 1
        kind, offset = GRAPH_NODE_KINDS[group], index - int(starts[group])
        if kind == "embedding":
            add(kind, flat[index], rank, node=0, source=offset)
        elif kind == "constants":
            add(kind, flat[index], rank)
        elif kind == "head":
            block, head, position = np.unravel_index(offset, (n, H, S))
            add(kind, flat[index], rank, block=int(block) + 1, head=int(head), source=int(position))
        else:
            block, position, neuron = np.unravel_index(offset, neurons.shape)
            add(kind, flat[index], rank, block=int(block) + 1, neuron=int(neuron), source=int(position))
    delta_p = graph.delta if contrast else graph.delta_p
    add("rest", delta_p - float(flat[torch.from_numpy(picked)].sum()))
    for node in range(n + 1):
        for position in range(t + 1):
            add("carried", graph.carried[node, position], node=node, source=position)
    if contrast:  # gaps of the blocks below node L: carried[L].sum() + them = carried[0].sum()
        below = torch.cat([torch.zeros(1, dtype=torch.float64), graph.gaps.double().sum(-1).cumsum(0)])
        for node in range(n + 1):
            add("gaps_below", below[node], node=node)
    for node in range(n + 1) if not contrast else ():
        add("readable", graph.readable[node], node=node)
    for node in range(n + 1) if not contrast else ():
        add("constants_above", graph.constants_above[node], node=node)
    frame = pd.DataFrame({name: pd.array(values, dtype="Int64") if name in _INTEGER_COLUMNS else values
                          for name, values in rows.items()})
    frame["source_token"] = [None if s is None else texts[s] for s in rows["source_position"]]
    frame = frame.assign(token_index=None if contrast else graph.token, position=t, token=token, delta_p=delta_p,
                         parts_sum=float(graph.carried[0].sum()) if contrast else graph.delta, quantity=graph.quantity)
    if contrast:
        frame = frame.assign(f_clean=graph.f_clean, f_corrupted=graph.f_corrupted, gap=graph.gap)
    return frame
