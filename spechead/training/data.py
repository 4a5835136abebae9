"""Training data for drafters: read chat / raw-text JSONL, tokenize with loss masks, regenerate replies.

A drafter only ever has to predict what the *target* says, so the loss is restricted to assistant
tokens (chat records) and every token after the first (raw text). ``gen-data`` lets the target
rewrite the assistant turns of a prompt set: a drafter trained on the target's own replies is
accepted more often (the SlimSpec / VocabTrim / EAGLE recipes do the same).
"""

from __future__ import annotations

import gzip
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spechead.errors import SpecheadError
from spechead.model.tokenizer import completion_text, encode_text, encode_turns, has_chat_template


@dataclass
class Example:
    ids: list[int]
    mask: list[bool]  # True where the token is a training target (assistant / text tokens)
    source: str = ""


def _open(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else path.open(encoding="utf-8")


def read_jsonl(
    path: str | Path, keys: tuple[str, ...] | None = ("messages", "completion", "text")
) -> Iterator[dict[str, Any]]:
    """Records of a .jsonl or .jsonl.gz file; invalid lines are user errors. With ``keys`` each record
    needs one of them and an empty file is an error; ``keys=None`` accepts any object (and no records)."""
    path = Path(path)
    if not path.is_file():
        raise SpecheadError(f"data file not found: {path}")
    n = 0
    try:
        with _open(path) as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SpecheadError(f"{path}:{i}: invalid JSON ({e.msg})") from e
                if not isinstance(rec, dict):
                    raise SpecheadError(f"{path}:{i}: expected a JSON object")
                if keys and not any(k in rec for k in keys):
                    raise SpecheadError(f"{path}:{i}: expected an object with {' or '.join(map(repr, keys))}")
                n += 1
                yield rec
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise SpecheadError(f"cannot read {path}: {e}") from e
    if n == 0 and keys:
        raise SpecheadError(f"data file {path} has no records")


def _check_messages(msgs: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(msgs, list) or not msgs:
        raise SpecheadError(f"{where}: 'messages' must be a non-empty list")
    for m in msgs:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise SpecheadError(f"{where}: every message needs string 'role' and 'content'")
    return msgs


def _render(tokenizer, msgs: list[dict[str, str]], gen: bool) -> str:
    return tokenizer.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False)


def require_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise SpecheadError("the target's tokenizer has no chat template, so chat records cannot be encoded")


def encode_chat_example(tokenizer, msgs: list[dict[str, str]], where: str = "record") -> tuple[list[int], list[bool]]:
    """Token ids of the templated conversation and a mask that is True on assistant-turn tokens.

    Assistant spans are found on the rendered text: the span of turn i runs from the end of the
    template rendered up to turn i with a generation prompt to the end of the template rendered
    through turn i (so it includes the turn terminator, which the drafter must learn to predict).
    Tokens are assigned to a span by their character offsets.
    """
    require_chat_template(tokenizer)
    msgs = _check_messages(msgs, where)
    if not any(m["role"] == "assistant" for m in msgs):
        raise SpecheadError(f"{where} has no assistant turn to train on")
    full = _render(tokenizer, msgs, gen=False)
    spans = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        lo, hi = len(_render(tokenizer, msgs[:i], gen=True)) if i else 0, len(_render(tokenizer, msgs[: i + 1], False))
        if not full.startswith(_render(tokenizer, msgs[: i + 1], False)):
            raise SpecheadError("the chat template does not render conversations incrementally; cannot mask turns")
        spans.append((lo, hi))
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    mask = [any(lo <= s < hi for lo, hi in spans) for s, _ in offsets]
    return list(ids), mask


def encode_record(tokenizer, rec: dict[str, Any], where: str = "record") -> Example:
    """A record as training ids and targets: ``messages`` (chat: the assistant turns are targets),
    ``prompt`` + ``completion`` (a base model's continuation, as ``gen-data`` writes it: the completion and
    the ``stop`` token it ended on, if any, are the targets) or ``text`` (every token after the first)."""
    if "messages" in rec:
        ids, mask = encode_chat_example(tokenizer, rec["messages"], where)
    elif "completion" in rec:
        prompt, completion = rec.get("prompt"), rec["completion"]
        if not isinstance(prompt, str) or not prompt.strip() or not isinstance(completion, str):
            raise SpecheadError(f"{where}: 'prompt' must be a non-empty string and 'completion' a string")
        head = encode_text(tokenizer, prompt)
        tail = list(tokenizer(completion, add_special_tokens=False)["input_ids"])
        if isinstance(rec.get("stop"), int):
            tail.append(rec["stop"])
        ids, mask = head + tail, [False] * len(head) + [True] * len(tail)
    else:
        text = rec.get("text")
        if not isinstance(text, str) or not text.strip():
            raise SpecheadError(f"{where}: 'text' must be a non-empty string")
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if tokenizer.bos_token_id is not None:
            ids = [tokenizer.bos_token_id] + ids
        mask = [False] + [True] * (len(ids) - 1)
    return Example(list(ids), mask, str(rec.get("source", "")))


def parse_data_spec(spec: str) -> tuple[Path, int | None]:
    """``FILE`` or ``FILE:N`` (the first N records after a seeded shuffle)."""
    head, sep, tail = spec.rpartition(":")
    if sep and tail.isdigit() and int(tail) >= 1:
        return Path(head), int(tail)
    if sep and Path(head).is_file() and not Path(spec).exists():
        raise SpecheadError(f"{spec}: N in FILE:N must be a positive integer, got {tail!r}")
    return Path(spec), None


def load_examples(
    tokenizer, specs: list[str], max_len: int = 1024, seed: int = 0, min_targets: int = 4
) -> list[Example]:
    """Tokenize every file (``FILE[:N]``), truncate to ``max_len``, drop examples with too few targets.

    Raw-text records longer than ``max_len`` are split into several windows. The result is
    shuffled with ``seed`` so that chunks and the held-out split are representative.
    """
    if not specs:
        raise SpecheadError("no data files given")
    rng = random.Random(seed)
    out: list[Example] = []
    for spec in specs:
        path, limit = parse_data_spec(spec)
        recs = list(read_jsonl(path))
        if limit is not None:
            rng.shuffle(recs)
            recs = recs[:limit]
        skipped = 0
        for i, rec in enumerate(recs):
            if "messages" in rec and not any(
                isinstance(m, dict) and m.get("role") == "assistant" for m in rec["messages"] or []
            ):
                skipped += 1  # a stray prompt-only record is skipped; a file of them is an error below
                continue
            ex = encode_record(tokenizer, rec, f"{path} record {i + 1}")
            pieces = [ex] if "messages" in rec else _windows(ex, max_len)
            for p in pieces:
                p.ids, p.mask = p.ids[:max_len], p.mask[:max_len]
                if sum(p.mask[2:]) >= min_targets:
                    out.append(p)
        if skipped == len(recs):
            raise SpecheadError(f"{path}: no record has an assistant turn to train on")
    if not out:
        raise SpecheadError("no usable training examples (every record was too short or had no target tokens)")
    rng.shuffle(out)
    return out


def _windows(ex: Example, max_len: int) -> list[Example]:
    step = max(max_len, 16)
    return [Example(ex.ids[i : i + step], ex.mask[i : i + step], ex.source) for i in range(0, len(ex.ids), step)]


# -- gen-data: the target rewrites the assistant turns ------------------------------------------------
def prompt_of(rec: dict[str, Any], where: str) -> list[dict[str, str]] | None:
    """The turns before the first assistant reply (None for raw-text records, which have no prompt)."""
    if "messages" not in rec:
        return None
    msgs = _check_messages(rec["messages"], where)
    first = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs))
    turns = msgs[:first]
    return turns if turns and turns[-1]["role"] == "user" else None


