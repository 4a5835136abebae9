"""The OpenAI-compatible server end to end: a real ``spechead serve`` process on loopback (demo target,
random drafter), driven by the official ``openai`` client; greedy answers are checked against the
engine's own autoregressive decoding, so the server path is also a losslessness check."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from spechead.serve.stream import TextStream

openai = pytest.importorskip("openai")

MODEL = "smollm2-135m-instruct"
MAX_LEN = 512
QUEUE = 4
CHAT = "Write a haiku about the sea."
N = 8  # new tokens per test request: the demo model decodes ~10-30 tokens/s on 2 CPU cores
LOAD_PROMPTS = [
    "Name three primary colors.",
    "What is 12 times 12?",
    "Give one tip for writing clean code.",
    "Say hello in French.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(cond, what: str, limit: float = 120.0) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > limit:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


class Served:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path) -> None:
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.http = httpx.Client(base_url=self.url, timeout=120)

    def client(self, **kw) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120, **kw)

    def health(self) -> dict:
        return self.http.get("/health").json()

    def metric(self, name: str) -> float:
        """Sum of all samples of a metric (over labels) in /metrics."""
        total = 0.0
        for line in self.http.get("/metrics").text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")


pytestmark = pytest.mark.usefixtures("one_thread")


def serve(tmp_path_factory, *extra: str):
    """A ``spechead serve`` process on a free loopback port (demo target, random drafter), until the test module
    ends; the log must hold no traceback."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    cmd = [sys.executable, "-m", "spechead.cli", "serve", "--drafter", "random", "--port", str(port)]
    cmd += ["--max-len", str(MAX_LEN), "--queue-size", str(QUEUE), "--log-level", "warning", "--threads", "1"]
    # a fixed tree: tuning at startup (--tree auto) takes 1,800 AR steps, minutes on the portable kernel path
    cmd += ["--tree", "2x1x4+lookup:8"]
    with open(log, "w") as fh:
        cmd += list(extra)
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    s = Served(proc, port, log)

    def up() -> bool:
        assert proc.poll() is None, f"server exited:\n{log.read_text()}"
        try:
            return s.health()["status"] == "ok"
        except httpx.HTTPError:
            return False

    try:
        wait_until(up, "the server to start", 300)
        yield s
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert "Traceback" not in log.read_text(), log.read_text()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    yield from serve(tmp_path_factory)


@pytest.fixture(scope="module")
def batched_server(tmp_path_factory):
    yield from serve(tmp_path_factory, "--max-batch", "4")


@pytest.fixture(scope="module")
def reference(demo_session):
    """Greedy autoregressive text (and token ids) for a chat prompt or a raw completion prompt."""
    ar = demo_session.decoder()
    cache = {}

    def ref(prompt: str, n: int, raw: bool = False) -> tuple[str, list[int], int]:
        if (prompt, raw) not in cache or cache[prompt, raw][0] < n:  # a longer greedy run has every shorter one
            ids = demo_session.tokenizer(prompt)["input_ids"] if raw else demo_session.encode(prompt)
            cache[prompt, raw] = n, ar.generate(ids, n, speculative=False).tokens, len(ids)
        _, tokens, n_prompt = cache[prompt, raw]
        return demo_session.decode(tokens[:n]), tokens[:n], n_prompt

    return ref


def chat(client, prompt: str, **kw):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], **kw)


def stream_text(stream) -> tuple[str, str | None, dict | None]:
    parts, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for c in chunk.choices:
            parts.append((c.delta.content or "") if hasattr(c, "delta") else (c.text or ""))
            finish = c.finish_reason or finish
    return "".join(parts), finish, usage


