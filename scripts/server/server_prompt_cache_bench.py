#!/usr/bin/env python3
"""Time to first token over a multi-turn conversation, as a chat client sees it.

    python3 scripts/server/server_prompt_cache_bench.py [--base-url http://127.0.0.1:8080]
        [--turns 6] [--document-items 120] [--max-tokens 32] [--api-key KEY] [--json]

Standard library only. One conversation: a long first message (a generated document of
`--document-items` lines and a question), then `--turns - 1` short follow-ups, each sent with
the whole conversation so far, as chat clients do. Every turn is sent twice, streaming and
greedy: once as is (a server with a prompt cache continues the previous turn's sequence)
and once with `"cache_prompt": false` (prefilled afresh; llama-server and kiln both read
the field). Prints per turn the prompt tokens, the tokens the server reports as cached
(`usage.prompt_tokens_details.cached_tokens`), and both times to first token. Requests go
only to a loopback address.
"""

import argparse
import json
import sys
import time
import urllib.request

from kiln_loopback import loopback_target  # scripts/server/kiln_loopback.py, beside this file

FOLLOW_UPS = [
    "Which item is the heaviest?",
    "And the lightest?",
    "Sum the weights of items 3, 4 and 5.",
    "Which items weigh more than 500 grams?",
    "Name an item whose weight is a prime number.",
    "Summarise the list in one sentence.",
]


def stream_turn(base, key, messages, max_tokens, cache_prompt):
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_prompt": cache_prompt,
    }
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(), headers=headers)
    start = time.perf_counter()
    ttft, text, usage = None, [], None
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                piece = c.get("delta", {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    text.append(piece)
    return ttft, "".join(text), usage or {}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8080")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--document-items", type=int, default=120)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--api-key")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args()
    host, port, prefix = loopback_target(args.base_url)
    base = f"http://{host}:{port}{prefix}"

    document = "".join(f"Item {i} of the list weighs {7 * i + 3} grams.\n" for i in range(args.document_items))
    messages = [{"role": "user", "content": f"{document}\nHow many items are in the list?"}]
    rows = []
    for turn in range(args.turns):
        # Cached first: it continues the previous turn's sequence, as a chat client's next
        # turn would (run second, it would find this turn's own prompt kept instead).
        cached_ttft, text, usage = stream_turn(base, args.api_key, messages, args.max_tokens, True)
        fresh_ttft, fresh_text, _ = stream_turn(base, args.api_key, messages, args.max_tokens, False)
        details = usage.get("prompt_tokens_details") or {}
        rows.append({
            "turn": turn + 1,
            "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": details.get("cached_tokens"),
            "ttft_fresh_s": fresh_ttft,
            "ttft_cached_s": cached_ttft,
            "same_text": text == fresh_text,
        })
        messages = messages + [{"role": "assistant", "content": text},
                               {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print("| turn | prompt tokens | cached | TTFT afresh | TTFT cached | speed-up | same text |")
    print("|---:|---:|---:|---:|---:|---:|:---:|")
    for r in rows:
        f, c = r["ttft_fresh_s"], r["ttft_cached_s"]
        print(f"| {r['turn']} | {r['prompt_tokens']} | {r['cached_tokens']} | {f * 1000:.0f} ms | {c * 1000:.0f} ms "
              f"| {f / c:.1f}× | {'yes' if r['same_text'] else 'no'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
