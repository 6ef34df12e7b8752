import json
from pathlib import Path

import pytest

from turbogrpo.data.gsm8k import extract_hash_answer, gsm8k_records

GSM8K = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "gsm8k" / "test.jsonl"


def test_extract_hash_answer_hand_cases():
    assert extract_hash_answer("He runs 9*60=540 meters\n#### 540") == "540"
    assert extract_hash_answer("#### 70,000") == "70000"
    assert extract_hash_answer("a #### 1\nthen #### -3.5\nextra line") == "-3.5"
    assert extract_hash_answer("#### 1, 2") == "1, 2"  # a list, not a thousands separator
    assert extract_hash_answer("the answer is 5") is None
    assert extract_hash_answer("####   ") is None


def test_records_get_gold_column(tmp_path):
    path = tmp_path / "gsm.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "2+2=4\n#### 4"}) + "\n")
    assert gsm8k_records(path) == [{"question": "q", "answer": "2+2=4\n#### 4", "gold": "4"}]
    path.write_text(json.dumps({"question": "q", "answer": "no final line"}) + "\n")
    with pytest.raises(ValueError, match="row 0"):
        gsm8k_records(path)


@pytest.mark.skipif(not GSM8K.is_file(), reason=f"GSM8K test split not found at {GSM8K} (../shared is absent)")
def test_real_gsm8k_gold_answers():
    records = gsm8k_records(GSM8K)
    assert len(records) == 1319
    # First lines of the file: Janet's ducks (18), the robe (3), the house flip ($70,000).
    assert [r["gold"] for r in records[:3]] == ["18", "3", "70000"]
    assert all(r["gold"].lstrip("-").replace(".", "", 1).isdigit() for r in records)