def count_lines(path: Path) -> int:
    if not path.is_file():
        return 0
    with path.open(encoding="utf-8") as f:
        return sum(1 for line in f if line.strip())


GEN_ENGINES = ("spechead", "transformers")


def generate_data(
    target: str,
    specs: list[str],
    out: Path,
    batch_size: int = 16,
    max_new_tokens: int = 256,
    max_prompt_tokens: int = 512,
    temperature: float = 0.0,
    seed: int = 0,
    threads: int | None = None,
    stop_after: int | None = None,
    dtype: str = "float32",
    engine: str = "spechead",
    device: str = "cpu",
) -> int:
    """Regenerate the first assistant turn of every prompt with the target, appending to ``out``.

    A base model (no chat template) continues the prompt in the completion format
    (``model.tokenizer.completion_text``) and its records are ``{"prompt", "completion"}``.

    ``engine="spechead"``: spechead's batched decoder (``decoding.decoder``, continuous batching:
    ``batch_size`` requests in flight, a finished one's lane taken by the next prompt at once), so a
    greedy reply is exactly what the target says at inference, token for token, in the precision it
    runs in; sampled replies draw from per-prompt seeded streams. ``engine="transformers"``:
    transformers' static batches (left-padded; prompts of similar length share a batch). Resumable:
    the prompt order is fixed by ``seed`` and the settings, and the lines already in ``out`` are
    skipped (``stop_after`` ends this call early, e.g. to fit a time slot). ``dtype="bfloat16"``
    generates faster where the CPU has bf16 matrix units; the text is then the bf16 target's (the
    drafter's labels still come from the fp32 target at ``extract`` time). ``<out>.manifest.json``
    records what was generated with which target, engine and settings. Returns the number of
    records written.
    """
    import torch
    from tqdm import tqdm

    from spechead.model.loading import read_config, resolve_target
    from spechead.model.tokenizer import load_tokenizer, stop_token_ids

    _check_gen_options(engine, dtype, device, batch_size, max_new_tokens, max_prompt_tokens, temperature)
    if threads:
        torch.set_num_threads(threads)
    folder = resolve_target(target)
    tok = load_tokenizer(folder)
    chat = has_chat_template(tok)
    prompts = _select_prompts(tok, specs, max_prompt_tokens, seed, batch_size)
    manifest_path = out.with_name(out.name + ".manifest.json")
    settings = {
        "target": target,
        "target_folder": str(folder),
        "data": list(specs),
        "max_new_tokens": max_new_tokens,
        "max_prompt_tokens": max_prompt_tokens,
        "temperature": temperature,
        "seed": seed,
        "batch_size": batch_size,
        "dtype": dtype,
        "engine": engine,
        "prompts": len(prompts),
        **({"device": device} if device != "cpu" else {}),  # the CPU is the default: its manifests name no device
    }
    manifest = _open_manifest(manifest_path, settings, out)
    done = count_lines(out)
    todo = prompts[done:][:stop_after]
    if not todo:
        return 0
    stops = stop_token_ids(tok, read_config(folder))
    ids = [p[2] for p in todo]
    if engine == "spechead":
        replies = _engine_replies(target, dtype, ids, batch_size, max_new_tokens, temperature, seed, done, stops)
    else:
        replies = _transformers_replies(
            folder, dtype, ids, batch_size, max_new_tokens, temperature, seed, stops, device
        )
    bar = tqdm(total=len(prompts), initial=done, desc=f"gen-data ({engine})", unit="prompt", dynamic_ncols=True)
    try:
        return _write_records(out, manifest_path, manifest, todo, replies, tok, chat, done, batch_size, bar)
    finally:
        bar.close()


