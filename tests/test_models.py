import re

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from turbogrpo.data.arithmetic import generate_problems
from turbogrpo.models import ARCHITECTURES, demo_model_path, load_model_and_tokenizer, tiny_model


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_tiny_models_run_and_are_seeded(arch):
    before = torch.random.get_rng_state()
    model = tiny_model(arch, vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, seed=3)
    assert torch.equal(torch.random.get_rng_state(), before)
    again = tiny_model(arch, vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    assert model.config.head_dim == 8 and model.config.num_key_value_heads == 2
    logits = model(torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, 64) and logits.dtype == torch.float32


def test_tiny_model_dtype_and_bad_arguments():
    assert tiny_model("llama", dtype="float64").dtype == torch.float64
    with pytest.raises(ValueError, match="arch must be one of"):
        tiny_model("gpt2")
    with pytest.raises(ValueError, match="divisible"):
        tiny_model("qwen2", hidden=30, heads=4)


def _byte_tokenizer():
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(["hello"], trainers.BpeTrainer(
        vocab_size=258, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>")


def test_load_local_folder_with_dtype(tmp_path):
    tiny_model("qwen3", vocab_size=258).save_pretrained(tmp_path)
    _byte_tokenizer().save_pretrained(tmp_path)
    model, tokenizer = load_model_and_tokenizer(tmp_path, dtype="bfloat16", device="cpu")
    assert model.dtype == torch.bfloat16 and model.config.model_type == "qwen3"
    assert tokenizer.pad_token == "<eos>"  # filled from eos for batched rollouts


def test_a_folder_declaring_a_generic_fast_tokenizer_gets_its_own_tokenizer_json(tmp_path):
    # transformers 5 would rebuild a qwen2 folder's tokenizer as byte-level BPE and lose these tokens.
    from tests.train.tiny_run import char_tokenizer
    saved = char_tokenizer()
    tiny_model("qwen2", vocab_size=len(saved)).save_pretrained(tmp_path)
    saved.save_pretrained(tmp_path)
    _, tokenizer = load_model_and_tokenizer(tmp_path)
    text = "Mia has 12 pens. 12+3=15"
    assert tokenizer(text)["input_ids"] == saved(text)["input_ids"]
    assert tokenizer.decode(saved(text)["input_ids"]) == text


def test_missing_local_path_and_bad_dtype(tmp_path):
    with pytest.raises(ValueError, match="not an existing folder"):
        load_model_and_tokenizer(tmp_path / "no_model_here")
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model_and_tokenizer(tmp_path, dtype="fp8")
    with pytest.raises(ValueError, match="has no config.json"):
        load_model_and_tokenizer(tmp_path)


def test_demo_model_loads_with_auto_classes_and_writes_the_format():
    path = demo_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.num_hidden_layers >= 8 and len(tokenizer) <= 512
    problems = generate_problems("eval", 4, seed=123)
    batch = tokenizer([p.prompt for p in problems], return_tensors="pt", padding=True)
    out = model.generate(**batch, do_sample=False, max_new_tokens=32, pad_token_id=tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    for text in texts:
        assert re.fullmatch(r" \d+[+-]\d+=\d+( \d+[+-]\d+=\d+)*\n#### \d+", text), text


def test_truncated_weights_are_named_in_one_line(tmp_path):
    from tests.train.tiny_run import write_model
    folder = write_model(tmp_path / "model")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=rf"could not load model '{folder}': {weights} is truncated or corrupt \("
                                         r".*\); copy or download the model again"):
        load_model_and_tokenizer(folder)


def test_a_hub_id_fails_at_once_when_the_hub_cannot_be_reached(monkeypatch):
    import time

    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # the discard port: refused at once
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"model 'nobody-i12/no-such-model' is not a local folder, is not in the "
                                         r"Hugging Face cache, and the Hub \(http://127.0.0.1:9\) cannot be reached; .*"
                                         r"set HF_HUB_OFFLINE=1"):
        load_model_and_tokenizer("nobody-i12/no-such-model")
    assert time.perf_counter() - start < 10


def test_shipped_model_names_resolve_to_their_folders(tmp_path, monkeypatch):
    from turbogrpo import models

    assert models.resolve_model_path("demo") == models.DEMO_MODEL_DIR
    assert models.resolve_model_path("some/folder") == "some/folder"
    monkeypatch.setitem(models.SHIPPED_MODELS, "longform", (tmp_path / "absent", "scripts/build_longform_model.py"))
    with pytest.raises(ValueError, match="build_longform_model.py"):
        models.resolve_model_path("longform")


def test_a_model_folder_without_tokenizer_files_is_named(tmp_path):
    tiny_model("qwen2").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"model folder '{tmp_path}' has no tokenizer files \(tokenizer.json, "):
        load_model_and_tokenizer(tmp_path)


def test_a_recurrent_model_folder_is_refused_by_its_type(tmp_path):
    from transformers import MambaConfig, MambaForCausalLM
    MambaForCausalLM(MambaConfig(vocab_size=258, hidden_size=16, num_hidden_layers=1)).save_pretrained(tmp_path)
    _byte_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"holds a 'mamba' model, whose layers mix tokens by recurrence or "
                                         r"convolution .*; turbogrpo trains pure-attention decoders") as err:
        load_model_and_tokenizer(tmp_path)
    assert "attn_implementation" not in str(err.value)