# -- text deltas (no model) ------------------------------------------------------------------------
def test_text_stream_holds_back_stop_prefixes_and_partial_characters():
    def dec(ids):
        return "".join("\ufffd" if t == 0 else chr(t) for t in ids)

    ts = TextStream(dec, ["abc"])
    toks = [ord(c) for c in "xa"]
    assert ts.push(toks) == "x"  # "a" could start "abc"
    toks += [ord("b")]
    assert ts.push(toks) == ""
    toks += [ord("d")]
    assert ts.push(toks) == "abd"  # the prefix did not complete: released
    toks += [0]
    assert ts.push(toks) == ""  # an unfinished character waits
    toks[-1] = ord("é")
    assert ts.push(toks) == "é"
    toks += [ord(c) for c in "zab"]
    assert ts.push(toks) == "z"
    toks += [ord("c"), ord("q")]
    assert ts.push(toks) == "" and ts.stopped  # cut at the stop string, which is not emitted
    assert ts.finish(toks) == ""
    assert ts.sent == len("xabdéz")

    ts = TextStream(dec, ["zz", "yx"])  # the earliest occurrence wins, across strings
    assert ts.push([ord(c) for c in "ayxzz"]) == "a" and ts.stopped
    ts = TextStream(dec, [])
    assert ts.push([ord("a"), 0]) == "a" and ts.finish([ord("a"), 0]) == "\ufffd"


# -- the real server -------------------------------------------------------------------------------
def test_models_and_health(server):
    assert [m.id for m in server.client().models.list().data] == [MODEL]
    assert server.health() == {"status": "ok", "model": MODEL, "waiting": 0, "busy": False}


def test_chat_completion_is_greedy_ar_text(server, reference):
    text, tokens, n_prompt = reference(CHAT, N)
    r = chat(server.client(), CHAT, max_tokens=N, temperature=0)
    assert r.choices[0].message.content == text
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("stop" if len(tokens) < N else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, len(tokens))
    assert r.usage.total_tokens == n_prompt + len(tokens)
    assert r.usage.model_extra["tau"] >= 1.0
    assert r.model_extra["spechead"]["head"] == "full"


