"""FR-Spec / VocabTrim static-subset heads and their token-list files (SGLang token-map format)."""

import gzip
import json

import pytest
import torch

from spechead.cli.commands import main
from spechead.decoding.decoder import Decoder
from spechead.decoding.tree import TreeConfig
from spechead.errors import SpecheadError
from spechead.heads.base import make_head
from spechead.heads.full import FullHead
from spechead.heads.subset import FrequencyHead, VocabTrimHead
from spechead.heads.tokenmaps import find_token_map, load_token_map, save_token_map
from spechead.model.drafter import random_drafter
from spechead.model.loading import load_target
from spechead.training.vocab_lists import assistant_segments, drafter_head_inputs, rank_ids


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty spechead cache, so default lists come only from what a test writes."""
    monkeypatch.setenv("SPECHEAD_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def brute_topk(h, weight, row_of, ids, k):
    """Top-k of the log-softmax over exactly the candidate ids (target ids), computed row by row."""
    logits = torch.stack([h @ weight[row_of[i]] for i in ids.tolist()], dim=-1)
    top, pos = logits.log_softmax(-1).topk(k, dim=-1)
    return top, ids[pos]


def test_topk_equals_brute_force_over_the_subset(tmp_path):
    g = torch.Generator().manual_seed(0)
    V, d = 64, 16
    weight = torch.randn(V, d, generator=g)
    ids = torch.randperm(V, generator=g)[:20]
    path = save_token_map(ids.tolist(), tmp_path / "list.pt")
    h = torch.randn(5, d, generator=g)
    for spec in (f"fr:{path}", f"vocabtrim:{path}"):
        head = make_head(spec, weight, None, V)
        logp, got = head.topk(h, 4)
        want_logp, want = brute_topk(h, weight, torch.arange(V), ids, 4)
        assert torch.equal(got, want)
        torch.testing.assert_close(logp, want_logp)
        assert set(got.flatten().tolist()) <= set(ids.tolist())
    assert isinstance(make_head(f"fr:{path}", weight, None, V), FrequencyHead)
    assert isinstance(make_head(f"vocabtrim:{path}", weight, None, V), VocabTrimHead)


def test_reduced_drafter_vocabulary_keeps_only_ids_it_has(tmp_path):
    """EAGLE-3 with d2t: rows are a subset of the vocabulary; listed ids outside it are dropped."""
    g = torch.Generator().manual_seed(1)
    V, d = 64, 16
    row_ids = torch.randperm(V, generator=g)[:40].sort().values  # drafter row -> target id
    weight = torch.randn(40, d, generator=g)
    ranked = torch.randperm(V, generator=g)[:30]
    path = save_token_map(ranked.tolist(), tmp_path / "list.pt")
    head = make_head(f"fr:{path}", weight, row_ids, V)
    kept = torch.tensor([i for i in ranked.tolist() if i in set(row_ids.tolist())])
    assert torch.equal(head.ids, kept) and head.stats()["dropped_ids"] == 30 - kept.numel()
    row_of = {int(t): r for r, t in enumerate(row_ids.tolist())}
    h = torch.randn(3, d, generator=g)
    logp, got = head.topk(h, 5)
    want_logp, want = brute_topk(h, weight, row_of, kept, 5)
    assert torch.equal(got, want)
    torch.testing.assert_close(logp, want_logp)


def test_default_lists_by_size(cache):
    V, d = 64, 8
    weight = torch.randn(V, d)
    ranked = torch.randperm(V, generator=torch.Generator().manual_seed(2)).tolist()
    folder = cache / "vocab" / f"v{V}"
    save_token_map(ranked[:8], folder / "freq_8.pt")
    save_token_map(ranked[:32], folder / "freq_32.pt")
    assert find_token_map("freq", 8, V).name == "freq_8.pt"
    assert find_token_map("freq", 9, V).name == "freq_32.pt"
    assert find_token_map("freq", 5, V, longest=True).name == "freq_32.pt"
    assert make_head("fr:8", weight, None, V).ids.tolist() == ranked[:8]
    assert make_head("fr:5", weight, None, V).ids.tolist() == ranked[:5]  # a prefix of the ranked list
    assert make_head("fr", weight, None, V).ids.tolist() == ranked[:32]  # plain `fr`: min(32768, longest)
    # a reduced drafter vocabulary reads the longest list, filters, then cuts to N
    row_ids = torch.tensor(sorted(ranked[1:40:2]))
    head = make_head("fr:6", torch.randn(row_ids.numel(), d), row_ids, V)
    assert head.ids.tolist() == [i for i in ranked[:32] if i in set(row_ids.tolist())][:6]
    with pytest.raises(SpecheadError, match="no freq list of at least 40"):
        make_head("fr:40", weight, None, V)
    with pytest.raises(SpecheadError, match="spechead vocabtrim"):
        make_head("vocabtrim:8", weight, None, V)


def test_sglang_token_map_round_trip(tmp_path):
    ids = [17, 3, 0, 63, 42]
    path = save_token_map(ids, tmp_path / "freq_5.pt")
    raw = torch.load(path, weights_only=True)  # exactly what SGLang's load_token_map does
    assert raw == ids and all(type(i) is int for i in raw)
    assert torch.tensor(raw).tolist() == ids
    assert load_token_map(path, 64).tolist() == ids
    torch.save(torch.tensor(ids, dtype=torch.int32), tmp_path / "t.pt")  # a tensor file is accepted too
    assert load_token_map(tmp_path / "t.pt", 64).tolist() == ids


@pytest.mark.parametrize(
    "content, match",
    [
        ([1, 2, 64], "id 64 outside the vocabulary"),
        ([1, -1], "id -1 outside"),
        ([5, 2, 5], "duplicate ids, e.g. 5"),
        ([], "empty"),
        ([1.0, 2.0], "list of ints"),
        ({"ids": [1]}, "list of ints"),
        (torch.tensor([[1, 2]]), "1-D integer tensor"),
    ],
)
def test_bad_token_lists(tmp_path, content, match):
    path = tmp_path / "bad.pt"
    torch.save(content, path)
    with pytest.raises(SpecheadError, match=match):
        make_head(f"fr:{path}", torch.randn(64, 8), None, 64)


def test_bad_specs(tmp_path, cache):
    w = torch.randn(64, 8)
    for spec, match in [("fr:0", "1 <= N"), ("fr:-3", "1 <= N"), ("vocabtrim:65", "1 <= N <= 64")]:
        with pytest.raises(SpecheadError, match=match):
            make_head(spec, w, None, 64)
    with pytest.raises(SpecheadError, match="not found"):
        make_head(f"fr:{tmp_path / 'missing.pt'}", w, None, 64)
    (tmp_path / "junk.pt").write_bytes(b"not a pickle")
    with pytest.raises(SpecheadError, match="cannot read"):
        make_head(f"fr:{tmp_path / 'junk.pt'}", w, None, 64)


def test_rank_ids_puts_forced_first_then_score_then_tie_break():
    score = torch.tensor([0.0, 5.0, 2.0, 5.0, 0.0])
    tie = torch.tensor([0.0, 1.0, 0.0, 2.0, 3.0])
    assert rank_ids(score, tie, first=[2]) == [2, 3, 1, 4, 0]
    assert rank_ids(score) == [1, 3, 2, 0, 4]


def write_word_tokenizer(path):
    """A word-level tokenizer.json: 'a b c d e' -> ids 2..6, [UNK]=0, </s>=1 (the EOS)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "</s>": 1, "a": 2, "b": 3, "c": 4, "d": 5, "e": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def test_freq_command_counts_and_ranks(tmp_path, capsys):
    tok = write_word_tokenizer(tmp_path / "tokenizer.json")
    data = tmp_path / "d.jsonl.gz"
    rows = [
        {"messages": [{"role": "user", "content": "e e e e e"}, {"role": "assistant", "content": "c c a"}]},
        {"text": "c d d d"},
        {"source": "no text here"},
    ]
    with gzip.open(data, "wt") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(["freq", "--tokenizer", str(tok), "--data", str(data), "--sizes", "3,7", "--out", str(tmp_path)]) == 0
    # user text is not counted (the drafter never predicts it): d=3, c=3, a=1; EOS is forced first
    assert torch.load(tmp_path / "freq_7.pt", weights_only=True) == [1, 4, 5, 2, 0, 3, 6]
    assert torch.load(tmp_path / "freq_3.pt", weights_only=True) == [1, 4, 5]
    assert main(["freq", "--tokenizer", str(tok), "--data", str(data), "--sizes", "8", "--out", str(tmp_path)]) == 2
    assert "must be in [1, 7]" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    bad = ["--data", str(tmp_path / "bad.jsonl"), "--sizes", "3"]
    assert main(["freq", "--tokenizer", str(tok), *bad, "--out", str(tmp_path)]) == 2
    assert "bad.jsonl:1: invalid JSON" in capsys.readouterr().err


