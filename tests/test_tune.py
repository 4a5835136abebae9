"""spechead tune: a valid choice on tiny random models, the cache (reuse, --force, key), ``--tree auto`` wiring,
the fallback, bad options. No timing assertions: timings belong in benchmarks."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from spechead import errors, kernels
from spechead.cache import cache_dir
from spechead.decoding import session as session_module
from spechead.decoding.session import DEFAULT_TREE, Session
from spechead.decoding.tree import TreeConfig
from spechead.errors import SpecheadError
from spechead.model.drafter import random_drafter
from spechead.model.loading import load_target
from spechead.tuning import tune
from spechead.tuning.costs import MAX_ROWS
from spechead.tuning.predict import candidate_grid
from spechead.tuning.show import format_show
from spechead.tuning.store import cache_key, drafter_identity, fingerprint

# a small grid and short calibration: the whole tuning runs in a second or two on the tiny model
FAST = {"new_tokens": 8, "prompts": 3, "shapes": ("chain:1", "chain:2", "2x1x4"), "lookups": (0, 8)}


class TinySession(Session):
    """A session on a tokenizer-less test checkpoint (tune then uses the prompts' bytes as ids), with the tuner
    as its ``auto`` resolver (``tune.open_session`` attaches it likewise)."""

    @property
    def stop_ids(self) -> list[int]:
        return []


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    kernels.available()  # build (or find) the kernel where it always lives, before the cache moves
    monkeypatch.setenv("SPECHEAD_CACHE", str(tmp_path / "cache"))
    for var in ("SPECHEAD_TUNE", "SPECHEAD_ISA"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(tune, "_MEMO", {})
    monkeypatch.setattr(tune, "_FAILED", {})
    monkeypatch.setattr(errors, "_SAID", set())
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tiny(tiny_small_vocab_dir):
    target, folder = load_target(str(tiny_small_vocab_dir))
    target.setup_cache(256)
    drafter = random_drafter(target, "eagle2", seed=0)
    drafter.spechead_source = "random:eagle2:seed=0"
    return TinySession(target, folder, None, 256, tune.resolve), drafter


@pytest.fixture
def counted(monkeypatch):
    """Every tuning measured (by head), each with the FAST settings."""
    calls = []
    real = tune.measure

    def spy(session, drafter, head="full", progress=True, **settings):
        calls.append(head)
        return real(session, drafter, head, progress=progress, **(FAST | settings))

    monkeypatch.setattr(tune, "measure", spy)
    return calls


def test_tune_chooses_a_measured_tree_caches_it_and_reuses_it(tiny, counted):
    session, drafter = tiny
    res = tune.load_or_tune(session, drafter, "nanospec", progress=False)
    grid = candidate_grid(FAST["shapes"], FAST["lookups"])
    assert res.measured and counted == ["nanospec"]
    assert res.tree in grid and res.gather in ("sync", "async") and res.ar_step_s > 0
    data = json.loads(res.path.read_text())
    assert res.path.parent.name == "tune" and res.path.is_relative_to(cache_dir())
    costs = data["costs"]
    assert set(costs["verify_ms"]) == {str(n) for n in range(1, MAX_ROWS + 1)}
    assert {"full", "nanospec", "lowrank"} <= {h for h, e in costs["heads"].items() if "error" not in e}
    assert {c["tree"] for c in data["candidates"]} == {str(t) for t in grid}
    for c in data["candidates"]:
        assert c["tau"] >= 1 and c["predicted_tok_s"] > 0 and not c.get("mismatches"), c
    assert data["choice"]["tree"] == str(res.tree) and data["choice"]["reason"]
    # reused: from this process's memo, then from the file, never measured again
    assert tune.load_or_tune(session, drafter, "nanospec", progress=False) is res
    tune._MEMO.clear()
    again = tune.load_or_tune(session, drafter, "nanospec", progress=False)
    assert not again.measured and again.tree == res.tree and again.gather == res.gather and counted == ["nanospec"]
    # --force measures again
    forced = tune.load_or_tune(session, drafter, "nanospec", force=True, progress=False)
    assert forced.measured and counted == ["nanospec", "nanospec"]
    shown = format_show(forced)
    assert "chosen:" in shown and all(str(t) in shown for t in grid) and "verify, rows" in shown


def test_auto_tree_in_the_decoder_is_the_cached_choice_and_stays_lossless(tiny, counted):
    session, drafter = tiny
    res = tune.load_or_tune(session, drafter, "nanospec", progress=False)
    dec = session.decoder(drafter, "nanospec", "auto")
    assert counted == ["nanospec"] and dec.tree == res.tree and dec.head.gather == res.gather
    assert dec.guard.ar_step_s == pytest.approx(res.ar_step_s)  # the guard starts from the measured AR step
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    ar = session.decoder().generate(ids, 12, speculative=False)
    assert dec.generate(ids, 12).tokens == ar.tokens
    assert session.decoder(None, "full", "auto").tree == DEFAULT_TREE  # plain AR has nothing to tune
    assert session.decoder(drafter, "full", "2x2x5").tree == TreeConfig(2, 2, 5)  # explicit specs still work


def test_cache_key_follows_machine_isa_head_threads_and_drafter(tiny, monkeypatch):
    session, drafter = tiny
    base = cache_key(session, drafter, "full", 1)[0]
    with monkeypatch.context() as m:  # (the suite itself may run under either variable: flip, then restore)
        m.setenv("SPECHEAD_ISA", "generic" if os.environ.get("SPECHEAD_ISA") != "generic" else "avx2")
        assert fingerprint()["SPECHEAD_ISA"] == os.environ["SPECHEAD_ISA"]
        isa = cache_key(session, drafter, "full", 1)[0]
    with monkeypatch.context() as m:
        m.setenv("SPECHEAD_KERNELS", "1" if os.environ.get("SPECHEAD_KERNELS") == "0" else "0")
        kern = cache_key(session, drafter, "full", 1)[0]
    assert cache_key(session, drafter, "full", 1)[0] == base
    other = random_drafter(session.target, "eagle2", seed=1)  # untagged: known by a digest of its weights
    keys = {
        base,
        isa,
        kern,
        cache_key(session, drafter, "nanospec", 1)[0],
        cache_key(session, drafter, "full", 2)[0],
        cache_key(session, other, "full", 1)[0],
    }
    assert len(keys) == 6


def test_fallback_when_tuning_cannot_run(tiny, monkeypatch, capsys):
    session, drafter = tiny
    monkeypatch.setenv("SPECHEAD_TUNE", "off")
    res = tune.resolve(session, drafter, "full")
    assert res.fallback and res.tree == DEFAULT_TREE and res.ar_step_s is None
    assert session.decoder(drafter, "full", "auto").tree == DEFAULT_TREE
    err = capsys.readouterr().err
    assert err.count("using the default tree") == 1 and str(DEFAULT_TREE) in err  # said once
    monkeypatch.delenv("SPECHEAD_TUNE")
    short = TinySession(session.target, session.folder, None, 64)  # no room for the calibration prompts
    res = tune.resolve(short, drafter, "full")
    assert res.fallback and "too short" in res.reason and "too short" in capsys.readouterr().err


def test_auto_without_a_resolver_is_the_default_tree_said_once(tiny, counted, capsys):
    """The decoding layer does not know the tuner: a session opened without one decodes ``auto`` as the default."""
    session, drafter = tiny
    bare = TinySession(session.target, session.folder, None, 256)
    assert bare.tree_resolver is None
    for head in ("full", "nanospec"):
        dec = bare.decoder(drafter, head, "auto")
        assert dec.tree == DEFAULT_TREE and dec.guard.ar_step_s is None
    err = capsys.readouterr().err
    assert err.count("no tuner attached") == 1 and str(DEFAULT_TREE) in err and counted == []


def test_open_session_attaches_the_tuner(tiny, monkeypatch):
    session, _ = tiny
    monkeypatch.setattr(session_module, "load_target", lambda target, dtype: (session.target, session.folder))
    monkeypatch.setattr(session_module, "load_tokenizer", lambda folder: None)
    opened = tune.open_session("tiny", 128)
    assert opened.tree_resolver is tune.resolve and opened.max_len == 128 and opened.target is session.target
    bare = Session.open("tiny", 128)
    tuned = tune.with_tuner(bare)
    assert bare.tree_resolver is None and tuned.tree_resolver is tune.resolve and tuned.target is bare.target
    assert tune.with_tuner(tuned) is tuned


def test_bad_options_are_errors(tiny, capsys):
    from spechead.cli.commands import main

    session, drafter = tiny
    with pytest.raises(SpecheadError, match="unknown head"):
        tune.load_or_tune(session, drafter, "nope", progress=False)
    with pytest.raises(SpecheadError, match="unknown head"):  # a bad head is the user's error, not a fallback
        session.decoder(drafter, "nope", "auto")
    with pytest.raises(SpecheadError, match="threads"):
        tune.load_or_tune(session, drafter, "full", threads=0, progress=False)
    with pytest.raises(SpecheadError, match="new_tokens"):
        tune.measure(session, drafter, "full", progress=False, new_tokens=1)
    assert main(["tune", "--budget", "-1"]) == 2
    assert main(["tune", "--target", "/no/such/model"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(err) == 2 and "--budget" in err[0] and "target not found" in err[1]
    with pytest.raises(SystemExit) as exit_info:
        main(["tune", "--threads", "0"])
    assert exit_info.value.code == 2 and "positive integer" in capsys.readouterr().err


def test_bench_resolves_auto_once_per_drafter_and_head_and_records_the_tree(tiny, counted, monkeypatch):
    from spechead.bench import runners as bench
    from spechead.bench.methods import MethodSpec, check_methods
    from spechead.cli.bench import format_table

    session, drafter = tiny
    monkeypatch.setattr(bench, "method_drafter", lambda *a: (drafter, "random eagle2 (seed 0)"))
    specs = check_methods(["ar", "eagle", "nanospec", "fr", "nanospec@2x2x5"], None)
    assert [s.tree for s in specs] == [None, None, None, None, TreeConfig(2, 2, 5)]
    runners, info, skipped = bench.build_runners(session, specs, {}, log=lambda msg: None)
    assert counted == ["full", "nanospec"] + ["fr"] and list(skipped) == ["fr"]  # no fr token list for V=16
    assert list(runners) == ["ar", "eagle", "nanospec", "nanospec@2x2x5"]  # the names the user gave
    for name in ("eagle", "nanospec"):
        tree = tune.load_or_tune(session, drafter, "full" if name == "eagle" else name, progress=False).tree
        spec = next(s for s in specs if s.name == name)
        assert spec.tree == tree and info[name]["tree_spec"] == info[name]["tree_auto"]["tree"] == str(tree)
    assert info["nanospec@2x2x5"]["tree_spec"] == "2x2x5" and "tree_auto" not in info["nanospec@2x2x5"]
    assert counted == ["full", "nanospec", "fr"]  # each resolved once (the decoder's lookup is the cached one)
    assert MethodSpec.parse("nanospec@auto", DEFAULT_TREE).tree is None
    out = {"config": {"prompts": 1, "threads": 1, "tree": "auto"}, "methods": {"nanospec": {**info["nanospec"]}}}
    out["methods"]["nanospec"].update(tokens_per_s=1.0, tau=1.0)
    assert f"nanospec@{info['nanospec']['tree_spec']}" in format_table(out)


def test_drafter_sources_are_tagged(tiny):
    from spechead.decoding.session import resolve_drafter

    session, _ = tiny
    assert resolve_drafter("random", session.target).spechead_source == "random:eagle2:seed=0"
    assert resolve_drafter("random:eagle3", session.target).spechead_source == "random:eagle3:seed=0"
    ident = drafter_identity(SimpleNamespace(arch="eagle2", spechead_source="random:eagle2:seed=0"))
    assert ident["source"] == "random:eagle2:seed=0" and "files" not in ident