def test_stream_deltas_equal_non_streamed_text(server, reference):
    text, tokens, n_prompt = reference(CHAT, N)
    client = server.client()
    plain = chat(client, CHAT, max_tokens=N, temperature=0).choices[0].message.content
    chunks = list(chat(client, CHAT, max_tokens=N, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed, finish, usage = stream_text(chunks)
    assert streamed == plain == text
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2  # really incremental
    assert finish == ("stop" if len(tokens) < N else "length")
    assert usage["completion_tokens"] == len(tokens) and usage["prompt_tokens"] == n_prompt
    assert usage["tau"] >= 1.0


def test_completions_endpoint_raw_prompt(server, reference):
    prompt = "The capital of France is"
    text, tokens, n_prompt = reference(prompt, 6, raw=True)
    client = server.client()
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    assert r.choices[0].text == text and r.usage.prompt_tokens == n_prompt
    streamed, finish, _ = stream_text(
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True)
    )
    assert streamed == text and finish == r.choices[0].finish_reason


def test_stop_sequences(server, reference):
    text, _, _ = reference(CHAT, N)
    k = len(text) // 2
    stop = text[k : k + 4]  # likely spans a token boundary
    first = text.find(stop)
    client = server.client()
    r = chat(client, CHAT, max_tokens=N, temperature=0, stop=[stop])
    assert r.choices[0].message.content == text[:first] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < N  # generation really ended early
    streamed, finish, _ = stream_text(chat(client, CHAT, max_tokens=N, temperature=0, stop=stop, stream=True))
    assert (streamed, finish) == (text[:first], "stop")
    early = text[2:5]  # of two stop strings the earliest occurrence wins
    r = chat(client, CHAT, max_tokens=N, temperature=0, stop=[stop, early])
    assert r.choices[0].message.content == text[: text.find(early)]
    r = chat(client, CHAT, max_tokens=N, temperature=0, stop=["\u2603never"])
    assert r.choices[0].message.content == text


def test_head_selection_and_seeded_sampling(server, reference):
    text, _, _ = reference(CHAT, 4)
    client = server.client()
    for extra in ({"spechead": {"head": "full"}}, {"head": "full"}):
        r = chat(client, CHAT, max_tokens=4, temperature=0, extra_body=extra)
        assert r.choices[0].message.content == text and r.model_extra["spechead"]["head"] == "full"
    kw = dict(max_tokens=6, temperature=1.0, top_p=0.95, seed=1234)
    a, b = (chat(client, "Tell me a story.", **kw).choices[0].message.content for _ in range(2))
    assert a == b and a
    # one token, no speculative round: NanoSpec's coverage is NaN, which JSON cannot carry (it was a 500)
    r = chat(client, CHAT, max_tokens=1, temperature=0, extra_body={"head": "nanospec"})
    assert r.choices[0].message.content == reference(CHAT, 1)[0]
    assert r.model_extra["spechead"]["head_stats"]["coverage"] is None


def test_a_job_cancelled_while_it_is_admitted_frees_its_lane(demo_session):
    """The client leaves between the batched worker's admission check and the request joining the batch: its lane
    comes back (it stayed taken, and the worker thread spun on an idle batch)."""
    import asyncio

    from spechead.decoding.sampling import SamplingConfig
    from spechead.decoding.session import resolve_drafter
    from spechead.serve.schema import Params
    from spechead.serve.worker import DecodeWorker, Job

    w = DecodeWorker(demo_session, resolve_drafter("random", demo_session.target), max_batch=1)
    loop = asyncio.new_event_loop()
    leaving, next_one = (Job(Params([1, 2, 3], 4, SamplingConfig(), [], "full", False, False), loop, 60) for _ in "ab")
    build = w._request_head
    w._request_head = lambda spec: (w.cancel(leaving), build(spec))[1]  # the first client leaves meanwhile
    try:
        w.submit(leaving)
        wait_until(leaving.cancelled.is_set, "the first job's admission")
        w._request_head = build
        w.submit(next_one)  # the only lane: it runs only if the first job gave it back
        wait_until(lambda: next_one.done, "the next job to be decoded", limit=60)
        wait_until(lambda: not w.busy, "the worker to be idle")
    finally:
        w.close()
        loop.close()


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "batch1"])
def test_a_reply_ended_by_a_stop_string_reports_its_rounds_tau(demo_session, batched):
    """A stop string ends a reply before the decoder's result exists: the reply reports the mean accept length of
    the speculative rounds run, as a finished reply does, at one lane and at two, and the worker's Retry-After
    estimate learns each request's time in the decoder."""
    import asyncio

    from spechead.decoding.sampling import SamplingConfig
    from spechead.decoding.session import resolve_drafter
    from spechead.decoding.tree import TreeConfig
    from spechead.serve.schema import Params
    from spechead.serve.worker import DecodeWorker, Job

    drafter, tree = resolve_drafter("demo", demo_session.target), TreeConfig(2, 1, 4, lookup=8)
    w = DecodeWorker(demo_session, drafter, tree=tree, max_batch=2 if batched else 1)
    # every round speculative: the guard's choice of AR or lean rounds depends on this CPU's costs
    w.decoder.guard_cfg = None
    w.decoder.guards.clear()
    loop = asyncio.new_event_loop()
    ids = demo_session.encode("Repeat this line four times: red green blue yellow red green blue yellow")

    def run(stop: list[str]) -> tuple[str, object]:
        job = Job(Params(ids, 40, SamplingConfig(), stop, "full", False, False), loop, 120)
        w.submit(job)
        wait_until(lambda: job.done, "the reply", limit=120)
        events = loop.run_until_complete(asyncio.wait_for(_drain(job.events), 5))
        return "".join(p for k, p in events if k == "text"), next(p for k, p in events if k == "done")

    try:
        full, whole = run([])
        assert whole.tau > 1.2  # a repeated line: the lookup branch accepts
        if batched:
            assert w._service_s == pytest.approx(0.8 + 0.2 * whole.decode_s)
        stop = full[len(full) // 2 : len(full) // 2 + 6]
        text, cut = run([stop])
        assert text == full[: full.find(stop)] and cut.finish_reason == "stop"
        assert cut.tau > 1.0  # its own rounds' mean accept length, not the 1.0 of a reply that ran none
    finally:
        w.close()
        loop.close()


async def _drain(queue) -> list:
    """Every event a finished job emitted (its last is ``done``)."""
    out = []
    while not out or out[-1][0] != "done":
        out.append(await queue.get())
    return out


def test_errors_in_openai_format(server):
    client, http = server.client(), server.http
    r = http.post("/v1/chat/completions", content=b'{"model": "x", ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "malformed JSON" in r.json()["error"]["message"]
    assert http.post("/v1/completions", json=[1, 2]).status_code == 400
    msgs = [{"role": "user", "content": "hi"}]
    bad = [
        dict(max_tokens="ten"),
        dict(max_tokens=0),
        dict(temperature=3.0),
        dict(temperature=True),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(stop=5),
        dict(stop=[""]),
        dict(seed="x"),
        dict(max_completion_tokens=0),
        dict(extra_body={"top_k": -2}),
        dict(n=2),
        dict(stream="yes"),
        dict(extra_body={"head": "nope"}),
        dict(extra_body={"head": "full:3"}),  # a known head with an argument it does not take
        dict(extra_body={"spechead": "full"}),
    ]
    for kw in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=msgs, **kw)
        assert e.value.body["type"] == "invalid_request_error", kw
        field = next(iter(kw.get("extra_body", kw)))
        if field in ("max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "head"):
            assert e.value.body["param"] == field and field in e.value.body["message"], (kw, e.value.body)  # options
    for head in ("lowrank:0", "fr:999999"):  # names and options parse; only the weights refuse them
        for stream in (False, True):  # a streamed request too gets its 400 before the stream starts
            body = {"model": MODEL, "messages": msgs, "max_tokens": 2, "stream": stream, "head": head}
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == "head", (head, stream, r.text)
    for messages in (
        [],
        "hi",
        [{"content": "no role"}],
        [{"role": "wizard", "content": "hi"}],
        [{"role": "user", "content": [{"type": "image_url"}]}],
    ):
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", messages
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=msgs)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hello " * MAX_LEN, max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[10**9], max_tokens=4)
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    assert server.health()["status"] == "ok"


def test_full_queue_answers_503_in_order_and_departed_clients_free_their_place(server, reference):
    """One long stream decodes and QUEUE requests wait, the last of them from a client that gives up
    soon; the next request is refused. The quitter leaves the queue at once; closing the stream stops
    the decoder and the queued requests run in arrival order."""
    client = server.client()
    tokens0 = server.metric("spechead_generation_tokens_total")
    cancelled0 = server.metric("spechead_requests_cancelled_total")
    long = chat(client, "Write a long essay about the history of Rome.", max_tokens=400, temperature=0, stream=True)
    wait_until(lambda: server.health()["busy"], "the long request to start")
    done: dict[str, tuple[int, str]] = {}
    prompts = LOAD_PROMPTS[: QUEUE - 1]

    def ask(prompt: str) -> None:
        r = chat(server.client(), prompt, max_tokens=2, temperature=0)
        done[prompt] = r.model_extra["spechead"]["seq"], r.choices[0].message.content

    def quit_early() -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        try:
            httpx.post(server.url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
            done["quitter"] = -1, "answered"
        except httpx.ReadTimeout:
            done["quitter"] = -1, "gave up"

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts] + [threading.Thread(target=quit_early)]
    for i, t in enumerate(threads):
        t.start()
        wait_until(lambda i=i: server.health()["waiting"] == i + 1, "a request to queue")
    with pytest.raises(openai.APIStatusError) as e:
        chat(client, "one too many", max_tokens=2, temperature=0)
    assert e.value.status_code == 503 and e.value.body["code"] == "queue_full"
    assert int(e.value.response.headers["retry-after"]) >= 1
    threads[-1].join(60)
    assert done["quitter"][1] == "gave up"
    wait_until(lambda: server.health()["waiting"] == QUEUE - 1, "the quitter to leave the queue")
    assert server.health()["busy"]  # the long stream is still decoding
    long.close()  # the client goes away mid-stream
    for t in threads:
        t.join(120)
    assert [done[p][1] for p in prompts] == [reference(p, 2)[0] for p in prompts]
    seqs = [done[p][0] for p in prompts]
    assert seqs == list(range(seqs[0], seqs[0] + len(prompts)))  # in arrival order, right after the long one
    wait_until(lambda: not server.health()["busy"], "the server to go idle")
    assert server.metric("spechead_requests_cancelled_total") == cancelled0 + 2
    assert server.metric("spechead_generation_tokens_total") - tokens0 < 400  # the long one was stopped


def test_metrics_exposed(server):
    text = server.http.get("/metrics").text
    for name in (
        "spechead_requests_total",
        "spechead_prompt_tokens_total",
        "spechead_generation_tokens_total",
        "spechead_prefill_seconds_total",
        "spechead_tokens_per_second",
        'spechead_tau{head="full"}',
        "spechead_queue_waiting",
        "spechead_request_seconds_bucket",
    ):
        assert name in text, name
    assert server.metric("spechead_generation_tokens_total") > 0
    assert server.metric("spechead_prefill_seconds_total") > 0
    assert 'status="503"' in text and 'status="400"' in text


def test_time_limit(demo_session):
    """An in-process server with a 1 ms limit: every request overruns it (prefill alone takes longer)."""
    import uvicorn

    from spechead.decoding.session import resolve_drafter
    from spechead.serve.app import create_app
    from spechead.serve.worker import DecodeWorker

    worker = DecodeWorker(demo_session, resolve_drafter("random", demo_session.target), timeout=0.001)
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(create_app(worker), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: srv.started, "the in-process server")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.APIStatusError) as e:
            chat(client, CHAT, max_tokens=24, temperature=0)
        assert e.value.status_code == 504 and e.value.body["type"] == "timeout_error"
        with pytest.raises(openai.APIError, match="time limit"):
            stream_text(chat(client, CHAT, max_tokens=24, temperature=0, stream=True))
        wait_until(lambda: not worker.busy, "the decoder to stop")
    finally:
        srv.should_exit = True
        thread.join(30)
        worker.close()


