"""Config loading: TOML/YAML, --set overrides, and one clear message per kind of mistake."""

import pytest

from turbogrpo.config import Config, ConfigError, apply_override, load_config


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_are_valid():
    assert load_config() == Config()


def test_toml_and_yaml_give_the_same_config(tmp_path):
    toml = write(tmp_path, "a.toml", """
[model]
path = "some/model"
[algo]
loss = "grpo"
beta = 0.04
[optim]
lr = 1e-5
betas = [0.9, 0.95]
[[rewards]]
function = "math_accuracy"
[[rewards]]
function = "answer_format"
weight = 0.5
kwargs = {answer_column = "gold"}
""")
    yaml = write(tmp_path, "a.yaml", """
model: {path: some/model}
algo: {loss: grpo, beta: 0.04}
optim: {lr: 1e-5, betas: [0.9, 0.95]}   # YAML 1.1 reads 1e-5 as a string; it is still a number here
rewards:
  - function: math_accuracy
  - {function: answer_format, weight: 0.5, kwargs: {answer_column: gold}}
""")
    a, b = load_config(toml), load_config(yaml)
    assert a == b
    assert a.algo.loss == "grpo" and a.optim.lr == 1e-5 and a.optim.betas == [0.9, 0.95]
    assert [r.function for r in a.rewards] == ["math_accuracy", "answer_format"]
    assert a.rewards[1].kwargs == {"answer_column": "gold"}
    assert a.train == Config().train  # untouched sections keep their defaults


def test_overrides_parse_toml_values_and_bare_strings():
    c = load_config(None, ["optim.lr=3e-4", "algo.loss=bnpo", "train.num_steps=7", "log.tensorboard=false",
                           "rollout.stop_strings=[\"\\n\\n\"]", "rewards.0.weight=2", "rewards.1.function=pkg.mod:f",
                           "model.path=\"quoted/path\""])
    assert c.optim.lr == 3e-4 and c.algo.loss == "bnpo" and c.train.num_steps == 7
    assert c.log.tensorboard is False and c.rollout.stop_strings == ["\n\n"]
    assert c.rewards[0].weight == 2.0 and c.rewards[1].function == "pkg.mod:f" and c.model.path == "quoted/path"


def test_overrides_apply_on_top_of_the_file(tmp_path):
    path = write(tmp_path, "c.toml", "[optim]\nlr = 1e-3\nwarmup_steps = 5\n")
    c = load_config(path, ["optim.lr=2e-3"])
    assert c.optim.lr == 2e-3 and c.optim.warmup_steps == 5


