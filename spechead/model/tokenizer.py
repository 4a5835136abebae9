"""The one tokenizer loader, chat encoding and the one list of end-of-turn tokens."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from spechead.errors import SpecheadError
from spechead.model.config import ModelConfig


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as e:
        raise SpecheadError(f"cannot load tokenizer from {folder}: {e}") from e


@dataclass
class ChatPrompt:
    ids: list[int]
    text: str


def encode_chat(tokenizer, turns: list[dict[str, str]]) -> list[int]:
    """Apply the tokenizer's chat template with a generation prompt and return token ids."""
    if not getattr(tokenizer, "chat_template", None):
        raise SpecheadError("the target's tokenizer has no chat template; pass --raw to use plain text")
    text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stop_token_ids(tokenizer, cfg: ModelConfig) -> list[int]:
    """The tokenizer's end tokens: eos, plus chat-turn terminators such as <|im_end|> and <|eot_id|>."""
    ids = set()
    eos = cfg.extra.get("eos_token_id")
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    for name in ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>"):
        if name in vocab:
            ids.add(vocab[name])
    return sorted(ids)


END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "<|eom_id|>", "</s>")


# -- corpora -----------------------------------------------------------------------------------
def load_any_tokenizer(spec: str):
    """``demo`` (the demo target's tokenizer), a tokenizer/model folder or a ``tokenizer.json`` file,
    with the vocabulary size of its model (config.json) when known, else the tokenizer's length."""
    from spechead.model.loading import resolve_target
    from spechead.model.tokenizer import load_tokenizer

    if spec == "demo":
        folder = resolve_target("demo")
        tok = load_tokenizer(folder)
    else:
        path = Path(spec)
        if path.is_dir():
            folder, tok = path, load_tokenizer(path)
        elif path.is_file():
            from transformers import PreTrainedTokenizerFast

            try:
                folder, tok = None, PreTrainedTokenizerFast(tokenizer_file=str(path))
            except Exception as e:
                raise SpecheadError(f"cannot load tokenizer file {path}: {e}") from e
        else:
            raise SpecheadError(f"tokenizer not found: {spec} (expected demo, a folder or a tokenizer.json)")
    vocab_size = len(tok)
    if folder is not None and (folder / "config.json").is_file():
        try:
            vocab_size = max(vocab_size, int(json.loads((folder / "config.json").read_text())["vocab_size"]))
        except (KeyError, ValueError, json.JSONDecodeError):
            pass
    return tok, vocab_size


def end_token_ids(tok) -> list[int]:
    vocab = tok.get_vocab()
    ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
    return list(dict.fromkeys(ids + [vocab[t] for t in END_TOKENS if t in vocab]))
