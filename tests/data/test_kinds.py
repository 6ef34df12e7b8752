"""The data-kind registries: one entry per data.kind."""


def test_every_data_kind_has_one_reader_entry():
    import typing

    from turbogrpo.config import DataConfig
    from turbogrpo.data.kinds import BUILTIN_TASKS, ROW_READERS
    kinds = set(typing.get_args(typing.get_type_hints(DataConfig)["kind"]))
    assert set(ROW_READERS) == kinds and set(BUILTIN_TASKS) <= kinds
