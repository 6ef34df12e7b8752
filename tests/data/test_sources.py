import json

import pytest

from turbogrpo.data.sources import read_records, source_kind

ROWS = [{"prompt": "What is 2+2?", "answer": "4"}, {"prompt": "What is 3+4?", "answer": "7"}]


def test_jsonl(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    assert source_kind(path) == "jsonl"
    assert read_records(path) == ROWS


def test_jsonl_bad_line_names_the_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match="line 2"):
        read_records(path)


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert read_records(path) == ROWS


def test_saved_dataset_and_dataset_dict(tmp_path):
    from datasets import Dataset, DatasetDict

    Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "single"))
    assert read_records(tmp_path / "single") == ROWS
    DatasetDict({"train": Dataset.from_list(ROWS), "test": Dataset.from_list(ROWS[:1])}).save_to_disk(
        str(tmp_path / "dict"))
    assert read_records(tmp_path / "dict") == ROWS
    assert read_records(tmp_path / "dict", split="test") == ROWS[:1]
    with pytest.raises(ValueError, match=r"holds splits \['test', 'train'\]; split 'validation' is not one of "
                                         r"them: set data.split to one of"):
        read_records(tmp_path / "dict", split="validation")


def test_a_dataset_saved_without_splits_is_read_whole_by_the_default_split(tmp_path):
    # data.split defaults to "train", which a user of an unsplit folder never chose: it reads every row.
    from datasets import Dataset

    from turbogrpo.config import DataConfig
    from turbogrpo.data.kinds import file_rows

    Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "single"))
    assert file_rows(DataConfig(kind="rows", path=str(tmp_path / "single")), str(tmp_path / "single")) == ROWS
    assert read_records(tmp_path / "single", split="train") == ROWS
    with pytest.raises(ValueError, match=r"holds a single dataset saved without splits \(2 rows, columns \['prompt', "
                                         r"'answer'\]\), so split 'test' cannot be read from it; set data.split to "
                                         r"'train' to read all its rows"):
        read_records(tmp_path / "single", split="test")


def test_bad_paths(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_records(tmp_path / "missing.jsonl")
    (tmp_path / "rows.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="suffix"):
        read_records(tmp_path / "rows.csv")
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match="save_to_disk"):
        read_records(tmp_path / "folder")


def test_non_utf8_jsonl_names_the_file_and_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=rf"{path} line 2: not valid UTF-8 \(byte 0xe9 at column 16\); save the file "
                                         "as UTF-8"):
        read_records(path)


def test_a_source_without_rows_is_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    empty_jsonl = tmp_path / "empty.jsonl"
    empty_jsonl.write_text("\n\n")
    with pytest.raises(ValueError, match=rf"data file {empty_jsonl} holds no rows"):
        read_records(empty_jsonl)
    empty_parquet = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), empty_parquet)
    with pytest.raises(ValueError, match=rf"data file {empty_parquet} holds no rows"):
        read_records(empty_parquet)


def test_a_byte_order_mark_in_jsonl_is_read_as_utf8(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes("\ufeff".encode() + "\n".join(json.dumps(r) for r in ROWS).encode())
    assert read_records(path) == ROWS
