"""The one tokenizer loader, chat encoding and the one list of end-of-turn tokens."""

from __future__ import annotations

import json
from pathlib import Path

from spechead.errors import SpecheadError
from spechead.model.config import ModelConfig


def _folder(spec: str | Path) -> Path | None:
    """The tokenizer / model folder a spec names: a packaged target's (``demo``, ``gemma3-270m``) or a folder;
    None for a file."""
    from spechead.model.loading import PACKAGED_TARGETS, resolve_target

    if isinstance(spec, str) and spec in PACKAGED_TARGETS:
        return resolve_target(spec)
    path = Path(spec)
    if path.is_dir():
        return path
    if path.is_file():
        return None
    raise SpecheadError(f"tokenizer not found: {spec} (expected demo, gemma3-270m, a folder or a tokenizer.json)")


GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def _tokenizer_class(folder: Path) -> str | None:
    try:
        return json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None


def load_tokenizer(spec: str | Path):
    """The one tokenizer loader: ``demo``, a tokenizer / model folder (AutoTokenizer: its chat template and
    special tokens) or a bare ``tokenizer.json`` file (a fast tokenizer over it; ``.backend_tokenizer`` is
    the file's own ``tokenizers.Tokenizer``, unchanged)."""
    folder = _folder(spec)
    if folder is None:
        from transformers import PreTrainedTokenizerFast

        try:
            return PreTrainedTokenizerFast(tokenizer_file=str(spec))
        except Exception as e:  # the Rust library raises a plain Exception on a bad file
            raise SpecheadError(f"cannot load tokenizer file {spec}: {e}") from e
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    # a folder whose class is the generic fast tokenizer (spechead's GGUF conversions) loads as that class
    # directly: AutoTokenizer would first resolve the model's config class, importing ~1 s of transformers
    generic = _tokenizer_class(folder) in GENERIC_CLASSES and (folder / "tokenizer.json").is_file()
    try:
        return (PreTrainedTokenizerFast if generic else AutoTokenizer).from_pretrained(folder)
    except Exception as e:
        raise SpecheadError(f"cannot load tokenizer from {folder}: {e}") from e


def model_vocab_size(tok, spec: str | Path) -> int:
    """The vocabulary size of the model a tokenizer belongs to (its folder's config.json, which may pad the
    embedding past the tokenizer), else the tokenizer's length."""
    vocab_size = len(tok)
    folder = _folder(spec)
    if folder is not None and (folder / "config.json").is_file():
        try:
            vocab_size = max(vocab_size, int(json.loads((folder / "config.json").read_text())["vocab_size"]))
        except (KeyError, ValueError, json.JSONDecodeError):
            pass
    return vocab_size


def encode_chat(tokenizer, turns: list[dict[str, str]]) -> list[int]:
    """Apply the tokenizer's chat template with a generation prompt and return token ids."""
    if not getattr(tokenizer, "chat_template", None):
        raise SpecheadError("the target's tokenizer has no chat template; pass --raw to use plain text")
    text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# A base model has no chat template: its prompt is plain text it continues. The completion format writes a
# conversation's turns as they are, one blank line apart, nothing added after the last: a one-turn prompt (a
# HumanEval function head, a Spec-Bench question) is exactly its own text; a second turn follows the reply.
COMPLETION_SEPARATOR = "\n\n"


def completion_text(turns: list[dict[str, str]]) -> str:
    return COMPLETION_SEPARATOR.join(m["content"] for m in turns)


def encode_text(tokenizer, text: str) -> list[int]:
    """Plain text as the model reads it: the text's tokens with the tokenizer's own special tokens (Gemma's
    adds ``<bos>``; SmolLM2's adds none, though it names ``<|im_start|>`` its BOS)."""
    return list(tokenizer(text)["input_ids"])


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_turns(tokenizer, turns: list[dict[str, str]]) -> list[int]:
    """A conversation as a prompt: the chat template where the tokenizer has one, else the completion format."""
    if has_chat_template(tokenizer):
        return encode_chat(tokenizer, turns)
    return encode_text(tokenizer, completion_text(turns))


# The tokens that end a turn: generation stops on them, and a draft vocabulary always holds them (one that
# cannot propose the end costs a whole round at the end of every reply).
END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "<|eom_id|>", "</s>", "<end_of_turn>")


def end_token_ids(tok) -> list[int]:
    """The tokenizer's end tokens, eos first, then ``END_TOKENS`` in their order (those it has)."""
    vocab = tok.get_vocab()
    ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
    return list(dict.fromkeys(ids + [vocab[t] for t in END_TOKENS if t in vocab]))


def stop_token_ids(tokenizer, cfg: ModelConfig) -> list[int]:
    """The ids generation stops on, sorted: the model config's eos ids plus the tokenizer's end tokens."""
    eos = cfg.extra.get("eos_token_id")
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return sorted(ids | set(end_token_ids(tokenizer)))