@pytest.mark.parametrize("override, message", [
    ("algo.los=grpo", "config key 'algo.los' is unknown (did you mean 'loss'?); allowed keys in [algo]: loss,"),
    ("sampling.temperature=1", "config key 'sampling' is unknown; allowed keys in the top level: model,"),
    ("algo.loss=ppo", "config key 'algo.loss': 'ppo' is not allowed; expected one of bnpo, dapo, dr_grpo, grpo, gspo"),
    ("algo.scale_rewards=std", "config key 'algo.scale_rewards': 'std' is not allowed; expected one of 'group', "
                               "'batch', 'none'"),
    ("optim.lr=fast", "config key 'optim.lr': expected a number, got str 'fast'"),
    ("optim.lr=0", "config key 'optim.lr': 0.0 is not allowed; expected a number > 0"),
    ("train.num_steps=2.5", "config key 'train.num_steps': expected an integer, got float 2.5"),
    ("train.num_steps=0", "config key 'train.num_steps': 0 is not allowed; expected an integer >= 1"),
    ("log.tensorboard=1", "config key 'log.tensorboard': expected true or false, got int 1"),
    ("rollout.num_generations=1", "config key 'rollout.num_generations': 1 is not allowed; expected an integer >= 2"),
    ("rollout.temperature=0", "config key 'rollout.temperature': 0.0 is not allowed; expected a number > 0"),
    ("rollout.top_p=1.5", "config key 'rollout.top_p': 1.5 is not allowed; expected a number in (0, 1]"),
    ("algo.epsilon_low=1", "config key 'algo.epsilon_low': 1.0 is not allowed; expected a number in [0, 1)"),
    ("optim.betas=[0.9]", "config key 'optim.betas': [0.9] is not allowed; expected two numbers in [0, 1)"),
    ("rollout.stop_strings=\"x\"", "config key 'rollout.stop_strings': expected a list, got str 'x'"),
    ("rewards.3.weight=1", "config key 'rewards.3': '3' is not an index of the list"),
    ("rewards.0.wieght=1", "config key 'rewards.0.wieght' is unknown (did you mean 'weight'?)"),
    ("lora.r=0", "config key 'lora.r': 0 is not allowed; expected an integer >= 1"),
    ("model.device=tpu", "config key 'model.device': 'tpu' is not allowed"),
    ("model.pure_bf16=true", "config key 'model.pure_bf16': True is not allowed; expected false, or true only with "
                             "model.dtype = \"bfloat16\""),
    ("algo.tis_cap=0.5", "config key 'algo.tis_cap': 0.5 is not allowed; expected \"auto\", 0 (off) or a number >= 1"),
    ("algo.tis_cap=often", "config key 'algo.tis_cap': 'often' is not allowed; expected a number or 'auto'"),
    ("algo.off_policy_correction=decoupled", "config key 'algo.off_policy_correction': 'decoupled' is not allowed; "
                                             "expected one of tis, mis"),
    ("train.max_staleness=-1", "config key 'train.max_staleness': -1 is not allowed; expected an integer >= 0"),
    ("train.rollout_threads=-1", "config key 'train.rollout_threads': -1 is not allowed; expected an integer >= 0"),
    ("train.max_staleness=0.5", "config key 'train.max_staleness': expected an integer, got float 0.5"),
    ("train.final_dtype=int8", "config key 'train.final_dtype': 'int8' is not allowed; expected one of 'auto',"),
    ("optim", "override 'optim': expected the form key.sub=value"),
    ("optim.lr=inf", "config key 'optim.lr': inf is not allowed; expected a finite number"),
    ("algo.beta=inf", "config key 'algo.beta': inf is not allowed; expected a finite number"),
    ("optim.lr=nan", "config key 'optim.lr': nan is not allowed; expected a finite number"),
    ("rewards.0.weight=-inf", "config key 'rewards.0.weight': -inf is not allowed; expected a finite number"),
    ("train.accuracy_reward=math_acuracy", "config key 'train.accuracy_reward': 'math_acuracy' is not allowed; "
                                           "expected a reward's name (answer_format, environment, math_accuracy, overlong_penalty)"),
    ("model.logprob_backend=flash", "config key 'model.logprob_backend': 'flash' is not allowed; expected one of "
                                    "auto, cascade,"),
    ("train.reward_failure_limit=1.5", "config key 'train.reward_failure_limit': 1.5 is not allowed"),
    ("rollout.step_runner=fast", "config key 'rollout.step_runner': 'fast' is not allowed; expected one of auto, "
                                 "eager, compiled"),
    ("data.on_empty=drop", "config key 'data.on_empty': 'drop' is not allowed; expected one of 'error', 'skip'"),
])
def test_bad_values_name_the_key_and_what_is_allowed(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert str(err.value).startswith(message), str(err.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="allowed extensions are .toml, .yaml and .yml"):
        load_config(write(tmp_path, "c.json", "{}"))
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(write(tmp_path, "c.toml", "[model\n"))
    with pytest.raises(ConfigError, match="config key 'model' must be a table of keys, got str 'x'"):
        load_config(write(tmp_path, "c.yaml", "model: x\n"))
    with pytest.raises(ConfigError, match="config key 'rewards': expected a list"):
        load_config(write(tmp_path, "c.toml", "[rewards]\nfunction = 'math_accuracy'\n"))
    with pytest.raises(ConfigError, match="config key 'rewards': .* expected at least one"):
        load_config(write(tmp_path, "c.yaml", "rewards: []\n"))
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b"[data]\nsystem_prompt = 'caf\xe9'\n")
    with pytest.raises(ConfigError, match=r"config file '.*latin1.toml' line 2: not valid UTF-8 \(byte 0xe9\); save "
                                          "it as UTF-8"):
        load_config(latin1)


