"""Static draft vocabularies: FR-Spec frequency lists and VocabTrim drafter-proposal lists.

Both are written in the format SGLang reads for ``--speculative-token-map``: a ``torch.save``d
Python list of int token ids, most important first, one file per size (``freq_<N>.pt``,
``vocabtrim_<N>.pt``). The lists are prefix-consistent (the N-list is the first N of any longer
one), so a head asking for N can truncate a longer file. The end-of-turn tokens are always put
first: a draft vocabulary that cannot propose EOS costs a whole round at the end of every reply.

Default location, keyed by the target's vocabulary size (a list depends on the tokenizer only, and
a ``DraftHead`` knows the target by its V): ``$SPECHEAD_CACHE/vocab/v<V>/``, where the commands
write by default, then the lists shipped in the package (``spechead/drafters/vocab/v<V>/``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from spechead.errors import SpecheadError
from spechead.heads.tokenmaps import save_token_map
from spechead.kernels.qlinear import QuantWeight
from spechead.training.data import read_jsonl


def rank_ids(score: Tensor, tie_break: Tensor | None = None, first: list[int] = ()) -> list[int]:
    """All ids by descending score (then tie_break, then id), with ``first`` moved to the front."""
    order = torch.arange(score.numel())
    if tie_break is not None:
        order = order[torch.sort(tie_break[order], descending=True, stable=True).indices]
    order = order[torch.sort(score[order], descending=True, stable=True).indices]
    head = list(dict.fromkeys(int(i) for i in first))
    skip = set(head)
    return head + [i for i in order.tolist() if i not in skip]


def write_lists(kind: str, ranked: list[int], sizes: list[int], out: Path) -> list[Path]:
    return [save_token_map(ranked[:n], out / f"{kind}_{n}.pt") for n in sizes]


def parse_sizes(spec: str, vocab_size: int) -> list[int]:
    try:
        sizes = [int(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        raise SpecheadError(f"--sizes must be comma-separated integers, got {spec!r}") from None
    for n in sizes:
        if not 0 < n <= vocab_size:
            raise SpecheadError(f"list size {n} must be in [1, {vocab_size}] (the vocabulary size)")
    if not sizes:
        raise SpecheadError("--sizes is empty")
    return sorted(set(sizes))


def assistant_segments(tok, messages: list[dict]) -> list[str]:
    """The text the drafter will have to predict for each assistant turn: the reply as the chat
    template renders it (including its end-of-turn marker), or the bare content without a template."""
    out = []
    template = getattr(tok, "chat_template", None)
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") != "assistant" or not isinstance(m.get("content"), str):
            continue
        seg = m["content"]
        if template and i > 0:
            try:
                before = tok.apply_chat_template(messages[:i], add_generation_prompt=True, tokenize=False)
                full = tok.apply_chat_template(messages[: i + 1], tokenize=False)
                if full.startswith(before):
                    seg = full[len(before) :]
            except Exception:  # a template that rejects this conversation: count the bare content
                pass
        out.append(seg)
    return out


def record_texts(tok, rec: dict) -> list[str]:
    """The text of a record the drafter predicts: assistant turns, a base model's completion, or raw text."""
    if isinstance(rec.get("messages"), list):
        return assistant_segments(tok, rec["messages"])
    if isinstance(rec.get("completion"), str):
        return [rec["completion"]]
    if isinstance(rec.get("text"), str):
        return [rec["text"]]
    return []


def count_tokens(tok, files: list[str], vocab_size: int, limit: int | None = None, batch: int = 256) -> Tensor:
    """Token counts [V] over the assistant text of chat records and the whole of raw-text records."""
    from tqdm import tqdm

    counts = torch.zeros(vocab_size, dtype=torch.long)
    pending: list[str] = []

    def flush() -> int:
        if not pending:
            return 0
        ids = [i for seq in tok(pending, add_special_tokens=False)["input_ids"] for i in seq]
        pending.clear()
        t = torch.tensor(ids, dtype=torch.long)
        if t.numel() and int(t.max()) >= vocab_size:
            raise SpecheadError(f"tokenizer produced id {int(t.max())} beyond the vocabulary size {vocab_size}")
        counts.add_(torch.bincount(t, minlength=vocab_size))
        return t.numel()

    total = 0
    for path in files:
        bar = tqdm(read_jsonl(path, keys=None), desc=Path(path).name, unit=" rec", leave=False)
        for n, rec in enumerate(bar):
            if limit is not None and n >= limit:
                break
            pending += record_texts(tok, rec)
            if len(pending) >= batch:
                total += flush()
                bar.set_postfix(tokens=total, refresh=False)
        total += flush()
        bar.close()
    if total == 0:
        raise SpecheadError("no text found: records need 'messages' (chat), 'completion' or 'text'")
    return counts


