"""The data-kind registries: one entry per data.kind, in one of them."""


def test_every_data_kind_has_one_reader_entry():
    import typing

    from turbogrpo.config import DataConfig
    from turbogrpo.data.kinds import BUILTIN_TASKS, FILE_KINDS
    kinds = set(typing.get_args(typing.get_type_hints(DataConfig)["kind"]))
    assert set(BUILTIN_TASKS) | set(FILE_KINDS) == kinds and not set(BUILTIN_TASKS) & set(FILE_KINDS)


def test_each_kind_reads_its_held_out_file_as_it_reads_a_file(tmp_path):
    import json

    from turbogrpo.config import DataConfig
    from turbogrpo.data.kinds import eval_rows, train_rows
    gsm8k, rows = tmp_path / "gsm8k.jsonl", tmp_path / "rows.jsonl"
    gsm8k.write_text(json.dumps({"question": "q", "answer": "2+2=4\n#### 4"}) + "\n")
    rows.write_text(json.dumps({"prompt": "p", "answer": "#### 5"}) + "\n")
    plain = [{"prompt": "p", "answer": "#### 5"}]
    with_gold = [{"question": "q", "answer": "2+2=4\n#### 4", "gold": "4"}]
    # a gsm8k file is read with its gold answers, for training and held out alike
    assert train_rows(DataConfig(kind="gsm8k", path=str(gsm8k)), 0) == with_gold
    assert eval_rows(DataConfig(kind="gsm8k", path=str(gsm8k), eval_path=str(gsm8k))) == with_gold
    # a rows file, and a held-out file beside a built-in task, as plain rows
    assert eval_rows(DataConfig(kind="rows", path=str(rows), eval_path=str(rows))) == plain
    assert eval_rows(DataConfig(kind="arithmetic", eval_path=str(rows))) == plain
    # no held-out file: a built-in task's fixed eval split, else none
    assert len(eval_rows(DataConfig(kind="arithmetic", num_eval_problems=3))) == 3
    assert eval_rows(DataConfig(kind="rows", path=str(rows))) is None
