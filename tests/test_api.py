"""The Python API (``spechead.load``, ``LLM.generate``, ``LLM.stream``) on the demo target: lossless against plain
AR, streaming equal to generating, seeded sampling reproducible, and every bad argument a ``SpecheadError`` that
names it. The README's Python example runs as a user would run it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import spechead
from spechead import LLM, Completion, SpecheadError

pytestmark = pytest.mark.usefixtures("one_thread")

README = Path(__file__).parent.parent / "README.md"
PROMPTS = ["Say hello in French.", "What is 12 times 12?", "Name a primary colour."]
N = 8  # new tokens per request: the demo model decodes ~10-30 tokens/s on 2 CPU cores


@pytest.fixture(scope="module")
def spec(demo_session) -> LLM:
    """Speculative decoding with the shipped drafter and NanoSpec's head, two requests at a time."""
    return LLM(demo_session, drafter="demo", head="nanospec", max_batch=2)


@pytest.fixture(scope="module")
def ar(demo_session) -> LLM:
    return LLM(demo_session, method="ar")


def test_the_readmes_python_example_runs():
    example = README.read_text().split("```python\n", 1)[1].split("```", 1)[0]
    assert "spechead.load(" in example and len(example.splitlines()) <= 12
    r = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=600, env=os.environ)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    lines = r.stdout.strip().splitlines()
    assert any("tokens/s, tau" in line for line in lines) and lines[-1].strip(), r.stdout


def test_speculative_greedy_batch_equals_ar(spec, ar):
    fast = spec.generate(PROMPTS, max_new_tokens=N)
    plain = [ar.generate(p, max_new_tokens=N) for p in PROMPTS]  # one prompt: one Completion
    assert [c.token_ids for c in fast] == [c.token_ids for c in plain]
    for c in fast:
        assert isinstance(c, Completion) and c.text == spec.decode(c.token_ids)
        assert c.stop_reason in ("stop_token", "max_new_tokens") and len(c.token_ids) <= N
        assert c.tokens_per_s > 0 and c.tau >= 1.0 and c.prompt_tokens > 0
        assert c.mode_rounds and "rounds" in c.head_stats  # NanoSpec counts its rounds
    assert spec.method == "eagle" and ar.method == "ar" and not plain[0].head_stats


def test_stream_pieces_join_to_generated_text(spec):
    prompt = "Write the word café, then a smiley emoji."
    pieces = list(spec.stream(prompt, max_new_tokens=N))
    assert "".join(pieces) == spec.generate(prompt, max_new_tokens=N).text
    assert all(pieces) and not any(p.endswith("\ufffd") for p in pieces[:-1])


def test_a_stream_left_open_holds_the_llm_until_closed(spec):
    stream = spec.stream(PROMPTS[0], max_new_tokens=N)
    next(stream)
    with pytest.raises(RuntimeError, match="unfinished stream"):
        spec.generate(PROMPTS[1], max_new_tokens=2)
    stream.close()  # the request is dropped; the decoder is free again
    assert len(spec.generate(PROMPTS[1], max_new_tokens=2).token_ids) <= 2


def test_seeded_sampling_is_reproducible_and_lossless(spec, ar):
    kw = dict(max_new_tokens=N, temperature=0.9, top_p=0.95, top_k=50, seed=7)
    first, again = spec.generate(PROMPTS[:2], **kw), spec.generate(PROMPTS[:2], **kw)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert [c.token_ids for c in first] == [ar.generate(p, **kw).token_ids for p in PROMPTS[:2]]
    assert "".join(spec.stream(PROMPTS[0], **kw)) == first[0].text


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens="ten"), "max_new_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=3.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(seed="x"), "seed"),
        (dict(prompt=""), "prompt"),
        (dict(prompt=[{"role": "user"}]), "prompt"),
        (dict(prompt=[{"role": "user", "content": "hi"}], raw=True), "prompt"),
        (dict(prompt="hello " * 3000), "prompt"),  # longer than the context
    ],
)
def test_bad_generation_arguments_name_themselves(spec, kw, name):
    kw = {"prompt": "hi", **kw}
    prompt = kw.pop("prompt")
    for call in (spec.generate, spec.stream):
        with pytest.raises(SpecheadError, match=name) as e:
            call(prompt, **kw)
        assert e.value.param == name
    assert not spec.decoder.busy


@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(target="/no/such/model"), "target"),
        (dict(target=""), "target"),
        (dict(drafter="/no/such/drafter"), "drafter"),
        (dict(head="nope"), "head"),
        (dict(head="full:3"), "head"),
        (dict(tree="chain:0"), "tree"),
        (dict(tree="bogus"), "tree"),
        (dict(method="beam"), "method"),
        (dict(max_batch=0), "max_batch"),
        (dict(threads=0), "threads"),
        (dict(max_len=1), "max_len"),
    ],
)
def test_bad_load_arguments_name_themselves(kw, name):
    with pytest.raises(SpecheadError, match=name) as e:
        spechead.load(**kw)
    assert e.value.param == name