# -- VocabTrim calibration ---------------------------------------------------------------------
def record_prompt(rec: dict) -> list[dict[str, str]] | None:
    """The chat turns to prompt with: Spec-Bench ``turns`` (first turn), the messages before the first
    assistant reply, or a ``prompt`` / ``text`` field as one user turn."""
    if isinstance(rec.get("turns"), list) and rec["turns"] and isinstance(rec["turns"][0], str):
        return [{"role": "user", "content": rec["turns"][0]}]
    if isinstance(rec.get("messages"), list):
        turns = []
        for m in rec["messages"]:
            if not isinstance(m, dict) or m.get("role") == "assistant":
                break
            turns.append({"role": str(m.get("role")), "content": str(m.get("content", ""))})
        return turns if any(t["role"] == "user" for t in turns) else None
    for key in ("prompt", "text"):
        if isinstance(rec.get(key), str) and rec[key].strip():
            return [{"role": "user", "content": rec[key]}]
    return None


@torch.inference_mode()
def drafter_head_inputs(target, drafter, seq: Tensor, P: int) -> Tensor:
    """The drafter's head inputs [L-P, d] at every draft position of ``seq`` after the first P tokens,
    computed in one pass: row i is the state the engine drafts its first tree level from once the
    prompt and i+1 reply tokens are known (the pair (feature_j, token_j+1), j = P-1+i); it predicts
    token P+1+i."""
    L = seq.numel()
    out = target(seq, 0, logits_rows=slice(-1, None), want_aux=drafter.arch == "eagle3")
    feats = drafter.target_features(out)
    h = drafter(seq[1:], feats[:-1], 0, torch.arange(L - 1, device=seq.device), None)[P - 1 :]
    return drafter.head_input(h)


@torch.inference_mode()
def drafter_proposals(session, drafter, prompts: list[list[dict]], max_new_tokens: int, topk: int, max_prompt: int):
    """VocabTrim calibration: the target writes a reply to each prompt (greedy; the speculative path
    with the full head gives the target's exact output, faster), then the drafter reads prompt + reply
    the way the engine feeds it, counting its top-k proposals at every reply position.

    Returns (proposal counts [V], summed draft probability [V], reply positions checked, positions
    whose true next token was among the drafter's top-k).
    """
    from tqdm import tqdm

    target = session.target
    V = target.config.vocab_size
    weight, row_ids = drafter.head_weight(target)
    if isinstance(weight, QuantWeight):  # a quantized target's head: rank by the matrix its blocks stand for
        weight = weight.blocks().dequantize()
    dec = session.decoder(drafter, "full")
    counts = torch.zeros(V, dtype=torch.long)
    mass = torch.zeros(V, dtype=torch.float64)
    seen = hit = 0
    for turns in tqdm(prompts, desc="calibration", unit=" prompt"):
        ids = session.encode(turns)[-max_prompt:]
        reply = dec.generate(ids, max_new_tokens).tokens
        seq = torch.tensor(ids + reply, dtype=torch.long, device=weight.device)
        P, L = len(ids), seq.numel()
        if L - P < 2:
            continue
        logits = torch.nn.functional.linear(drafter_head_inputs(target, drafter, seq, P), weight).float()
        rows = logits.topk(min(topk, logits.shape[-1]), dim=-1).indices
        top = rows if row_ids is None else row_ids[rows]
        counts += torch.bincount(top.flatten().cpu(), minlength=V)
        probs = logits.softmax(-1).sum(0).double().cpu()
        mass.index_add_(0, (torch.arange(weight.shape[0]) if row_ids is None else row_ids).cpu(), probs)
        truth = seq[P + 1 :]  # what the drafter should have proposed at rows 0 .. L-P-2
        seen += truth.numel()
        hit += int((top[: truth.numel()] == truth[:, None]).any(-1).sum())
    return counts, mass, seen, hit
