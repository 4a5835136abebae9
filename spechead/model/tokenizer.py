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


class TokenizerFile:
    """A tokenizer folder that ``tokenizer.json`` describes whole, through the ``tokenizers`` library itself: what
    transformers' tokenizers backend saves (``"backend": "tokenizers"`` in ``tokenizer_config.json``: its Rust
    pipeline, special tokens and post-processor included). Special tokens come from ``tokenizer_config.json``, the
    chat template from ``chat_template.jinja`` (or the config), rendered by Jinja in the sandbox and with the
    options transformers renders it with. It loads in ~0.1 s and ~35 MB, where importing transformers takes ~1 s
    and ~70 MB (AMD EPYC Zen 3); tests hold its ids, texts and prompts to transformers' on the packaged targets.
    The interface is the part of transformers' tokenizer spechead calls."""

    SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token")

    def __init__(self, folder: Path, config: dict) -> None:
        from tokenizers import Tokenizer

        self.backend_tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.name_or_path = str(folder)
        self.special = {k: t for k in self.SPECIAL if (t := _token_text(config.get(k)))}
        template_file = folder / "chat_template.jinja"
        self.chat_template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        self._template = _compile_template(self.chat_template) if self.chat_template else None

    @classmethod
    def load(cls, folder: Path) -> TokenizerFile | None:
        """The folder's tokenizer, or None where transformers should load it: another backend, custom code, a
        WordPiece clean-up, several named templates, or a template using a transformers-only tag."""
        try:
            config = json.loads((folder / "tokenizer_config.json").read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(config, dict) or config.get("backend") != "tokenizers" or "auto_map" in config:
            return None
        if config.get("clean_up_tokenization_spaces") or not (folder / "tokenizer.json").is_file():
            return None
        if not isinstance(config.get("chat_template", ""), str):
            return None
        try:
            return cls(folder, config)
        except Exception:  # a template Jinja cannot compile here, a file the library cannot read: transformers says
            return None

    def _id(self, key: str) -> int | None:
        token = self.special.get(key)
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    bos_token_id = property(lambda self: self._id("bos_token"))
    eos_token_id = property(lambda self: self._id("eos_token"))
    pad_token_id = property(lambda self: self._id("pad_token"))
    unk_token_id = property(lambda self: self._id("unk_token"))

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def __call__(self, text: str | list[str], add_special_tokens: bool = True, return_offsets_mapping: bool = False):
        """``input_ids`` of a text (a list of them for a list of texts) and, if asked, each token's character span
        ``offset_mapping``."""
        one = isinstance(text, str)
        encs = self.backend_tokenizer.encode_batch([text] if one else text, add_special_tokens=add_special_tokens)
        out = {"input_ids": [e.ids for e in encs]}
        if return_offsets_mapping:
            out["offset_mapping"] = [e.offsets for e in encs]
        return {k: v[0] for k, v in out.items()} if one else out

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        ids = [ids] if isinstance(ids, int) else list(ids)
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, conversation: list[dict[str, str]], add_generation_prompt: bool = False, tokenize: bool = True, **kwargs
    ) -> str | list[int]:
        if self._template is None:
            raise SpecheadError("the tokenizer has no chat template")
        text = self._template.render(
            messages=conversation, add_generation_prompt=add_generation_prompt, **self.special, **kwargs
        )
        return self(text, add_special_tokens=False)["input_ids"] if tokenize else text


def _token_text(value) -> str | None:
    """A special token as the config gives it: a string, or an AddedToken's dict."""
    return value.get("content") if isinstance(value, dict) else value


def _compile_template(source: str):
    """A chat template in Jinja's sandbox with transformers' options: blocks trimmed, loop controls, ``tojson``
    without HTML escaping, ``raise_exception`` and ``strftime_now``."""
    from datetime import datetime

    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def load_tokenizer(spec: str | Path):
    """The one tokenizer loader: ``demo``, a tokenizer / model folder or a bare ``tokenizer.json`` file (a fast
    tokenizer over it; ``.backend_tokenizer`` is the file's own ``tokenizers.Tokenizer``, unchanged). A folder
    ``tokenizer.json`` describes whole (spechead's conversions among them) loads as a ``TokenizerFile``; any other
    through transformers' AutoTokenizer (its chat template and special tokens)."""
    folder = _folder(spec)
    if folder is None:
        from transformers import PreTrainedTokenizerFast

        try:
            return PreTrainedTokenizerFast(tokenizer_file=str(spec))
        except Exception as e:  # the Rust library raises a plain Exception on a bad file
            raise SpecheadError(f"cannot load tokenizer file {spec}: {e}") from e
    light = TokenizerFile.load(folder)
    if light is not None:
        return light
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
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
