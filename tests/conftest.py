import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(params=["llama", "qwen3"])
def family(request):
    return request.param


@pytest.fixture
def tiny_llama():
    from retrofit.testing import tiny_base

    return tiny_base("llama")


@pytest.fixture
def char_tok():
    from retrofit.testing import char_tokenizer

    return char_tokenizer()