def test_assistant_text_through_the_chat_template(demo_session):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there!"}]
    assert assistant_segments(demo_session.tokenizer, msgs) == ["Hello there!<|im_end|>\n"]


def test_vocabtrim_positions_match_the_engine(tiny_small_vocab_dir):
    """The one-pass calibration states are the states the engine drafts each round's first level from."""
    target, _ = load_target(str(tiny_small_vocab_dir))
    drafter = random_drafter(target, "eagle2", seed=0)
    weight, row_ids = drafter.head_weight(target)
    seen = []

    class Recorder(FullHead):
        def topk(self, h, k):
            if h.shape[0] == 1:
                seen.append(h.clone())
            return super().topk(h, k)

    dec = Decoder(target, drafter, Recorder(weight, row_ids, 16), TreeConfig.chain(1), 128)
    prompt = [3, 1, 4, 1, 5]
    res = dec.generate(prompt, 12)
    # a chain of 1 drafts once per round; round r starts with the prompt and sum(accepted) + 1 tokens
    known = [len(prompt) + 1 + sum(res.accept_lengths[:r]) for r in range(len(res.accept_lengths))]
    seq = torch.tensor(prompt + res.tokens)
    states = drafter_head_inputs(target, drafter, seq, len(prompt))
    for h, n in zip(seen, known, strict=False):
        torch.testing.assert_close(h[0], states[n - len(prompt) - 1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["eagle2", "eagle3"])
def test_greedy_output_equals_autoregressive(tiny_small_vocab_dir, tmp_path, arch):
    target, _ = load_target(str(tiny_small_vocab_dir))
    V = target.config.vocab_size
    if arch == "eagle3":  # a reduced draft vocabulary (d2t): the list is intersected with it
        drafter = random_drafter(target, "eagle3", seed=1, draft_vocab_size=12)
        drafter.set_draft_vocab(torch.randperm(V, generator=torch.Generator().manual_seed(4))[:12])
    else:
        drafter = random_drafter(target, "eagle2", seed=1)
    weight, row_ids = drafter.head_weight(target)
    path = save_token_map(torch.randperm(V, generator=torch.Generator().manual_seed(5))[:9].tolist(), tmp_path / "l.pt")
    ar = Decoder(target, max_len=128)
    prompts = ([1, 2, 3], [9, 4, 4, 7, 0, 15, 2])
    want = [ar.generate(p, 30, speculative=False).tokens for p in prompts]
    for spec in (f"fr:{path}", f"vocabtrim:{path}"):
        dec = Decoder(target, drafter, make_head(spec, weight, row_ids, V), TreeConfig(4, 3, 12), 128)
        got = [dec.generate(p, 30) for p in prompts]
        assert [r.tokens for r in got] == want
        assert max(max(r.accept_lengths) for r in got) >= 2  # drafts were accepted, not only bonus tokens


def test_vocabtrim_cli_takes_the_first_n_prompts_of_each_file(tmp_path, capsys):
    files = []
    for name in ("a", "b"):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"turns": [f"Say {name} {i}."]}) + "\n" for i in range(5)))
        files.append(path)
    out = tmp_path / "lists"
    argv = ["vocabtrim", "--target", "demo", "--drafter", "random", "--sizes", "64", "--max-new-tokens", "3"]
    assert main([*argv, "--out", str(out), "--prompts", f"{files[0]}:1", f"{files[1]}:2"]) == 0
    assert "3 prompts" in capsys.readouterr().out
    assert len(torch.load(out / "vocabtrim_64.pt")) == 64
