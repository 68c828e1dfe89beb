#!/usr/bin/env python3
"""Send generated malformed or hostile request bodies to an OpenAI-compatible server.

    python3 scripts/server/server_hostile_bodies.py [--base-url http://127.0.0.1:8080] [--count 1000]
                                             [--seed 1] [--api-key KEY]

Standard library only. Every body is invalid by construction -- fuzzed or truncated JSON,
invalid UTF-8, wrong types, huge numbers (1e999, 2^64), negative or zero limits, values out
of range, 10 MB strings, nesting 100,000 levels deep, malformed messages, prompts far past
the context -- so each must be answered 4xx with an OpenAI error body
(`{"error": {"message": ..., "type": ...}}`). Afterwards /health must answer 200 and a
valid request must still succeed. Requests go only to a loopback address.

Exit status 0 when every body got a 4xx with an error body and the server still serves.
(tests/tests/server.rs runs the same kinds of bodies from Rust against `kiln serve`.)
"""

import argparse
import http.client
import json
import random
import sys
import time

from kiln_loopback import loopback_target  # scripts/server/kiln_loopback.py, beside this file

NO_EOS = {"0": -100, "1": -100, "2": -100}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8080")
    p.add_argument("--count", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default="default")
    return p.parse_args()


def must_fail_values():
    """(field, values) pairs where every value is refused whatever the server's defaults."""
    return [
        ("temperature", [-0.1, 2.5, 1e300, "0.5", [0.5], {"t": 1}]),
        ("top_p", [0, -1, 1.5, "high"]),
        ("top_k", [-1, 0.5, "40"]),
        ("min_p", [-0.5, 2, False]),
        ("max_tokens", [0, -5, -(2**63), 2**64 - 1, 1e19, 1e300, "4", 3.5]),
        ("max_completion_tokens", [0, -1, "x"]),
        ("n", [0, 17, -1, 1e10, "1"]),
        ("presence_penalty", [2.5, -2.5, "x"]),
        ("frequency_penalty", [9, -1e30, [1]]),
        ("seed", ["seed", 1.5, 1e30]),
        ("stop", [5, [1, 2], ["s"] * 100, {"a": 1}, ["x" * 1000], [[["x"]]]]),
        ("stream", ["yes", 1, []]),
        ("stream_options", ["usage", 5, {"include_usage": "yes"}]),
        ("model", [42, "no-such-model", ["default"], {}]),
        ("logit_bias", [{"x": 1}, {"5": 1000}, [1], {"-3": 1}, 7]),
        ("tools", [[{"type": "function"}]]),
        ("response_format", [{"type": "xml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": 5}},
                             {"type": "json_object", "schema": {"type": "frobnicate"}},
                             {"type": "json_object", "schema": {"$ref": "#/$defs/nope"}},
                             {"type": "json_object", "schema": {"$ref": "http://example.invalid/s.json"}}, "json"]),
        ("user", [5, ["u"]]),
    ]


