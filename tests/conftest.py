"""Shared fixtures: tiny random Llama targets written as real HF checkpoints, and the demo model."""

from __future__ import annotations

import pytest
import torch

from spechead.model.loading import load_target


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``): tiny shapes gain
    nothing from a second thread, and where a server process shares the CPU with the test, one thread each
    avoids oversubscription, which on a busy 2-core machine costs 5x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _no_tuning(monkeypatch):
    """`--tree auto` falls back to the default tree in tests (tests/test_tune.py tests the tuner itself): a
    first tune measures for about a minute per machine + target + drafter + head."""
    monkeypatch.setenv("SPECHEAD_TUNE", "off")


def write_tiny_llama(path, vocab: int = 64, layers: int = 8, hidden: int = 32, seed: int = 0, std: float = 0.2):
    """Save a random LlamaForCausalLM (transformers' own class) so loading is tested end to end."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=std,
        eos_token_id=1,
        bos_token_id=0,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_small_vocab_dir(tmp_path_factory):
    """V=16, 2 layers: drafts get accepted often enough to exercise multi-token paths and sampling."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny16"), vocab=16, layers=2, std=0.5, seed=1)


@pytest.fixture
def tiny_target(tiny_dir):
    return load_target(str(tiny_dir))[0]


@pytest.fixture(scope="session")
def demo_session():
    """The real demo target (SmolLM2-135M-Instruct); converted once and cached."""
    from spechead.decoding.session import Session

    return Session.open("demo", max_len=2048)