def test_load_32_requests_8_clients(server, reference):
    """32 requests from 8 concurrent clients (non-streamed, streamed, and streams dropped after two
    deltas): every completed answer is the greedy AR text, every refusal is a 503, memory comes back
    and the server still answers. Prints throughput and latency percentiles."""
    n_tokens, modes = 6, ["json", "stream", "drop", "json"]
    refs = {p: reference(p, n_tokens)[0] for p in LOAD_PROMPTS}
    warm = server.client()  # warm both paths before the memory baseline
    chat(warm, LOAD_PROMPTS[0], max_tokens=2, temperature=0)
    stream_text(chat(warm, LOAD_PROMPTS[1], max_tokens=2, temperature=0, stream=True))
    wait_until(lambda: not server.health()["busy"], "idle")
    rss0 = server.rss_mib()
    results, lock = [], threading.Lock()

    def run_client(c: int) -> None:
        client = server.client()
        for r in range(4):
            prompt, mode = LOAD_PROMPTS[(c + r) % 4], modes[(c + 3 * r) % 4]
            t0 = time.perf_counter()
            text, outcome = None, "ok"
            try:
                if mode == "json":
                    text = chat(client, prompt, max_tokens=n_tokens, temperature=0).choices[0].message.content
                elif mode == "stream":
                    text = stream_text(chat(client, prompt, max_tokens=n_tokens, temperature=0, stream=True))[0]
                else:
                    stream, seen = chat(client, prompt, max_tokens=n_tokens, temperature=0, stream=True), 0
                    for chunk in stream:
                        seen += bool(chunk.choices and chunk.choices[0].delta.content)
                        if seen == 2:
                            break
                    stream.close()
                    outcome = "dropped"
            except openai.APIStatusError as e:
                outcome = f"http {e.status_code}"
                time.sleep(1.0)  # a polite client backs off (the server's Retry-After is >= 1 s)
            with lock:
                results.append((prompt, mode, outcome, text, time.perf_counter() - t0))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(run_client, range(8)))
    wall = time.perf_counter() - t0

    assert len(results) == 32
    outcomes = [o for _, _, o, _, _ in results]
    assert set(outcomes) <= {"ok", "dropped", "http 503"}, outcomes
    completed = [(p, t, lat) for p, _, o, t, lat in results if o == "ok"]
    assert completed and all(t == refs[p] for p, t, _ in completed)
    wait_until(lambda: server.health() == {"status": "ok", "model": MODEL, "waiting": 0, "busy": False}, "idle")
    rss1 = server.rss_mib()
    assert rss1 - rss0 < 64, (rss0, rss1)
    assert (
        chat(warm, LOAD_PROMPTS[0], max_tokens=n_tokens, temperature=0).choices[0].message.content
        == refs[LOAD_PROMPTS[0]]
    )

    lat = sorted(x for _, _, x in completed)

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, round(q * (len(lat) - 1)))]

    summary = {
        "requests": 32,
        "clients": 8,
        "max_tokens": n_tokens,
        "completed": len(completed),
        "dropped": outcomes.count("dropped"),
        "rejected_503": outcomes.count("http 503"),
        "wall_s": round(wall, 2),
        "completed_per_s": round(len(completed) / wall, 3),
        "latency_s": {"p50": round(pct(0.5), 2), "p90": round(pct(0.9), 2), "p99": round(pct(0.99), 2)},
        "rss_mib": {"before": round(rss0), "after": round(rss1)},
    }
    print("\nload test:", json.dumps(summary))