def test_pickle_weights_that_hold_code_are_refused_naming_the_file(tmp_path):
    import os
    tiny_model("qwen2", vocab_size=258).config.save_pretrained(tmp_path)
    _byte_tokenizer().save_pretrained(tmp_path)

    class RunsCode:
        def __reduce__(self):
            return os.getpid, ()
    torch.save({"model.embed_tokens.weight": RunsCode()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"could not load model .*: its pickle weights \(pytorch_model.bin\) hold "
                                         r"more than tensors, which torch's safe loader refuses") as err:
        load_model_and_tokenizer(tmp_path)
    assert "weights_only" not in str(err.value)


def test_a_lora_export_loads_as_its_base_with_the_adapters_merged(tmp_path):
    from peft import LoraConfig, get_peft_model
    from tests.train.tiny_run import write_model
    base, tokenizer = load_model_and_tokenizer(write_model(tmp_path / "base"))
    tuned = get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5, generator=torch.Generator().manual_seed(1))
    tuned.save_pretrained(tmp_path / "final")  # adapters only, no config.json: what a LoRA run exports
    tokenizer.save_pretrained(tmp_path / "final")
    ids = torch.tensor([[5, 9, 12, 3]])
    expected = tuned(ids).logits
    merged, loaded_tokenizer = load_model_and_tokenizer(tmp_path / "final")
    assert not hasattr(merged, "peft_config") and loaded_tokenizer("ab")["input_ids"] == tokenizer("ab")["input_ids"]
    torch.testing.assert_close(merged(ids).logits, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_cuda_device_without_cuda_is_one_line():
    with pytest.raises(ValueError, match=r"^device: 'cuda' needs CUDA, which this machine \(or this torch build\) "
                                         r"lacks; use \"cpu\"$"):
        load_model_and_tokenizer(demo_model_path(), device="cuda")
    with pytest.raises(ValueError, match=r"^device: 'gpu0' is not a device"):
        load_model_and_tokenizer(demo_model_path(), device="gpu0")


def test_a_model_that_is_no_causal_lm_is_refused(tmp_path):
    # BERT loads through AutoModelForCausalLM (BertLMHeadModel) and "measured" greedy 0.0%.
    from transformers import BertConfig, BertForMaskedLM
    BertForMaskedLM(BertConfig(vocab_size=258, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=32)).save_pretrained(tmp_path)
    _byte_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"holds a 'bert' model \(BertForMaskedLM\), not a causal language model"):
        load_model_and_tokenizer(tmp_path)


def _a_run_folder(root, *, final: bool):
    """A training run's layout: config.json (the run's), inputs.json, latest, step-000001/ (and final/)."""
    (root / "step-000001").mkdir(parents=True)
    (root / "step-000001" / "state.json").write_text("{}")
    (root / "step-000001" / "model.safetensors").write_bytes(b"")
    (root / "latest").write_text("step-000001")
    (root / "config.json").write_text("{}")
    (root / "inputs.json").write_text("{}")
    if final:
        tiny_model("qwen2", vocab_size=258).save_pretrained(root / "final")
        _byte_tokenizer().save_pretrained(root / "final")


def test_a_run_or_checkpoint_folder_names_the_final_model_to_pass(tmp_path):
    run = tmp_path / "runs" / "x"
    _a_run_folder(run, final=True)
    with pytest.raises(ValueError, match=rf"model path '{run}' is a training run's folder, not a model folder; pass "
                                         rf"its final model, '{run / 'final'}'"):
        load_model_and_tokenizer(run)
    with pytest.raises(ValueError, match=rf"is a checkpoint folder of the run in '{run}', not a model folder; pass its "
                                         rf"final model, '{run / 'final'}'"):
        load_model_and_tokenizer(run / "step-000001")
    load_model_and_tokenizer(run / "final")
    unfinished = tmp_path / "runs" / "y"
    _a_run_folder(unfinished, final=False)
    with pytest.raises(ValueError, match=r"the run has no final model yet .* resume it to finish"):
        load_model_and_tokenizer(unfinished / "step-000001")


def test_a_folder_of_another_user_is_not_readable_not_incomplete(tmp_path, monkeypatch):
    import os
    tiny_model("qwen2", vocab_size=258).save_pretrained(tmp_path)
    _byte_tokenizer().save_pretrained(tmp_path)
    real_access = os.access
    # Files of mode 600 owned by someone else (simulated: this test may run as root, who reads anything).
    monkeypatch.setattr(os, "access", lambda path, mode: False if str(path).endswith(".safetensors")
                        else real_access(path, mode))
    with pytest.raises(ValueError, match=r"is not readable: model.safetensors is not readable by this user") as err:
        load_model_and_tokenizer(tmp_path)
    assert "not a complete save_pretrained folder" not in str(err.value)
