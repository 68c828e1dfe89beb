#!/usr/bin/env python3
"""Time per generated token with and without a `response_format` constraint.

    python3 scripts/server/server_structured_bench.py [--base-url http://127.0.0.1:8080] [--rounds 5]

Standard library only; loopback only. Streams one 100-token chat completion per case
(free text, `json_object`, an array of 30 short strings, an array of 40 digits) with the
end-of-turn tokens banned, in alternating rounds, and prints the median time between
streamed tokens per case (the first token's wait, the prefill, is left out).
"""
import argparse
import json
import statistics
import sys
import time
import urllib.request

from kiln_loopback import loopback_target  # scripts/server/kiln_loopback.py, beside this file

BASE = None


def itl(body):
    body = dict(body, stream=True)
    req = urllib.request.Request(BASE + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    times = []
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                c = json.loads(line[6:])
                if c.get("choices") and c["choices"][0].get("delta", {}).get("content"):
                    times.append(time.perf_counter())
    return (times[-1] - times[0]) / (len(times) - 1) * 1000


def main():
    global BASE
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8080")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    host, port, prefix = loopback_target(args.base_url)
    BASE = f"http://{host}:{port}{prefix}"
    msg = [{"role": "user", "content": "Write thirty short words."}]
    base = {"messages": msg, "max_tokens": 100, "temperature": 0.8, "seed": 1,
            "logit_bias": {"0": -100, "1": -100, "2": -100}, "cache_prompt": False}
    schema = lambda name, s: {"response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": s}}}
    cases = {
        "free text": {},
        "json_object": {"response_format": {"type": "json_object"}},
        "schema: 30 strings": schema("w", {"type": "array", "items": {"type": "string", "maxLength": 12},
                                           "minItems": 30, "maxItems": 30}),
        "schema: 40 digits": schema("d", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "minItems": 40, "maxItems": 40}),
    }
    res = {k: [] for k in cases}
    for _ in range(args.rounds):
        for k, extra in cases.items():
            res[k].append(itl(dict(base, **extra)))
    print("| case | ms per token (median) | range |")
    print("|---|---:|---:|")
    for k, v in res.items():
        print(f"| {k} | {statistics.median(v):.2f} | {min(v):.2f}–{max(v):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