def test_override_appends_to_a_list():
    raw = {}
    apply_override(raw, "rewards.1.function=answer_format")
    assert raw == {"rewards": [{"function": "math_accuracy", "weight": 1.0, "fallback": 0.0, "kwargs": {}},
                               {"function": "answer_format"}]}


def test_shipped_configs_are_valid():
    from pathlib import Path
    configs = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.toml")) + \
        sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    assert configs
    for path in configs:
        load_config(path)


def test_unknown_reward_function_is_named():
    with pytest.raises(ConfigError, match="config key 'rewards.0.function': 'acuracy' is not allowed; expected a "
                                          "built-in reward \\(answer_format, environment, math_accuracy, overlong_penalty\\)"):
        load_config(None, ["rewards.0.function=acuracy"])


def test_file_data_needs_a_path():
    with pytest.raises(ConfigError, match="config key 'data.path': '' is not allowed"):
        load_config(None, ["data.kind=rows"])


def test_accuracy_reward_may_name_a_configured_function_or_nothing():
    c = load_config(None, ["rewards.0.function=pkg.mod:exact", "train.accuracy_reward=exact"])
    assert c.train.accuracy_reward == "exact"
    assert load_config(None, ["train.accuracy_reward=\"\""]).train.accuracy_reward == ""


def test_every_registered_logprob_backend_is_accepted():
    from turbogrpo.prefix.backends import BACKENDS
    for name in ["auto", *BACKENDS]:
        assert load_config(None, [f"model.logprob_backend={name}"]).model.logprob_backend == name


def test_a_yaml_key_given_twice_is_refused_not_replaced(tmp_path):
    text = "optim:\n  lr: 1.0e-3\n  warmup_steps: 3\ntrain:\n  num_steps: 2\noptim:\n  schedule: constant\n"
    with pytest.raises(ConfigError, match=r"not valid YAML: line 6, column 1: key 'optim' appears twice in one "
                                          r"mapping \(lines 1 and 6\)"):
        load_config(write(tmp_path, "c.yaml", text))
    with pytest.raises(ConfigError, match="key 'lr' appears twice"):
        load_config(write(tmp_path, "c.yaml", "optim:\n  lr: 1.0e-3\n  lr: 2.0e-3\n"))


def test_yaml_errors_are_one_line(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "c.yaml", "train: [1\n"))
    assert "\n" not in str(err.value) and "line 2, column 1" in str(err.value)


@pytest.mark.parametrize("name, text", [("c.toml", ""), ("c.toml", "# only a comment\n"), ("c.yaml", ""),
                                        ("c.yaml", "{}\n")])
def test_an_empty_config_file_is_refused(tmp_path, name, text):
    with pytest.raises(ConfigError, match="holds no settings; give at least the sections you change"):
        load_config(write(tmp_path, name, text))
    assert load_config(write(tmp_path, name, text), ["train.num_steps=3"]).train.num_steps == 3  # set by --set


def test_a_byte_order_mark_is_read_as_utf8(tmp_path):
    path = tmp_path / "bom.toml"
    path.write_bytes("\ufeff[train]\nnum_steps = 3\n".encode())
    assert load_config(path).train.num_steps == 3


def test_a_folder_passed_as_the_config_is_named_a_folder(tmp_path):
    with pytest.raises(ConfigError, match="is a folder; pass a .toml or .yaml file"):
        load_config(tmp_path)