def body_for(rng, i, model):
    chat = i % 2 == 0
    path = "/v1/chat/completions" if chat else "/v1/completions"
    valid = {"model": model, "max_tokens": 4}
    if chat:
        valid["messages"] = [{"role": "user", "content": "hello there"}]
    else:
        valid["prompt"] = "hello there"
    key = "messages" if chat else "prompt"
    if i % 50 == 7:
        v = dict(valid)
        big = "A" * (10 << 20)
        v[key] = [{"role": "user", "content": big}] if chat else big
        return path, json.dumps(v).encode(), "10 MB string"
    kind = rng.randrange(11)
    if kind == 0:
        return path, bytes(rng.randrange(256) for _ in range(1 + rng.randrange(512))), "random bytes"
    if kind == 1:
        s = json.dumps(valid).encode()
        return path, s[: 1 + rng.randrange(len(s) - 1)], "truncated JSON"
    if kind == 2:
        s = bytearray(json.dumps(valid).encode())
        s.insert(rng.randrange(len(s)), rng.choice([0xFF, 0xC3, 0x80]))
        return path, bytes(s), "invalid UTF-8"
    if kind in (3, 4, 5):
        field, values = rng.choice(must_fail_values())
        v = dict(valid)
        v[field] = rng.choice(values)
        return path, json.dumps(v).encode(), f"bad {field}"
    if kind == 6:
        depth = 200 + rng.randrange(100_000)
        opener, closer = rng.choice([("[", "]"), ('{"a":', "}")])
        nested = opener * depth + "1" + closer * depth
        return path, ('{"%s": %s}' % (key, nested)).encode(), f"nesting {depth}"
    if kind == 7:
        v = dict(valid)
        text = "lorem ipsum " * (300 + rng.randrange(20_000))
        v[key] = [{"role": "user", "content": text}] if chat else text
        return path, json.dumps(v).encode(), "prompt past the context"
    if kind == 8:
        return path, rng.choice([b"null", b"[]", b'"prompt"', b"42", b"{}", b"true", b"", b" "]), "not an object"
    if kind == 9:
        if chat:
            bad = rng.choice([[], "hello", [{"content": "x"}], [{"role": "robot", "content": "x"}], [{"role": "user"}],
                              [{"role": "user", "content": 42}], [{"role": "user", "content": [{"type": "image_url"}]}], [None]])
        else:
            bad = rng.choice(["", [], [[]], [1, -2], [99_999_999], {"p": 1}, [None], ["a"] * 17, False])
        v = dict(valid)
        v[key] = bad
        return path, json.dumps(v).encode(), "malformed messages/prompt"
    lit = rng.choice(["1e999", "-1e999", "123456789012345678901234567890123456789e300"])
    field = rng.choice(["max_tokens", "temperature", "top_k", "seed", "n"])
    v = {k: val for k, val in valid.items() if k != field}
    s = json.dumps(v)
    return path, ('{"%s": %s, %s' % (field, lit, s[1:])).encode(), "number beyond f64"


def post(host, port, path, body, api_key, timeout=60):
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    try:
        conn.request("POST", path, body=body, headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def main():
    args = parse_args()
    host, port, prefix = loopback_target(args.base_url)
    rng = random.Random(args.seed)
    by_status = {}
    failures = []
    start = time.time()
    for i in range(args.count):
        path, body, what = body_for(rng, i, args.model)
        try:
            status, data = post(host, port, prefix + path, body, args.api_key)
        except Exception as e:  # noqa: BLE001 -- a dropped connection is a failure too
            failures.append(f"#{i} ({what}): {type(e).__name__}: {e}")
            continue
        by_status[status] = by_status.get(status, 0) + 1
        ok = 400 <= status < 500
        try:
            err = json.loads(data)["error"]
            ok = ok and isinstance(err["message"], str) and isinstance(err["type"], str)
        except Exception:  # noqa: BLE001
            ok = False
        if not ok:
            failures.append(f"#{i} ({what}) to {path}: {status} {data[:200]!r}")
    elapsed = time.time() - start
    conn = http.client.HTTPConnection(host, port, timeout=30)
    conn.request("GET", prefix + "/health")
    health = conn.getresponse().status
    conn.close()
    valid = {"model": args.model, "prompt": "hello", "max_tokens": 2}
    status, data = post(host, port, prefix + "/v1/completions", json.dumps(valid).encode(), args.api_key)
    print(f"{args.count} hostile bodies in {elapsed:.1f} s; statuses {dict(sorted(by_status.items()))}")
    print(f"afterwards: /health {health}, a valid completion {status}")
    for f in failures[:20]:
        print("FAIL:", f)
    if failures or health != 200 or status != 200:
        print(f"{len(failures)} bodies were not refused properly" if failures else "the server stopped serving")
        return 1
    print("every hostile body got a 4xx with an OpenAI error body; the server still serves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
