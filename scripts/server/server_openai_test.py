#!/usr/bin/env python3
"""Drive `kiln serve` with the official `openai` Python client.

    python3 scripts/server/server_openai_test.py [--kiln target/release/kiln] [--model PATH]
                                          [--backend NAME] [--venv DIR]
                                          [--base-url URL --api-key KEY]

Makes a virtual environment (--venv, default target/server-openai-venv), installs `openai`
into it, and re-runs itself there. Unless --base-url is given it starts
`kiln serve --host 127.0.0.1 --port 0` (with --model, else kiln's default model) with an
API key and a small queue, and checks: /v1/models; chat and completions with usage and
finish_reason; streaming with and without `stream_options.include_usage`; stop strings;
seed reproducibility; logprobs (chat and completions); the errors (malformed JSON, wrong
types, unknown model, context_length_exceeded, 413, 401, 429 with Retry-After, n != 1);
/metrics afterwards (nothing running, every slot free); SIGTERM and a clean exit.

With --base-url the checks run against a server already running (kiln or another
OpenAI-compatible one); the kiln-specific ones (401 with a wrong key, 429 from a full
queue, /metrics, shutdown) are left out.

Exit status: 0 all checks passed, 1 a check failed, 3 the environment lacks something
(no venv/pip, or the package index cannot be reached) -- reported as a skip.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NO_EOS = {"0": -100, "1": -100, "2": -100}  # <|endoftext|>, <|im_start|>, <|im_end|> in SmolLM2


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kiln", default=os.path.join(ROOT, "target", "release", "kiln"))
    p.add_argument("--model", default=None, help="model file (default: kiln's default model)")
    p.add_argument("--backend", default=None, help="kiln serve --backend (default: the best-scoring one)")
    p.add_argument("--venv", default=os.path.join(ROOT, "target", "server-openai-venv"))
    p.add_argument("--base-url", default=None, help="test a running server, e.g. http://127.0.0.1:8080/v1")
    p.add_argument("--api-key", default="sk-no-key")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


# ------------------------------------------------------------------------------------------
# Outer stage: the venv.

def outer(args):
    py = os.path.join(args.venv, "bin", "python")
    if not os.path.exists(py):
        r = subprocess.run([sys.executable, "-m", "venv", args.venv], capture_output=True, text=True)
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"skip: python3 -m venv failed ({last[-300:]})")
            return 3
    has = subprocess.run([py, "-c", "import openai, jsonschema"], capture_output=True).returncode == 0
    if not has:
        r = subprocess.run(
            [py, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--retries", "2", "--timeout", "30", "openai>=1.40", "jsonschema"],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"skip: pip could not install openai ({last[-300:]})")
            return 3
    argv = [py, os.path.abspath(__file__), "--inner", "--kiln", args.kiln, "--venv", args.venv, "--api-key", args.api_key]
    if args.model:
        argv += ["--model", args.model]
    if args.backend:
        argv += ["--backend", args.backend]
    if args.base_url:
        argv += ["--base-url", args.base_url]
    return subprocess.run(argv).returncode


# ------------------------------------------------------------------------------------------
# Inner stage: the checks.

class Server:
    """`kiln serve` on 127.0.0.1 at a free port."""

    def __init__(self, kiln, model, extra):
        cmd = [kiln, "serve", "--host", "127.0.0.1", "--port", "0"] + extra
        if model:
            cmd += ["-m", model]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.log = []
        self.addr = None
        found = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.log.append(line.rstrip("\n"))
                m = re.match(r"kiln serve: listening on (http://\S+)", line)
                if m:
                    self.addr = m.group(1)
                    found.set()
            found.set()

        threading.Thread(target=read, daemon=True).start()
        if not found.wait(120) or not self.addr:
            self.stop()
            raise RuntimeError("kiln serve did not start:\n" + "\n".join(self.log))
        deadline = time.time() + 600  # the default model may be fetched first
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(self.addr + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except Exception:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError("kiln serve exited:\n" + "\n".join(self.log))
            time.sleep(0.1)
        raise RuntimeError("the model did not load")

    def metrics(self):
        with urllib.request.urlopen(self.addr + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                k, _, v = line.rpartition(" ")
                out[k] = float(v)
        return out

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return self.proc.wait()
        return self.proc.returncode


class Checks:
    def __init__(self):
        self.passed = 0
        self.failed = []

    def run(self, name, fn):
        try:
            fn()
            self.passed += 1
            print(f"ok: {name}", flush=True)
        except Exception as e:  # noqa: BLE001 -- every failure is reported, then the run goes on
            self.failed.append(name)
            print(f"FAIL: {name}: {type(e).__name__}: {e}", flush=True)


def expect(cond, msg):
    if not cond:
        raise AssertionError(msg)


def expect_error(fn, cls, status, code=None, param=None):
    import openai

    try:
        fn()
    except cls as e:
        expect(e.status_code == status, f"status {e.status_code}, wanted {status}")
        body = e.body if isinstance(e.body, dict) else {}
        # The client unwraps {"error": {...}} into e.body.
        err = body.get("error", body)
        expect(isinstance(err.get("message"), str), f"an OpenAI error body: {e.body}")
        if code is not None:
            expect(e.code == code or err.get("code") == code, f"code {e.code!r}, wanted {code!r}")
        if param is not None:
            expect(e.param == param or err.get("param") == param, f"param {e.param!r}, wanted {param!r}")
        return e
    except openai.APIStatusError as e:
        raise AssertionError(f"{type(e).__name__} {e.status_code}, wanted {cls.__name__} {status}: {e.body}")
    raise AssertionError(f"no error, wanted {cls.__name__} {status}")


def inner(args):
    import openai

    server = None
    kiln_checks = args.base_url is None
    if kiln_checks:
        key = "sk-kiln-test"
        extra = ["--api-key", key, "--max-seqs", "2", "--queue", "1", "-c", "1024", "--shutdown-grace", "2"]
        if args.backend:
            extra += ["--backend", args.backend]
        server = Server(args.kiln, args.model, extra)
        base = server.addr + "/v1"
    else:
        key = args.api_key
        base = args.base_url.rstrip("/")
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=120)
    checks = Checks()
    state = {}

    def models():
        ms = client.models.list()
        ids = [m.id for m in ms.data]
        expect(len(ids) >= 1, ids)
        state["model"] = ids[0]
        if args.model:
            stem = os.path.splitext(os.path.basename(args.model))[0]
            expect(ids[0] == stem, f"{ids[0]} != {stem}")

    checks.run("models.list", models)
    model = state.get("model", "default")
    user = [{"role": "user", "content": "What is 2+2?"}]

    def chat():
        r = client.chat.completions.create(model=model, messages=user, max_tokens=3, temperature=0)
        c = r.choices[0]
        expect(r.object == "chat.completion" and r.id.startswith("chatcmpl-"), r)
        expect(c.message.role == "assistant" and isinstance(c.message.content, str), c)
        expect(c.finish_reason == "length", c.finish_reason)
        u = r.usage
        expect(u.completion_tokens == 3 and u.prompt_tokens > 0 and u.total_tokens == u.prompt_tokens + 3, u)
        state["chat_text"] = c.message.content

    checks.run("chat.completions", chat)

    def completions():
        r = client.completions.create(model=model, prompt="The capital of France is", max_tokens=3, temperature=0)
        c = r.choices[0]
        expect(r.object == "text_completion", r.object)
        expect(c.finish_reason == "length" and r.usage.completion_tokens == 3, r)
        state["greedy"] = c.text

    checks.run("completions", completions)

    def stream_chat():
        chunks = list(client.chat.completions.create(model=model, messages=user, max_tokens=3, temperature=0, stream=True))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
        expect(chunks[0].choices[0].delta.role == "assistant", chunks[0])
        expect(finish == ["length"], finish)
        expect(text == state.get("chat_text"), f"{text!r} != {state.get('chat_text')!r}")
        expect(all(getattr(ch, "usage", None) is None for ch in chunks), "no usage without include_usage")

    checks.run("streaming chat without usage", stream_chat)

    def stream_usage():
        chunks = list(client.completions.create(
            model=model, prompt="The capital of France is", max_tokens=3, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        last = chunks[-1]
        expect(last.choices == [] and last.usage is not None, last)
        expect(last.usage.completion_tokens == 3, last.usage)
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        expect(text == state.get("greedy"), f"{text!r} != {state.get('greedy')!r}")

    checks.run("streaming completions with usage", stream_usage)

    def stop_strings():
        kw = dict(model=model, prompt="The capital of France is", max_tokens=12, temperature=0, logit_bias=NO_EOS)
        full = client.completions.create(**kw).choices[0].text
        expect(len(full) >= 4, repr(full))
        stop = full[len(full) // 2:][:2]
        cut = full[:full.index(stop)]
        r = client.completions.create(stop=["never-there", stop], **kw)
        expect(r.choices[0].text == cut and r.choices[0].finish_reason == "stop", f"{r.choices[0]} vs {cut!r}")
        chunks = list(client.completions.create(stop=stop, stream=True, **kw))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        expect(text == cut, f"{text!r} != {cut!r}")

    checks.run("stop strings", stop_strings)

    def seeds():
        kw = dict(model=model, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=16, temperature=0.8, seed=4242)
        a = client.chat.completions.create(**kw).choices[0].message.content
        b = client.chat.completions.create(**kw).choices[0].message.content
        expect(a == b and a, f"{a!r} != {b!r}")

    checks.run("seed reproducibility", seeds)

    def logprobs():
        r = client.chat.completions.create(model=model, messages=user, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
        content = r.choices[0].logprobs.content
        expect(len(content) == r.usage.completion_tokens, f"{len(content)} entries")
        for e in content:
            expect(e.logprob <= 0 and len(e.top_logprobs) == 2, e)
            expect(abs(e.top_logprobs[0].logprob - e.logprob) < 1e-5, f"greedy takes the top token: {e}")
        r = client.completions.create(model=model, prompt="Hello", max_tokens=3, temperature=0, logprobs=2)
        lp = r.choices[0].logprobs
        expect(len(lp.tokens) == 3 and all(x <= 0 for x in lp.token_logprobs), lp)
        expect(all(len(t) == 2 for t in lp.top_logprobs), lp.top_logprobs)

    checks.run("logprobs", logprobs)

    def embeddings():
        r = client.embeddings.create(model=model, input=["The cat sat on the mat.", "Stock markets fell."])
        expect(len(r.data) == 2 and r.usage.prompt_tokens > 0, r)
        for d in r.data:
            norm = sum(x * x for x in d.embedding) ** 0.5
            expect(abs(norm - 1.0) < 1e-4, f"unit length: {norm}")
        # The client asks for base64 by default and decodes it; floats on request agree.
        f = client.embeddings.create(model=model, input="The cat sat on the mat.", encoding_format="float")
        expect(max(abs(a - b) for a, b in zip(f.data[0].embedding, r.data[0].embedding)) < 1e-6, "float = base64")

    checks.run("embeddings", embeddings)

    def several_choices():
        r = client.chat.completions.create(model=model, messages=user, n=3, max_tokens=4, temperature=0.9, seed=5)
        expect([c.index for c in r.choices] == [0, 1, 2], r.choices)
        expect(0 < r.usage.completion_tokens <= 12, r.usage)
        single = client.chat.completions.create(model=model, messages=user, max_tokens=4, temperature=0.9, seed=5)
        expect(r.usage.prompt_tokens == single.usage.prompt_tokens, f"{r.usage} vs {single.usage}")
        expect(r.choices[0].message.content == single.choices[0].message.content, "choice 0 is the request's seed")

    checks.run("n: several choices", several_choices)

    def errors():
        expect_error(lambda: client.chat.completions.create(model=model, messages=user, temperature=5),
                     openai.BadRequestError, 400, param="temperature")
        expect_error(lambda: client.chat.completions.create(model=model, messages=user, max_tokens=-1),
                     openai.BadRequestError, 400, param="max_tokens")
        expect_error(lambda: client.chat.completions.create(model=model, messages=user, n=17),
                     openai.BadRequestError, 400, param="n")
        expect_error(lambda: client.chat.completions.create(model="gpt-4o", messages=user),
                     openai.NotFoundError, 404, code="model_not_found")
        expect_error(lambda: client.completions.create(model=model, prompt="hi", max_tokens=50_000),
                     openai.BadRequestError, 400, code="context_length_exceeded")
        expect_error(lambda: client.completions.create(model=model, prompt="word " * 3000, max_tokens=1),
                     openai.BadRequestError, 400, code="context_length_exceeded")
        expect_error(lambda: client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x" * (5 << 20)}]),
                     openai.APIStatusError, 413)
        # Malformed JSON cannot be sent through the client: a raw request.
        req = urllib.request.Request(base + "/chat/completions", data=b'{"messages": [', method="POST",
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=30)
            raise AssertionError("malformed JSON was accepted")
        except urllib.error.HTTPError as e:
            body = json.loads(e.read())
            expect(e.code == 400 and isinstance(body["error"]["message"], str), body)

    checks.run("errors: 400 / 404 / 413 / context_length_exceeded", errors)

    def structured_output():
        schema = {"type": "object", "additionalProperties": False, "required": ["city", "population"],
                  "properties": {"city": {"type": "string", "maxLength": 24},
                                 "population": {"type": "integer", "minimum": 0, "maximum": 100000000}}}
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Name a big city and its population."}],
            max_tokens=64, temperature=0.7, seed=11,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}})
        c = r.choices[0]
        expect(c.finish_reason == "stop", c)
        value = json.loads(c.message.content)
        expect(sorted(value) == ["city", "population"] and isinstance(value["population"], int), value)

    checks.run("structured output: response_format json_schema", structured_output)

    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                       "properties": {"city": {"type": "string", "maxLength": 40},
                                      "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
    add = {"type": "function", "function": {
        "name": "add", "description": "Adds two integers",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                       "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
    offered = [weather, add]
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]

    def valid_call(call, name=None):
        schema = next(t["function"]["parameters"] for t in offered if t["function"]["name"] == call.function.name)
        expect(name is None or call.function.name == name, call)
        args = json.loads(call.function.arguments)
        try:
            import jsonschema
            jsonschema.validate(args, schema)
        except ImportError:
            expect(sorted(args) == sorted(schema["required"]), args)
        return args

    def tools_required():
        for seed in range(4):
            r = client.chat.completions.create(model=model, messages=ask, tools=offered, tool_choice="required",
                                               parallel_tool_calls=False, max_tokens=96, temperature=1.0, seed=seed)
            c = r.choices[0]
            expect(c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, c)
            valid_call(c.message.tool_calls[0])

    checks.run("tools: tool_choice required gives schema-valid calls (4 seeds, temperature 1)", tools_required)

    def tools_named():
        for seed in range(3):
            r = client.chat.completions.create(model=model, messages=ask, tools=offered, max_tokens=96, seed=seed,
                                               tool_choice={"type": "function", "function": {"name": "add"}},
                                               temperature=1.0)
            for call in r.choices[0].message.tool_calls:
                valid_call(call, "add")

    checks.run("tools: a named tool_choice calls that function", tools_named)

    def tools_streamed():
        kw = dict(model=model, messages=ask, tools=offered, tool_choice="required", parallel_tool_calls=False,
                  max_tokens=96, temperature=0.7, seed=21)
        whole = client.chat.completions.create(**kw).choices[0]
        calls, content, finish = {}, "", None
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                d = c.delta
                content += d.content or ""
                for tc in d.tool_calls or []:
                    e = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                    e["id"] += tc.id or ""
                    e["name"] += (tc.function.name or "") if tc.function else ""
                    e["arguments"] += (tc.function.arguments or "") if tc.function else ""
                finish = c.finish_reason or finish
        expect(finish == whole.finish_reason == "tool_calls", (finish, whole.finish_reason))
        expect((content or None) == whole.message.content, (content, whole.message.content))
        got = [(calls[k]["name"], json.loads(calls[k]["arguments"])) for k in sorted(calls)]
        want = [(t.function.name, json.loads(t.function.arguments)) for t in whole.message.tool_calls]
        expect(got == want, (got, want))

    checks.run("tools: streamed deltas reassemble to the unstreamed answer", tools_streamed)

    def tools_loop():
        first = client.chat.completions.create(model=model, messages=ask, tools=offered, tool_choice="required",
                                               parallel_tool_calls=False, max_tokens=96, temperature=0.0)
        call = first.choices[0].message.tool_calls[0]
        history = ask + [first.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})}]
        answer = client.chat.completions.create(model=model, messages=history, tools=offered, tool_choice="none",
                                                max_tokens=32, temperature=0.0)
        c = answer.choices[0]
        expect(c.finish_reason in ("stop", "length") and c.message.content and not c.message.tool_calls, c)
        # A tool result without the call it answers is refused.
        expect_error(lambda: client.chat.completions.create(
            model=model, messages=ask + [{"role": "tool", "tool_call_id": "call_nope", "content": "18"}], tools=offered),
            openai.BadRequestError, 400, param="messages[1].tool_call_id")

    checks.run("tools: call, tool result, answer", tools_loop)

    def tools_errors():
        many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(200)]
        expect_error(lambda: client.chat.completions.create(model=model, messages=ask, tools=many),
                     openai.BadRequestError, 400, param="tools")
        bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
               "properties": {"x": {"type": "no-such-type"}}}}}
        expect_error(lambda: client.chat.completions.create(model=model, messages=ask, tools=[bad], tool_choice="required"),
                     openai.BadRequestError, 400, param="tools")
        expect_error(lambda: client.chat.completions.create(model=model, messages=ask, tools=offered,
                                                            tool_choice={"type": "function", "function": {"name": "nope"}}),
                     openai.BadRequestError, 400, param="tool_choice")

    checks.run("tools: bad tools are 400s", tools_errors)

    if kiln_checks:
        def prompt_cache():
            # A conversation's second turn continues the first turn's kept sequence: the
            # client reads the reused tokens from usage.prompt_tokens_details.
            conv = [{"role": "user", "content": "List three colours of the rainbow, then say why the sky is blue."}]
            first = client.chat.completions.create(model=model, messages=conv, max_tokens=8, temperature=0)
            conv += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And why are sunsets red?"}]
            second = client.chat.completions.create(model=model, messages=conv, max_tokens=8, temperature=0)
            cached = second.usage.prompt_tokens_details.cached_tokens
            expect(first.usage.prompt_tokens <= cached < second.usage.prompt_tokens,
                   f"{cached} cached of {second.usage.prompt_tokens}; first turn {first.usage.prompt_tokens}")
            fresh = client.chat.completions.create(model=model, messages=conv, max_tokens=8, temperature=0,
                                                   extra_body={"cache_prompt": False})
            expect(fresh.usage.prompt_tokens_details.cached_tokens == 0, fresh.usage)

        checks.run("prompt cache: cached_tokens on a second turn", prompt_cache)

        def auth():
            bad = openai.OpenAI(base_url=base, api_key="wrong", max_retries=0)
            expect_error(lambda: bad.models.list(), openai.AuthenticationError, 401, code="invalid_api_key")
            expect_error(lambda: bad.chat.completions.create(model=model, messages=user), openai.AuthenticationError, 401)

        checks.run("errors: 401", auth)

        def queue_full():
            kw = dict(model=model, prompt="Once upon a time", max_tokens=900, temperature=0.8, logit_bias=NO_EOS, stream=True)
            streams = []
            try:
                # Two run (--max-seqs 2), one waits (--queue 1) ...
                for _ in range(2):
                    s = client.completions.create(**kw)
                    next(iter(s))
                    streams.append(s)
                streams.append(client.completions.create(**kw))
                deadline = time.time() + 10
                while server.metrics().get("kiln_queue_depth") != 1 and time.time() < deadline:
                    time.sleep(0.01)
                # ... and the next finds the queue full.
                e = expect_error(lambda: client.completions.create(model=model, prompt="hi", max_tokens=1),
                                 openai.RateLimitError, 429, code="queue_full")
                expect("retry-after" in e.response.headers, dict(e.response.headers))
            finally:
                for s in streams:
                    s.close()
            deadline = time.time() + 10
            while time.time() < deadline:
                m = server.metrics()
                if m["kiln_running_sequences"] == 0 and m["kiln_queue_depth"] == 0:
                    break
                time.sleep(0.02)
            expect(m["kiln_running_sequences"] == 0 and m["kiln_kv_slots_free"] == m["kiln_kv_slots_total"], m)

        checks.run("errors: 429 with Retry-After; closed streams free their slots", queue_full)

        def metrics():
            m = server.metrics()
            expect(m["kiln_running_sequences"] == 0 and m["kiln_queue_depth"] == 0, m)
            expect(m["kiln_kv_slots_used"] == 0 and m["kiln_kv_slots_free"] == 2, m)
            expect(m["kiln_time_to_first_token_seconds_count"] > 0, m)

        checks.run("metrics afterwards", metrics)

        def shutdown():
            code = server.stop()
            expect(code == 0, f"exit status {code}:\n" + "\n".join(server.log[-20:]))

        checks.run("SIGTERM: clean exit", shutdown)
    if server is not None:
        server.stop()

    total = checks.passed + len(checks.failed)
    if checks.failed:
        print(f"{len(checks.failed)} of {total} openai client checks failed: {', '.join(checks.failed)}")
        return 1
    print(f"all openai client checks passed ({total} checks, openai {openai.__version__})")
    return 0


def main():
    args = parse_args()
    if args.inner:
        return inner(args)
    return outer(args)


if __name__ == "__main__":
    sys.exit(main())
