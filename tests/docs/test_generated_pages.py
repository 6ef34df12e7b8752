"""The generated pages equal what their scripts make now from the committed code and results, and a
result file the benchmarks page cannot render stops the generator naming the file and the field."""

import importlib.util
import json
import shutil
import sys

import pytest

from tests.docs.markdown import REPO


def script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (dataclasses look their module up while the class is made)
    spec.loader.exec_module(module)
    return module


bench_docs = script("bench_docs")
config_docs = script("config_docs")
architectures_docs = script("architectures_docs")


def test_settings_page_is_current():
    committed = (REPO / "docs" / "guide" / "settings.md").read_text(encoding="utf-8")
    assert committed == config_docs.render(), "docs/guide/settings.md is out of date: run `make docs-pages`"


def test_architectures_page_is_current():
    committed = (REPO / "docs" / "guide" / "architectures.md").read_text(encoding="utf-8")
    assert committed == architectures_docs.render(), "docs/guide/architectures.md is out of date: run `make docs-pages`"


def test_architectures_page_names_every_table_entry():
    from turbogrpo.architectures import TOKEN_MIXING_RULES, VERIFIED_SHARED
    from turbogrpo.output_head import LOGIT_TRANSFORMS
    page = architectures_docs.render()
    for model_type in [*VERIFIED_SHARED, *(t for r in TOKEN_MIXING_RULES for t in r.known_model_types),
                       *(t for transform in LOGIT_TRANSFORMS for t in transform.model_types or ())]:
        assert f"`{model_type}`" in page, model_type


def test_settings_page_lists_every_field_of_every_section():
    import dataclasses
    import typing

    from turbogrpo.config import Config
    page = config_docs.render()
    for section in dataclasses.fields(Config):
        hint = typing.get_type_hints(Config)[section.name]
        cls, prefix = (typing.get_args(hint)[0], "rewards.N") if typing.get_origin(hint) is list else (hint, section.name)
        for f in dataclasses.fields(cls):
            assert f"| `{prefix}.{f.name}` |" in page


def test_a_field_without_docstring_is_refused():
    from dataclasses import dataclass

    @dataclass
    class Undocumented:
        """A section."""
        documented: int = 1
        """Has a docstring."""
        bare: int = 2

    with pytest.raises(ValueError, match="Undocumented field\\(s\\) bare have no docstring"):
        config_docs.section_table(Undocumented, "undocumented", "[undocumented]")


def test_benchmark_pages_plots_and_readme_headline_are_current():
    assert bench_docs.stale_files() == [], "run `make bench-docs`"


def test_benchmark_page_has_one_table_per_current_result():
    page = bench_docs.render_pages()["docs/benchmarks.md"]
    archive = bench_docs.render_pages()["docs/benchmarks-archive.md"]
    for result in bench_docs.rendered_results():
        home = archive if result.archived_by else page
        assert f'<a id="{bench_docs.anchor(result.stem)}"></a>' in home
        assert f"`bench/results/{result.stem}.json`" in home


def test_the_readme_figures_are_the_generated_headline():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index(bench_docs.HEADLINE_START):readme.index(bench_docs.HEADLINE_END)]
    data = json.loads((REPO / "bench/results/e2e_smollm2-zero-shot.json").read_text())
    assert f"**{data['shapes'][0]['speedup']:.2f}x**" in table  # read from the JSON, not typed in


@pytest.fixture
def results_copy(tmp_path, monkeypatch):
    folder = tmp_path / "results"
    shutil.copytree(REPO / "bench" / "results", folder)
    monkeypatch.setattr(bench_docs, "RESULTS_DIR", folder)
    return folder


def test_a_result_missing_a_field_fails_naming_file_and_field(results_copy):
    path = results_copy / "prefix_smollm2.json"
    data = json.loads(path.read_text())
    del data["shapes"][1]["speedup_vs_standard"]
    path.write_text(json.dumps(data))
    with pytest.raises(bench_docs.BenchDocError,
                       match=r"^bench/results/prefix_smollm2\.json \(shapes\.1\): field 'speedup_vs_standard' is missing"):
        bench_docs.render_pages()


def test_a_result_nobody_registered_fails_naming_it(results_copy):
    shutil.copy(results_copy / "prefix.json", results_copy / "prefix_new_run.json")
    with pytest.raises(bench_docs.BenchDocError, match=r"bench/results/prefix_new_run\.json is not in .*RESULTS"):
        bench_docs.render_pages()


def test_missing_date_and_capability_read_not_recorded(results_copy):
    page = bench_docs.render_pages()["docs/benchmarks.md"]
    section = page[page.index('<a id="smollm2-lossless-check">'):]
    assert "- date: not recorded" in section.split("<a id=")[1]
    assert "- CPU matmul extensions: not recorded" in section.split("<a id=")[1]


def awaiting_result(results_copy, monkeypatch) -> str:
    """The stem of a result registered before its first run (a trl_async table; none of the real ones may be
    awaiting), its JSON absent from the copy."""
    stem = "awaiting_example"
    monkeypatch.setattr(bench_docs, "RESULTS", [*bench_docs.RESULTS, bench_docs.Result(
        stem, "trl_async", "An example awaiting its first run", "python bench/example.py",
        section="Asynchronous GRPO", awaiting_run=True)])
    (results_copy / f"{stem}.json").unlink(missing_ok=True)
    return stem


def test_a_result_awaiting_its_first_run_is_left_off_until_its_json_exists(results_copy, monkeypatch):
    stem = awaiting_result(results_copy, monkeypatch)
    assert f'<a id="{bench_docs.anchor(stem)}"></a>' not in bench_docs.render_pages()["docs/benchmarks.md"]
    contender = {"name": "TRL AsyncGRPOTrainer, max_staleness 1", "trainer_threads": 1, "sampler_threads": 1,
                 "step_s_median": 41.5, "tokens_per_s": 150.0}
    (results_copy / f"{stem}.json").write_text(json.dumps({
        "contenders": [contender, {**contender, "name": "turbogrpo, train.max_staleness = 1", "step_s_median": 27.0}],
        "speedup": 41.5 / 27.0, "versions": {"trl": "1.16.0", "vllm": "0.31.0"}, "trl_patch": "file push"}))
    page = bench_docs.render_pages()["docs/benchmarks.md"]
    section = page[page.index(f'<a id="{bench_docs.anchor(stem)}"></a>'):].split("<a id=")[1]
    assert "| TRL AsyncGRPOTrainer, max_staleness 1 | 1 | 1 | 41.5 |" in section
    assert "| 1.54x | 1.16.0 | 0.31.0 | file push |" in section


def test_a_result_awaiting_its_first_run_still_names_missing_fields(results_copy, monkeypatch):
    stem = awaiting_result(results_copy, monkeypatch)
    (results_copy / f"{stem}.json").write_text(json.dumps({"contenders": [{"name": "TRL"}]}))
    with pytest.raises(bench_docs.BenchDocError, match=rf"bench/results/{stem}\.json \(contenders\.0\): field "):
        bench_docs.render_pages()
