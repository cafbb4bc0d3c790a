"""``retrofit serve`` driven over HTTP on 127.0.0.1 by the real ``openai`` client.

Robustness: 64 concurrent clients (greedy answers equal generate() alone), a streaming client that
disconnects frees its rows and KV blocks, bad requests get a 4xx JSON error and the server keeps
serving, requests wait in the queue when the KV budget is full, and the ``retrofit serve`` process
(on an export folder) shuts down cleanly on SIGTERM.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from retrofit import LoopConfig, convert
from retrofit.serving import Engine
from retrofit.serving.server import create_app
from retrofit.testing import char_tokenizer, tiny_base

TOK = char_tokenizer()
NAME = "tiny-looped"


def looped(method="tah2", head_seed=2):
    model = convert(tiny_base("llama", seed=0), LoopConfig(prelude=1, core=3, max_depth=3, method=method))
    g = torch.Generator().manual_seed(head_seed)
    with torch.no_grad():
        for mod in (model.updater, model.halting):
            for p in mod.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model.eval()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """uvicorn serving an engine in a background thread of this process."""

    def __init__(self, engine):
        self.engine = engine
        self.port = free_port()
        cfg = uvicorn.Config(create_app(engine, TOK, NAME), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.port}/v1"

    def client(self, **kw):
        return openai.OpenAI(base_url=self.base_url, api_key="none", max_retries=0, timeout=120, **kw)

    def raw(self, method, path, body: bytes | None = None):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        data = r.read()
        conn.close()
        return r.status, data

    def metrics(self) -> dict[str, float]:
        status, data = self.raw("GET", "/metrics")
        assert status == 200
        out = {}
        for line in data.decode().splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out


def reference(model, prompt_ids, n):
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="module")
def model():
    return looped()


@pytest.fixture(scope="module")
def server(model):
    eng = Engine(model, TOK, max_seqs=16, max_model_len=96, kv_budget_bytes=16 << 20)
    with Server(eng) as s:
        yield s


def test_models_health_metrics(server):
    c = server.client()
    assert [m.id for m in c.models.list().data] == [NAME]
    assert server.raw("GET", "/health") == (200, b'{"status":"ok"}')
    m = server.metrics()
    for k in (
        "retrofit_queue_length",
        "retrofit_tokens_per_second",
        "retrofit_mean_depth",
        "retrofit_kv_blocks_in_use",
        "retrofit_running_requests",
    ):
        assert k in m


def test_64_concurrent_clients_get_their_own_greedy_answers(server, model):
    prompts = ["hello world", "hi", "abc def g", "x", "the quick brown fox", "12 + 7 =", "looped", "q"]
    want = {}
    for p in prompts:
        text = TOK.decode(reference(model, TOK(p).input_ids, 8), skip_special_tokens=True)
        want[p] = text
    chat_prompt = TOK.apply_chat_template(
        [{"role": "user", "content": "hey"}], add_generation_prompt=True, tokenize=False
    )
    chat_want = TOK.decode(
        reference(model, TOK(chat_prompt, add_special_tokens=False).input_ids, 8), skip_special_tokens=True
    )

    async def main():
        c = openai.AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)

        async def one(i):
            p = prompts[i % len(prompts)]
            if i % 8 == 7:
                r = await c.chat.completions.create(
                    model=NAME, messages=[{"role": "user", "content": "hey"}], max_tokens=8, temperature=0
                )
                return "chat", r.choices[0].message.content, r.usage
            if i % 4 == 1:
                stream = await c.completions.create(model=NAME, prompt=p, max_tokens=8, temperature=0, stream=True)
                text, usage = "", None
                async for ch in stream:
                    if ch.choices:
                        text += ch.choices[0].text
                    usage = getattr(ch, "usage", None) or usage
                return p, text, usage
            r = await c.completions.create(
                model=NAME, prompt=p, max_tokens=8, temperature=0, extra_body={"top_k": 5}
            )  # greedy: top_k changes nothing
            return p, r.choices[0].text, r.usage

        res = await asyncio.gather(*(one(i) for i in range(64)))
        await c.close()
        return res

    results = asyncio.run(main())
    assert len(results) == 64
    for p, text, usage in results:
        assert text == (chat_want if p == "chat" else want[p]), p
        u = usage if isinstance(usage, dict) else usage.model_dump()
        assert u["completion_tokens"] >= 1 and 1.0 <= u["mean_depth"] <= 3.0 and u["flops"] > 0
    m = server.metrics()
    assert m["retrofit_kv_blocks_in_use"] == 0 and m["retrofit_running_requests"] == 0


def test_streaming_client_that_disconnects_frees_its_blocks(server):
    c = server.client()
    stream = c.completions.create(
        model=NAME, prompt="hello", max_tokens=80, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    for got, _ in enumerate(stream, 1):
        if got == 2:
            break
    assert server.metrics()["retrofit_kv_blocks_in_use"] > 0  # still generating
    stream.close()
    deadline = time.time() + 60
    while True:
        m = server.metrics()
        if m["retrofit_kv_blocks_in_use"] == 0 and m["retrofit_running_requests"] == 0:
            break
        assert time.time() < deadline, f"blocks not freed after the client left: {m}"
        time.sleep(0.1)
    # and the server keeps serving
    r = c.completions.create(model=NAME, prompt="hi", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3


def test_bad_requests_get_4xx_json_and_the_server_keeps_serving(server):
    c = server.client()
    cases = [
        (b"{not json", 400),
        (json.dumps({"model": "nope", "prompt": "hi"}).encode(), 404),
        (json.dumps({"model": NAME, "prompt": "hi", "max_tokens": 0}).encode(), 400),
        (json.dumps({"model": NAME, "prompt": "hi", "max_tokens": -3}).encode(), 400),
        (json.dumps({"model": NAME, "prompt": "x" * 200, "max_tokens": 4}).encode(), 400),  # > 96-token context
        (json.dumps({"model": NAME, "prompt": 123}).encode(), 400),
        (json.dumps({"model": NAME, "prompt": {"a": 1}}).encode(), 400),
        (json.dumps({"model": NAME, "prompt": "hi", "temperature": "hot"}).encode(), 400),
        (json.dumps({"model": NAME, "prompt": "hi", "depth": 9}).encode(), 400),
        (json.dumps([1, 2]).encode(), 400),
    ]
    for body, status in cases:
        got, data = server.raw("POST", "/v1/completions", body)
        assert got == status, (body, got, data)
        err = json.loads(data)["error"]
        assert err["message"] and err["type"] == "invalid_request_error"
        r = c.completions.create(model=NAME, prompt="hi", max_tokens=2, temperature=0)
        assert r.usage.completion_tokens == 2
    got, data = server.raw("POST", "/v1/chat/completions", json.dumps({"model": NAME, "messages": "hi"}).encode())
    assert got == 400 and "messages" in json.loads(data)["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="other", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        c.completions.create(model=NAME, prompt="hi", max_tokens=0)


def test_requests_wait_in_the_queue_when_the_kv_budget_is_full(model):
    probe = Engine(model, TOK, max_seqs=8, max_model_len=48, kv_budget_bytes=8 << 20)
    need = probe.kv.worst_case(48, readout=True)
    one = sum(n * probe.kv.pools[p].bytes_per_block for p, n in need.items())
    eng = Engine(model, TOK, max_seqs=8, max_model_len=48, kv_budget_bytes=int(1.5 * one))
    seen = {"queue": 0, "running": 0}
    step = eng.step

    def watched():
        out = step()
        seen["queue"] = max(seen["queue"], len(eng.waiting))
        seen["running"] = max(seen["running"], len(eng.seqs))
        return out

    eng.step = watched
    with Server(eng) as s:

        async def main():
            c = openai.AsyncOpenAI(base_url=s.base_url, api_key="none", max_retries=0, timeout=300)
            rs = await asyncio.gather(
                *(c.completions.create(model=NAME, prompt=f"hi {i}", max_tokens=30, temperature=0) for i in range(4))
            )
            await c.close()
            return rs

        rs = asyncio.run(main())
    assert all(r.usage.completion_tokens >= 1 for r in rs)
    assert seen["running"] == 1 and seen["queue"] >= 1


def test_sigterm_shuts_down_an_export_folder_server_cleanly(tmp_path, model):
    from retrofit.hub.export import export_model

    folder = export_model(model, tmp_path / "export", tokenizer=TOK)
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "retrofit.cli",
            "serve",
            str(folder),
            "--port",
            str(port),
            "--served-model-name",
            NAME,
            "--max-model-len",
            "64",
            "--kv-budget-mb",
            "4",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
    )
    try:
        deadline = time.time() + 240
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            assert time.time() < deadline, "server did not come up"
            time.sleep(0.5)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        r = c.completions.create(model=NAME, prompt="hello", max_tokens=5, temperature=0)
        assert r.choices[0].text == TOK.decode(reference(model, TOK("hello").input_ids, 5), skip_special_tokens=True)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
        log = proc.stdout.read()
        assert rc == 0, log
        assert "Shutting down" in log or "shutdown" in log.lower()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_base_model_is_served_at_depth_one():
    from retrofit.serving.cli import load_for_serving

    model, _ = load_for_serving("tiny-llama")
    assert model.loop.max_depth == 1 and model.loop.prelude == 0
    base = tiny_base("llama")
    ids = torch.tensor([TOK("hello").input_ids])
    assert torch.equal(
        model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0),
        base.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0),
    )
