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


@pytest.fixture(scope="module")
def tok():
    """The character tokenizer, one per module."""
    from retrofit.testing import char_tokenizer

    return char_tokenizer()


# Tiny models gain nothing from threads, and two threads contend badly on a loaded 2-core machine. A module
# asks for one thread with ``pytestmark = pytest.mark.usefixtures("one_thread")`` (each test) or
# ``"one_thread_per_module"`` (the whole module, so its module-scoped fixtures run on one thread too).
@pytest.fixture
def one_thread():
    """torch on one thread during the test; the previous count restored after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def one_thread_per_module():
    """torch on one thread from the module's first test (its module-scoped fixtures included) to its end."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
