"""Prompt data: local sources, tokenized prompts, resumable batches, GSM8K, the built-in tasks and the
data kinds' registries (``kinds.py``)."""

from turbogrpo.data.arithmetic import (PREAMBLE, ArithmeticConfig, ArithmeticProblem, demo_records,
                                       generate_problems, problem_records)
from turbogrpo.data.batches import PromptBatches
from turbogrpo.data.gsm8k import extract_hash_answer, gsm8k_records
from turbogrpo.data.longform import LongformConfig, LongformProblem, generate_longform_problems, longform_records
from turbogrpo.data.small_arithmetic import small_arithmetic_records
from turbogrpo.data.prompts import PromptExample, PromptSet, build_prompts
from turbogrpo.data.sources import SOURCE_READERS, read_records

__all__ = [
    "PREAMBLE", "ArithmeticConfig", "ArithmeticProblem", "demo_records", "generate_problems", "problem_records",
    "LongformConfig", "LongformProblem", "generate_longform_problems", "longform_records",
    "PromptBatches", "extract_hash_answer", "gsm8k_records", "PromptExample", "PromptSet", "build_prompts",
    "SOURCE_READERS", "read_records", "small_arithmetic_records",
]
