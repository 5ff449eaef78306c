"""Exact match compares answers as numbers: the GSM8K-style edge cases of datamodule.extract (values, not text)."""

import json
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from onn.modalities.text.datamodule import extract, extract_answer

ROOT = Path(__file__).resolve().parents[1]
GSM8K_TEST = ROOT.parent / "shared" / "data" / "gsm8k" / "test.jsonl"
GSM8K = OmegaConf.load(ROOT / "conf" / "data" / "gsm8k.yaml").answer_pattern  # the shipped `#### N` pattern
# A pattern that also reads "$", "%", fractions and mixed numbers after ####.
WIDE = r"####\s*(-?\$?[0-9][0-9,\.]*(?: +[0-9]+/[0-9]+|/[0-9]+)?%?)"


def hit(reference: str, completion: str, pattern: str | None) -> bool:
    """As generate.answer_scores scores one generation."""
    return extract(completion, pattern, last_number=True)[0] == extract_answer(reference, pattern)


@pytest.mark.parametrize(
    ("reference", "completion", "pattern"),
    [
        ("#### 7.5", "so she needs 7 1/2 cups", GSM8K),  # mixed number: was its last digit, 2
        ("#### 0.75", "the tank is 3/4", GSM8K),  # fraction: was 4
        ("#### 5", "the numbers are 3,4,5", GSM8K),  # commas that are no thousands: was 345
        ("#### $1,234.00", "#### 1234", WIDE),  # dollars and cents: was the text "$1,234.00"
        ("1234", "$1,234.00", None),
        ("50", "50%", None),  # a percent is its number, as GSM8K writes it after ####
        ("7.5", "7 1/2", None),
        ("0.333333", "1/3", None),  # values agree to 6 decimals
        ("-5", "-5.0", None),
        ("18.5", "18.50", None),
        ("#### 1000", "#### 1,000", GSM8K),
        ("0.5", ".5", None),  # a decimal part alone: was the text ".5" once numbers were read by NUMBER
        ("#### -0.75", "it falls by -.75", GSM8K),
        ("#### 4", "so she keeps box No.4", GSM8K),  # a dot after a letter is no decimal point: was 0.4
    ],
)
def test_equal_values_match(reference: str, completion: str, pattern: str | None):
    assert hit(reference, completion, pattern)


@pytest.mark.parametrize(
    ("reference", "completion", "pattern"),
    [
        ("12345678901234567890", "12345678901234567891", None),  # floats made these one number
        ("#### 1000", "#### 1.000", GSM8K),  # "1.000" is the decimal 1: only commas separate thousands
        ("7", "7 1/2", None),
        ("#### 10", "She works 5-10 hours, -10 less", GSM8K),  # negative only after no digit: -10 is last
        ("#### 5", "it fell to -5", GSM8K),
    ],
)
def test_different_values_do_not_match(reference: str, completion: str, pattern: str | None):
    assert not hit(reference, completion, pattern)


def test_what_extract_reads():
    """The values themselves, and text that is no number compared as written."""
    assert extract("#### 1.000", GSM8K) == ("1", "pattern")
    assert extract("She works 5-10 hours", GSM8K, last_number=True) == ("10", "last number")
    assert extract("#### -7 1/2", WIDE) == ("-7.5", "pattern")
    assert extract("it costs -$3/4 now", GSM8K, last_number=True) == ("-0.75", "last number")
    assert extract("1,00", None) == ("1,00", "first line")  # no thousands: not a number, compared as text
    assert extract("Paris.\nmore", None) == ("Paris", "first line")


@pytest.mark.skipif(not GSM8K_TEST.exists(), reason="the GSM8K test split is not in shared/data")
def test_gsm8k_references_read_their_final_number():
    """Every reference of the real GSM8K test split reads, under the shipped pattern, the integer after ####."""
    answers = [json.loads(line)["answer"] for line in GSM8K_TEST.read_text().splitlines()]
    read = [extract_answer(a, GSM8K) for a in answers]
    assert read == [str(int(a.split("####")[-1].strip().replace(",", ""))) for a in answers]