def test_batched_server_concurrent_clients(batched_server, reference):
    """--max-batch 4: twelve requests from six concurrent clients (non-streamed, streamed, dropped after two
    deltas, a stop string, a per-request NanoSpec head): every completed answer is the greedy AR text, the
    rounds held several requests at once, nothing is lost, memory comes back and the server goes idle."""
    server, n_tokens = batched_server, 6
    refs = {p: reference(p, n_tokens)[0] for p in LOAD_PROMPTS}
    warm = server.client()
    assert (
        chat(warm, LOAD_PROMPTS[0], max_tokens=n_tokens, temperature=0).choices[0].message.content
        == refs[LOAD_PROMPTS[0]]
    )
    wait_until(lambda: not server.health()["busy"], "idle")
    rss0 = server.rss_mib()
    results, lock = [], threading.Lock()
    modes = ["json", "stream", "drop", "stop", "nanospec", "json"]

    def run_client(c: int) -> None:
        client = server.client()
        for r in range(2):
            prompt, mode = LOAD_PROMPTS[(c + r) % 4], modes[(c + r) % len(modes)]
            outcome, text, want = "ok", None, refs[prompt]
            kw = dict(max_tokens=n_tokens, temperature=0)
            try:
                if mode == "json":
                    text = chat(client, prompt, **kw).choices[0].message.content
                elif mode == "nanospec":
                    text = chat(client, prompt, **kw, extra_body={"head": "nanospec"}).choices[0].message.content
                elif mode == "stop":
                    stop = want[2:4]
                    want = want[: want.find(stop)]
                    text = chat(client, prompt, **kw, stop=[stop]).choices[0].message.content
                elif mode == "stream":
                    text = stream_text(chat(client, prompt, **kw, stream=True))[0]
                else:
                    stream, seen = chat(client, prompt, **kw, stream=True), 0
                    for chunk in stream:
                        seen += bool(chunk.choices and chunk.choices[0].delta.content)
                        if seen == 2:
                            break
                    stream.close()
                    outcome = "dropped"
            except openai.APIStatusError as e:
                outcome = f"http {e.status_code}"
            with lock:
                results.append((mode, outcome, text, want))

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(run_client, range(6)))
    assert len(results) == 12
    assert {o for _, o, _, _ in results} <= {"ok", "dropped"}, results  # 6 clients fit 4 lanes + a queue of 4
    assert all(text == want for _, o, text, want in results if o == "ok"), results
    wait_until(lambda: server.health() == {"status": "ok", "model": MODEL, "waiting": 0, "busy": False}, "idle")
    assert server.rss_mib() - rss0 < 64
    text = server.http.get("/metrics").text
    assert "spechead_batch_occupancy" in text and "spechead_request_tokens_per_second_count" in text
    assert server.metric("spechead_request_tokens_per_second_count") >= 10
    rounds = server.metric("spechead_batch_rounds_total")
    assert server.metric("spechead_batch_request_rounds_total") / rounds > 1.5  # rounds really were shared
    assert server.metric("spechead_prefill_seconds_total") > 0