def _check_gen_options(engine, dtype, device, batch_size, max_new_tokens, max_prompt_tokens, temperature) -> None:
    """Refuse ``generate_data`` settings no run can use, before anything loads."""
    if engine not in GEN_ENGINES:
        raise SpecheadError(f"--engine must be one of {', '.join(GEN_ENGINES)}, not {engine!r}")
    if dtype not in ("float32", "bfloat16"):
        raise SpecheadError(f"--dtype must be float32 or bfloat16, not {dtype!r}")
    if device != "cpu" and engine != "transformers":
        raise SpecheadError(
            "--device other than cpu needs --engine transformers (spechead's decoder is tuned for CPUs)"
        )
    if batch_size < 1 or max_new_tokens < 1 or max_prompt_tokens < 1:
        raise SpecheadError("--batch-size, --max-new-tokens and --max-prompt-tokens must be >= 1")
    if not temperature >= 0:  # (NaN too)
        raise SpecheadError(f"--temperature must be >= 0, got {temperature}")


def _open_manifest(manifest_path: Path, settings: dict[str, Any], out: Path) -> dict[str, Any]:
    """The manifest of the records in ``out``: the existing one when its settings are these (resuming), a new one
    when there is none; other settings are refused (the records would mix two datasets)."""
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else None
    if manifest is not None and manifest.get("settings", {}).get("engine") is None:
        manifest["settings"]["engine"] = "transformers"  # a manifest that names no engine is a transformers one
    if manifest is not None and manifest.get("settings") != settings:
        raise SpecheadError(f"{out} was generated with other settings ({manifest_path}); use a new --out")
    return manifest or {"settings": settings, "records": 0, "new_tokens": 0, "generate_s": 0.0}


