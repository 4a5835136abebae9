"""``spechead export --format vllm`` (no vLLM needed): the folder holds the head as data, and spechead reads it
back to the very same head (the plugin builds its head from the same fields)."""

from __future__ import annotations

import json

import pytest
import torch

from spechead.errors import SpecheadError
from spechead.heads import make_head
from spechead.heads.tokenmaps import load_token_map
from spechead.integrations.vllm.export import CONFIG_KEY, VLLM_ARCH, VLLM_ARCH_EAGLE, export_vllm
from spechead.model.drafter import load_drafter, random_drafter


def _head(drafter, target, spec):
    weight, row_ids = drafter.head_weight(target)
    return make_head(spec, weight, row_ids, target.config.vocab_size, drafter.low_rank_head)


def test_export_lowrank_writes_factors_spechead_reads_back(tiny_target, tmp_path):
    d = random_drafter(tiny_target, "eagle3", seed=1)
    head = _head(d, tiny_target, "lowrank:4")
    out = export_vllm(d, head, "lowrank:4", tmp_path / "lr")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [VLLM_ARCH] and cfg["architectures"][0].endswith("Eagle3")
    assert cfg["lm_head_rank"] == 4 and cfg[CONFIG_KEY]["head"] == "lowrank"
    back = load_drafter(out, tiny_target)
    h = torch.randn(3, tiny_target.config.hidden_size)
    again = _head(back, tiny_target, "lowrank")
    torch.testing.assert_close(again.reference_logits(h), head.reference_logits(h))
    assert torch.equal(again.topk(h, 2)[1], head.topk(h, 2)[1])


def test_export_subset_writes_its_token_list(tiny_target, tmp_path):
    d = random_drafter(tiny_target, "eagle3", seed=1)
    V = tiny_target.config.vocab_size
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(0))[:10]
    path = tmp_path / "list.pt"
    torch.save(ids.tolist(), path)
    head = _head(d, tiny_target, f"fr:{path}")
    out = export_vllm(d, head, f"fr:{path}", tmp_path / "fr")
    block = json.loads((out / "config.json").read_text())[CONFIG_KEY]
    name, _, file = block["head"].partition(":")
    assert name == "fr" and torch.equal(load_token_map(out / file, V), ids)
    again = _head(load_drafter(out, tiny_target), tiny_target, f"fr:{out / file}")
    h = torch.randn(2, tiny_target.config.hidden_size)
    torch.testing.assert_close(again.reference_logits(h), head.reference_logits(h))


def test_export_eagle2_keeps_its_layout_and_names_the_eagle_class(tiny_target, tmp_path):
    """An EAGLE-2 drafter goes to vLLM's EAGLE-1/2 class (method "eagle"): the same weights under the published
    names, the class name vLLM keeps (it starts with Eagle), a subset head as its token list, a low-rank head as
    factors the plugin loads."""
    d = random_drafter(tiny_target, "eagle2", seed=1)
    V = tiny_target.config.vocab_size
    ids = torch.randperm(V, generator=torch.Generator().manual_seed(0))[:10]
    torch.save(ids.tolist(), tmp_path / "list.pt")
    spec = f"fr:{tmp_path / 'list.pt'}"
    out = export_vllm(d, _head(d, tiny_target, spec), spec, tmp_path / "fr")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [VLLM_ARCH_EAGLE] and VLLM_ARCH_EAGLE.startswith("Eagle")
    back = load_drafter(out, tiny_target)
    assert back.arch == "eagle2"
    for k, v in d.checkpoint_state().items():
        torch.testing.assert_close(back.checkpoint_state()[k], v.float())
    name, _, file = cfg[CONFIG_KEY]["head"].partition(":")
    assert name == "fr" and torch.equal(load_token_map(out / file, V), ids)
    lr = export_vllm(d, _head(d, tiny_target, "lowrank:4"), "lowrank:4", tmp_path / "lr")
    cfg = json.loads((lr / "config.json").read_text())
    assert cfg["lm_head_rank"] == 4 and "tie_lm_head_to_target" not in cfg
    from safetensors import safe_open

    with safe_open(lr / "model.safetensors", "pt") as f:
        assert {"lm_head.up.weight", "lm_head.down.weight"} <= set(f.keys())
        assert tuple(f.get_tensor("lm_head.down.weight").shape) == (4, tiny_target.config.hidden_size)


def test_export_refuses_what_vllm_cannot_run(tiny_target, tmp_path):
    d3 = random_drafter(tiny_target, "eagle3", seed=1)
    with pytest.raises(SpecheadError, match="cannot run inside vLLM"):
        export_vllm(d3, _head(d3, tiny_target, "hybrid"), "hybrid", tmp_path / "hy")


def test_export_nanospec_carries_its_options(tiny_target, tmp_path):
    """NanoSpec needs only the drafter's own head rows: the folder is the plain checkpoint plus its spec."""
    d = random_drafter(tiny_target, "eagle3", seed=1)
    spec = "nanospec:64:ext_from=tokens"
    out = export_vllm(d, _head(d, tiny_target, spec), spec, tmp_path / "ns")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [VLLM_ARCH] and cfg[CONFIG_KEY]["head"] == spec
    assert "lm_head_rank" not in cfg and sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert "lookup_first" not in cfg[CONFIG_KEY]
    first = export_vllm(d, _head(d, tiny_target, "full"), "full", tmp_path / "first", lookup_first=True)
    assert json.loads((first / "config.json").read_text())[CONFIG_KEY]["lookup_first"] is True


def test_cached_export_follows_the_drafters_weights(tiny_dir, tiny_target, tmp_path):
    """benchmarks/vllm_*.py and the plugin test reuse exported folders: new weights in a drafter folder must get a new
    export, not the folder written for the old ones."""
    from spechead.decoding.session import Session
    from spechead.integrations.vllm.compare import Method, export_dir

    session = Session(tiny_target, tiny_dir, None, 128)  # no tokenizer: exporting needs none
    folder = tmp_path / "drafter"
    random_drafter(tiny_target, "eagle3", seed=1).save(folder)
    method = Method("test", str(folder), "full")
    first = export_dir(method, session, tmp_path / "cache")
    assert export_dir(method, session, tmp_path / "cache") == first  # kept
    random_drafter(tiny_target, "eagle3", seed=2).save(folder)
    second = export_dir(method, session, tmp_path / "cache")
    assert second != first and (second / "config.json").is_file()
    exported, saved = load_drafter(second, tiny_target), load_drafter(folder, tiny_target)
    for k, v in saved.checkpoint_state().items():  # the new export holds the new weights
        torch.testing.assert_close(exported.checkpoint_state()[k], v)


def test_a_schedule_becomes_vllms_chain_length_by_batch_size(tiny_dir, tiny_target):
    from spechead.integrations.vllm.compare import Method, parse_schedule, vllm_config

    assert parse_schedule("1-4:1,5-256:0") == [(1, 4, 1), (5, 256, 0)]
    assert parse_schedule("1:2,2-8:1") == [(1, 1, 2), (2, 8, 1)]
    for bad in ("2-4:1", "1-4:x", "4-1:1", "1-4:-1", "1-4"):
        with pytest.raises(ValueError, match="schedule"):
            parse_schedule(bad)
    method = Method("test", "eagle2", "full")
    spec = vllm_config(method, tiny_dir, 1, parse_schedule("1-4:1,5-256:0"))
    assert spec["num_speculative_tokens"] == 1
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 4, 1], [5, 256, 0]]
    assert "num_speculative_tokens_per_batch_size" not in vllm_config(method, tiny_dir, 1)
