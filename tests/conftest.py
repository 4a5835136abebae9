"""Shared fixtures: tiny random Llama targets written as real HF checkpoints, and the demo model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from spechead.bench.suites import EVAL_DIR_ENV
from spechead.model.loading import load_target

# The named suites the tests read: a small hand-written set in Spec-Bench's and HumanEval's format (every
# Spec-Bench category), so that tests never depend on the data sets next to the checkout. Set here, before any
# test runs, so that the CLI's default and any subprocess see it too.
os.environ[EVAL_DIR_ENV] = str(Path(__file__).parent / "data" / "eval")


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


def write_tiny_gemma3(
    path, vocab: int = 64, layers: int = 6, hidden: int = 32, window: int = 8, seed: int = 0, std: float = 0.2
):
    """Save a random Gemma3ForCausalLM (transformers' own class): five sliding-window layers per global one
    with a window shorter than the test sequences, q/k norms, a query scale that is not head_dim ** -0.5,
    different RoPE bases per layer type and norm weights away from zero (so 1 + w is tested)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=window,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=std,
        eos_token_id=1,
        bos_token_id=2,
        pad_token_id=0,
    )
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.endswith("norm.weight"):
                t.uniform_(-0.5, 0.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory):
    return write_tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3"))


@pytest.fixture(scope="session")
def tiny_gemma3_small_vocab_dir(tmp_path_factory):
    """V=16, a 4-token window: trees cross the window's edge every round and drafts get accepted."""
    return write_tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3_16"), vocab=16, window=4, std=0.5, seed=1)


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