def _write_records(out, manifest_path, manifest, todo, replies, tok, chat, done, batch_size, bar) -> int:
    """Append one record per reply to ``out`` (chat messages, or prompt + completion + stop token for a base
    model), flushing it and rewriting the manifest every ``batch_size`` records; returns the records written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    written = 0
    t0 = time.perf_counter()
    with out.open("a", encoding="utf-8") as f:
        for (source, turns, _), (reply_ids, stop) in zip(todo, replies, strict=True):
            reply = tok.decode(reply_ids, skip_special_tokens=True)
            if chat:
                rec = {"source": f"gen:{source}", "messages": turns + [{"role": "assistant", "content": reply}]}
            else:  # the stop token it ended on (None: the budget ended it): the drafter must learn it too
                rec = {"source": f"gen:{source}", "prompt": completion_text(turns), "completion": reply, "stop": stop}
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
            written += 1
            manifest["new_tokens"] += len(reply_ids)
            bar.update(1)
            if written % batch_size == 0 or written == len(todo):
                f.flush()
                manifest["records"] = done + written
                now = time.perf_counter()
                manifest["generate_s"] = round(manifest["generate_s"] + now - t0, 1)
                t0 = now
                manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    return written


def _select_prompts(tok, specs: list[str], max_prompt_tokens: int, seed: int, batch_size: int):
    """(source, turns, ids) of every usable prompt, in an order fixed by ``seed``: distinct prompts of at most
    ``max_prompt_tokens``, shuffled, sorted by length within windows of 8 batches (fewer pad slots)."""
    rng = random.Random(seed)
    prompts: list[tuple[str, list[dict[str, str]], list[int]]] = []
    seen: set[tuple[int, ...]] = set()
    for spec in specs:
        path, limit = parse_data_spec(spec)
        recs = list(read_jsonl(path))
        rng.shuffle(recs)
        kept = 0
        for i, rec in enumerate(recs):
            turns = prompt_of(rec, f"{path} record {i + 1}")
            if turns is None:
                continue
            ids = encode_turns(tok, turns)
            if len(ids) > max_prompt_tokens or tuple(ids) in seen:  # AlpacaEval repeats each prompt per model
                continue
            seen.add(tuple(ids))
            prompts.append((str(rec.get("source", path.stem)), turns, list(ids)))
            kept += 1
            if limit is not None and kept >= limit:
                break
    if not prompts:
        raise SpecheadError("no prompts found (chat records with a user turn) in the given files")
    rng.shuffle(prompts)
    window = batch_size * 8
    windows = [sorted(prompts[w : w + window], key=lambda p: len(p[2])) for w in range(0, len(prompts), window)]
    return [p for w in windows for p in w]


def _split_stop(tokens: list[int], stops: list[int]) -> tuple[list[int], int | None]:
    """A reply's tokens before the first stop token, and that token (None: the budget ended it)."""
    cut = next((k for k, t in enumerate(tokens) if t in stops), None)
    return (tokens, None) if cut is None else (tokens[:cut], tokens[cut])


def _engine_replies(target, dtype, prompts, batch_size, max_new, temperature, seed, first, stops):
    """Replies on spechead's batched decoder, yielded in the prompts' order (a prompt's draws are seeded by its
    index, so a resumed run samples what the uninterrupted one would have)."""
    import torch

    from spechead.decoding.sampling import SamplingConfig
    from spechead.decoding.session import Session

    session = Session.open(target, max_len=max(len(p) for p in prompts) + max_new + 1, dtype=getattr(torch, dtype))
    decoder = session.decoder(max_batch=batch_size)
    index_of: dict[int, int] = {}
    results: dict[int, list[int]] = {}
    submitted, emitted = 0, 0
    while emitted < len(prompts):
        while submitted < len(prompts) and len(decoder.waiting) + decoder.occupancy < batch_size:
            cfg = SamplingConfig(temperature, seed=seed * 1_000_003 + first + submitted) if temperature > 0 else None
            index_of[decoder.submit(prompts[submitted], max_new, cfg)] = submitted
            submitted += 1
        for event in decoder.step():
            if event.result is not None:
                results[index_of.pop(event.rid)] = event.result.tokens
        while emitted in results:
            yield _split_stop(results.pop(emitted), stops)
            emitted += 1


def _transformers_replies(folder, dtype, prompts, batch_size, max_new, temperature, seed, stops, device="cpu"):
    """Replies from transformers' ``generate`` on left-padded static batches, in the prompts' order, on ``device``
    (a GPU generates a batch of a thousand replies in seconds; its greedy text may part from the CPU target's after
    a near tie, which training data tolerates)."""
    import torch
    from transformers import AutoModelForCausalLM

    from spechead.model.tokenizer import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).to(device).eval()
    pad_id = load_tokenizer(folder).pad_token_id
    pad = pad_id if pad_id is not None else stops[0]
    gen = torch.Generator().manual_seed(seed)
    with torch.inference_mode():
        for b in range(0, len(prompts), batch_size):
            batch = prompts[b : b + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            att = torch.zeros(len(batch), width, dtype=torch.long)
            for j, p in enumerate(batch):
                ids[j, width - len(p) :] = torch.tensor(p)
                att[j, width - len(p) :] = 1
            kw: dict[str, Any] = {"do_sample": temperature > 0}
            if temperature > 0:
                torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
                kw.update(temperature=temperature, top_p=1.0, top_k=0)
            res = model.generate(
                input_ids=ids.to(device),
                attention_mask=att.to(device),
                max_new_tokens=max_new,
                eos_token_id=stops,
                pad_token_id=pad,
                **kw,
            )
            for j in range(len(batch)):
                yield _split_stop(res[j, width:].tolist(), stops)
