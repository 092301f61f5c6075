import pytest

from model import load_model, load_tokenizer


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-k3")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny-k3")
