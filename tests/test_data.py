"""Training data: chat templating with assistant-only loss masks, raw text, gen-data, bad input."""

from __future__ import annotations

import json

import pytest
from conftest import write_tiny_llama

from spechead.errors import SpecheadError
from spechead.model.tokenizer import load_tokenizer
from spechead.training.data import encode_chat_example, encode_record, generate_data, load_examples, read_jsonl

CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 \n.,?!:'-+=")
TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_chat_tokenizer(folder, vocab_size: int = 64, template: bool = True):
    """A character-level fast tokenizer with a ChatML template, sized for the tiny test models."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<s>", "<|im_end|>", "<|im_start|>", "<unk>"])}
    for c in CHARS[: vocab_size - len(vocab)]:
        vocab[c] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        bos_token="<s>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
    )
    if template:
        fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)
    return folder


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    folder = write_tiny_llama(tmp_path_factory.mktemp("chat_tiny"))
    return write_chat_tokenizer(folder)


def test_loss_mask_covers_exactly_the_assistant_turns(chat_target):
    tok = load_tokenizer(chat_target)
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "yes ok"},
        {"role": "user", "content": "and then"},
        {"role": "assistant", "content": "no more"},
    ]
    ids, mask = encode_chat_example(tok, msgs)
    assert tok.decode(ids) == tok.decode(tok(tok.apply_chat_template(msgs, tokenize=False))["input_ids"])
    # Contiguous masked runs, each one assistant reply followed by its terminator.
    runs, cur = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    texts = [tok.decode(r).replace(" ", "") for r in runs]  # the char tokenizer decodes with spaces
    assert texts == ["yesok<|im_end|>\n", "nomore<|im_end|>\n"]
    user_tokens = [i for i, m in zip(ids, mask, strict=True) if not m]
    assert "hithere" in tok.decode(user_tokens).replace(" ", "")


def test_raw_text_trains_on_every_token_but_the_first(chat_target, tmp_path):
    tok = load_tokenizer(chat_target)
    f = write_jsonl(tmp_path / "t.jsonl", [{"text": "abc def ghi jkl"}])
    (ex,) = load_examples(tok, [f], max_len=64)
    assert ex.mask[0] is False and all(ex.mask[1:])
    assert len(ex.ids) == len("abc def ghi jkl") + 1  # bos + one token per character


def test_long_text_is_windowed_and_chat_truncated(chat_target, tmp_path):
    tok = load_tokenizer(chat_target)
    f = write_jsonl(tmp_path / "t.jsonl", [{"text": "a" * 100}])
    exs = load_examples(tok, [f], max_len=32)
    assert sorted(len(e.ids) for e in exs) == [32, 32, 32]  # the 5-token tail has too few targets


def test_bad_data_gives_clear_errors(chat_target, tmp_path):
    tok = load_tokenizer(chat_target)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(SpecheadError, match="no records"):
        list(read_jsonl(empty))
    no_reply = write_jsonl(tmp_path / "q.jsonl", [{"messages": [{"role": "user", "content": "hello"}]}])
    with pytest.raises(SpecheadError, match="no record has an assistant turn"):
        load_examples(tok, [no_reply])
    with pytest.raises(SpecheadError, match="no assistant turn"):
        encode_chat_example(tok, [{"role": "user", "content": "hello"}])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [\n')
    with pytest.raises(SpecheadError, match="invalid JSON"):
        list(read_jsonl(bad))
    with pytest.raises(SpecheadError, match="not found"):
        list(read_jsonl(tmp_path / "missing.jsonl"))
    plain = write_chat_tokenizer(tmp_path / "plain", template=False)
    chat = write_jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "assistant", "content": "x"}]}])
    with pytest.raises(SpecheadError, match="no chat template"):
        load_examples(load_tokenizer(plain), [chat])


def test_gen_data_is_batched_and_resumable(chat_target, tmp_path):
    turns = [[{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": "x"}] for i in range(5)]
    recs = [{"source": "s", "messages": t} for t in turns] + [{"text": "raw text has no prompt"}]
    src = write_jsonl(tmp_path / "p.jsonl", recs)
    out = tmp_path / "gen.jsonl"
    assert generate_data(str(chat_target), [src], out, batch_size=2, max_new_tokens=4, stop_after=3) == 3
    first = out.read_text().splitlines()
    assert generate_data(str(chat_target), [src], out, batch_size=2, max_new_tokens=4) == 2  # resumes after 3
    lines = out.read_text().splitlines()
    assert len(lines) == 5 and lines[:3] == first
    got = [json.loads(x) for x in lines]
    assert sorted(r["messages"][0]["content"] for r in got) == [f"question {i}" for i in range(5)]
    assert all(r["messages"][-1]["role"] == "assistant" and r["source"] == "gen:s" for r in got)
    assert generate_data(str(chat_target), [src], out, batch_size=2, max_new_tokens=4) == 0
    manifest = json.loads((tmp_path / "gen.jsonl.manifest.json").read_text())
    assert manifest["records"] == 5 and manifest["settings"]["prompts"] == 5 and manifest["new_tokens"] > 0
    with pytest.raises(SpecheadError, match="other settings"):  # a resumed run must not mix settings
        generate_data(str(chat_target), [src], out, batch_size=2, max_new_tokens=8)


def test_gen_data_on_the_batched_engine_writes_the_targets_own_greedy_replies(chat_target, tmp_path):
    """Continuous batching (3 lanes, 7 prompts of different lengths, each later one joining as a lane frees): each
    greedy reply is the target's batch-1 AR decoding of its prompt, token for token, in the prompts' order; the
    transformers engine writes the same records."""
    from spechead.decoding.session import Session

    turns = [[{"role": "user", "content": "q" * (1 + 3 * i) + f" {i}?"}] for i in range(7)]
    src = write_jsonl(tmp_path / "p.jsonl", [{"source": "s", "messages": t} for t in turns])
    out = tmp_path / "gen.jsonl"
    assert generate_data(str(chat_target), [src], out, batch_size=3, max_new_tokens=12, engine="spechead") == 7
    got = [json.loads(x) for x in out.read_text().splitlines()]
    session = Session.open(str(chat_target), max_len=128)
    decoder = session.decoder()
    for rec in got:
        ids = session.encode(rec["messages"][:1])
        res = decoder.generate(ids, 12, speculative=False)
        tokens = res.tokens[:-1] if res.stop_reason == "stop_token" else res.tokens
        assert rec["messages"][1]["content"] == session.decode(tokens)
    assert json.loads((tmp_path / "gen.jsonl.manifest.json").read_text())["settings"]["engine"] == "spechead"
    hf = tmp_path / "hf.jsonl"
    assert generate_data(str(chat_target), [src], hf, batch_size=3, max_new_tokens=12, engine="transformers") == 7
    assert [json.loads(x) for x in hf.read_text().splitlines()] == got  # fp32, no near-ties on this tiny model
    with pytest.raises(SpecheadError, match="engine"):
        generate_data(str(chat_target), [src], tmp_path / "x.jsonl", engine="vllm")


def test_sampled_gen_data_resumes_with_the_draws_it_would_have_made(chat_target, tmp_path):
    """Each prompt's sampling stream is seeded by its place in the order: stopping after 2 prompts and resuming
    writes what one uninterrupted run writes."""
    turns = [[{"role": "user", "content": f"tell {i}"}] for i in range(5)]
    src = write_jsonl(tmp_path / "p.jsonl", [{"source": "s", "messages": t} for t in turns])
    kw = {"batch_size": 2, "max_new_tokens": 10, "temperature": 1.0, "seed": 7}
    whole, parts = tmp_path / "whole.jsonl", tmp_path / "parts.jsonl"
    assert generate_data(str(chat_target), [src], whole, **kw) == 5
    assert generate_data(str(chat_target), [src], parts, stop_after=2, **kw) == 2
    assert generate_data(str(chat_target), [src], parts, **kw) == 3
    assert parts.read_text() == whole.read_text()
    replies = {json.loads(x)["messages"][1]["content"] for x in whole.read_text().splitlines()}
    assert len(replies) > 1  # sampled, not one fixed reply


def test_a_base_model_is_prompted_and_distilled_in_the_completion_format(tmp_path):
    """No chat template: turns are plain text a blank line apart; gen-data writes {prompt, completion} records
    whose completion (only) is trained on."""
    from spechead.model.tokenizer import completion_text, encode_text, encode_turns

    folder = write_chat_tokenizer(write_tiny_llama(tmp_path / "base"), template=False)
    tok = load_tokenizer(folder)
    turns = [
        {"role": "user", "content": "ab c"},
        {"role": "assistant", "content": "de"},
        {"role": "user", "content": "f"},
    ]
    assert completion_text(turns) == "ab c\n\nde\n\nf"
    assert encode_turns(tok, turns[:1]) == encode_text(tok, "ab c") == tok("ab c")["input_ids"]
    src = write_jsonl(tmp_path / "p.jsonl", [{"source": "s", "messages": [turns[0], turns[1]]}])
    out = tmp_path / "gen.jsonl"
    assert generate_data(str(folder), [src], out, batch_size=1, max_new_tokens=4) == 1
    rec = json.loads(out.read_text())
    assert rec["prompt"] == "ab c" and isinstance(rec["completion"], str) and "messages" not in rec
    assert "stop" in rec  # the stop token it ended on, or None when the budget ended it
    rec["completion"], rec["stop"] = "dee", None  # whatever the tiny model wrote: its tokens are the targets
    ex = encode_record(tok, rec)
    head = encode_text(tok, "ab c")
    assert ex.ids[: len(head)] == head and len(ex.ids) == len(head) + 3
    assert ex.mask == [False] * len(head) + [True] * 3
    ended = encode_record(tok, {**rec, "stop": tok.eos_token_id})  # an ending is a target too
    assert ended.ids == ex.ids + [tok.eos_token_id] and ended.mask == ex.mask + [True]
    with pytest.raises(SpecheadError, match="'prompt' must be"):
        encode_record(tok, {"prompt": " ", "completion": "x"})
    [loaded] = load_examples(tok, [write_jsonl(tmp_path / "g.jsonl", [rec])], min_targets=1)  # what extract reads
    assert loaded.ids == ex.ids and loaded.mask == ex.mask
