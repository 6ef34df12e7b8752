import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast


@pytest.fixture(scope="session")
def byte_tokenizer():
    """A byte-level BPE tokenizer with no chat template (each byte is a token; a few merges)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>", "<pad>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["What is two plus two?", "Solve: 3 + 4"], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<pad>")


@pytest.fixture
def chat_tokenizer(byte_tokenizer):
    """The byte tokenizer with a minimal chat template."""
    tokenizer = byte_tokenizer.__class__(tokenizer_object=byte_tokenizer.backend_tokenizer,
                                         eos_token="<eos>", pad_token="<pad>")
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")
    return tokenizer