def test_the_output_folder_has_one_spelling():
    """Every module writes to train.output_dir as given: "a/..", "./" or "~" must not split a run in two."""
    import os
    assert load_config(None, ['train.output_dir="runs/a/../b/./"']).train.output_dir == "runs/b"
    assert load_config(None, ['train.output_dir="~/runs"']).train.output_dir == os.path.expanduser("~/runs")


@pytest.mark.parametrize("overrides, message", [
    (["train.max_staleness=1", "algo.tis_cap=2", 'rollout.speculation="fixed"', 'rollout.engine="vllm"',
      'model.device="cuda"', 'draft.layout="eagle"'],
     "config key 'rollout.engine': 'vllm' is not allowed; expected \"native\" or \"auto\" with rollout.speculation on"),
    (['distributed.strategy="fsdp2"', "lora.enabled=true", "algo.beta=0.04"],
     "config key 'algo.beta': 0.04 is not allowed; expected 0 with distributed.strategy = \"fsdp2\" and LoRA"),
    (['distributed.strategy="fsdp2"', 'rollout.speculation="fixed"'],
     "config key 'rollout.speculation': 'fixed' is not allowed; expected \"off\" with distributed.strategy = "
     "\"fsdp2\""),
    (["train.max_staleness=1", "algo.tis_cap=2", 'distributed.strategy="fsdp2"'],
     "config key 'distributed.strategy': 'fsdp2' is not allowed; expected \"ddp\" with train.max_staleness > 0"),
    (["train.partial_rollouts=1"], "config key 'train.partial_rollouts': 1 is not allowed; expected an integer in [0, "
                                   "train.max_staleness = 0]"),
    (["train.max_staleness=1", "algo.tis_cap=2", "train.partial_rollouts=2"],
     "config key 'train.partial_rollouts': 2 is not allowed; expected an integer in [0, train.max_staleness = 1]"),
    (["train.max_staleness=1", "algo.tis_cap=2", "train.partial_rollouts=1", 'rollout.stop_strings=["x"]'],
     "config key 'rollout.stop_strings': ['x'] is not allowed; expected [] with train.partial_rollouts > 0"),
    (["train.max_staleness=1", "algo.tis_cap=2", "train.partial_rollouts=1", 'env.factory="a.b:c"'],
     "config key 'env.factory': 'a.b:c' is not allowed; expected \"\" with train.partial_rollouts > 0"),
    (["train.max_staleness=1", "algo.tis_cap=0"],
     "config key 'algo.tis_cap': 0.0 is not allowed; expected \"auto\" or a number >= 1 with train.max_staleness > 0"),
    (["train.rollout_worker=\"remote\""], "config key 'train.rollout_worker': 'remote' is not allowed; expected \"local\" "
                                        "with train.max_staleness = 0"),
    (["train.max_staleness=1", "train.rollout_port=0"], "config key 'train.rollout_port': 0 is not allowed; expected a TCP "
                                                       "port (1..65535)"),
])
def test_what_the_rollout_worker_cannot_do_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_an_asynchronous_config_with_the_correction_on_loads():
    config = load_config(None, ["train.max_staleness=2", "algo.tis_cap=2", "train.rollout_threads=1"])
    assert (config.train.max_staleness, config.train.rollout_threads) == (2, 1)
    assert load_config(None, ["train.max_staleness=1"]).algo.tis_cap == "auto"  # on by default (below)


@pytest.mark.parametrize("sets, differs, cap", [
    ([], False, 0.0), ([], True, 2.0),                          # "auto": on only where the sampler differs
    (["algo.tis_cap=0"], True, 0.0), (["algo.tis_cap=3"], False, 3.0),  # a number is kept
])
def test_tis_cap_auto_turns_the_correction_on_where_the_sampler_is_not_the_trainer(sets, differs, cap):
    algo = load_config(None, sets).algo
    assert algo.resolved(sampler_differs=differs).tis_cap == cap
    config = load_config(None, ["train.max_staleness=2", "algo.tis_cap=2", "train.partial_rollouts=2"])
    assert (config.train.max_staleness, config.train.partial_rollouts) == (2, 2)
