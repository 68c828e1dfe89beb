#!/usr/bin/env python3
"""Load test for an OpenAI-compatible server: N concurrent streaming clients.

    python3 scripts/server/server_load_test.py [--base-url http://127.0.0.1:8080] [--clients 64]
        [--duration 300] [--warmup 20] [--max-tokens 128] [--endpoint chat|completions]
        [--pid PID] [--api-key KEY] [--model NAME] [--logit-bias JSON] [--json]

Standard library only (asyncio and raw HTTP/1.1). Each client sends streaming requests one
after another until the time is up (bounded too by --max-requests). Requests are only ever
sent to a loopback address (127.0.0.0/8, localhost, ::1): anything else is refused.

Reports, over the requests started after the warm-up: aggregate generated tokens per
second, time to first token (TTFT) and inter-token latency (ITL) p50/p99, as the client
sees them. Then, against a kiln server (its /metrics has kiln_running_sequences), checks
that nothing is left running or queued and every KV slot is free; and with --pid, that the
server's resident memory (VmRSS in /proc/PID/status) after the run is within 5% of its value
at the end of the warm-up. Exits 1 when a request failed or a check did not hold.

The same command works against llama-server (start it with --metrics to be thorough; the
kiln-specific /metrics checks are skipped there), so both can be compared on one machine:

    kiln serve -m model.gguf --port 8080 --max-seqs 64 &
    python3 scripts/server/server_load_test.py --base-url http://127.0.0.1:8080 --pid $!
    llama-server -m model.gguf --port 8081 -np 64 -c $((64*4096)) --metrics &
    python3 scripts/server/server_load_test.py --base-url http://127.0.0.1:8081 --pid $!
"""

import argparse
import asyncio
import json
import os
import sys
import time
import urllib.request

from kiln_loopback import loopback_target  # scripts/server/kiln_loopback.py, beside this file


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8080", help="server root (the /v1 paths are added)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load after the warm-up")
    p.add_argument("--warmup", type=float, default=None, help="seconds of load before measuring (default: 10%% of --duration, 5..30)")
    p.add_argument("--max-requests", type=int, default=100_000, help="stop after this many requests in all")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--prompt", default="Write a long story about a lighthouse keeper and a storm.")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--model", default="default")
    p.add_argument("--api-key", default=None)
    p.add_argument("--logit-bias", default=None, help='JSON object, e.g. \'{"2": -100}\' to keep generations at full length')
    p.add_argument("--pid", type=int, default=None, help="server process id, for the RSS check")
    p.add_argument("--rss-tolerance", type=float, default=0.05)
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    return p.parse_args()


def percentile(values, q):
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Stats:
    def __init__(self):
        self.ttft = []
        self.itl = []
        self.tokens = 0
        self.requests = 0
        self.errors = []
        self.measuring = False


async def stream_request(host, port, path, body, headers):
    """Sends one streaming request; yields (time, payload) per SSE data event."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        head = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json",
                f"Content-Length: {len(body)}", "Accept: text/event-stream", "Connection: close"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        await writer.drain()
        status_line = await reader.readline()
        parts = status_line.split()
        status = int(parts[1]) if len(parts) > 1 else 0
        resp_headers = {}
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            k, _, v = line.decode("latin-1").partition(":")
            resp_headers[k.strip().lower()] = v.strip()
        chunked = "chunked" in resp_headers.get("transfer-encoding", "")

        async def pieces():
            if chunked:
                while True:
                    size_line = await reader.readline()
                    if not size_line:
                        return
                    size = int(size_line.split(b";")[0].strip() or b"0", 16)
                    if size == 0:
                        return
                    data = await reader.readexactly(size)
                    await reader.readline()
                    yield data
            else:
                n = resp_headers.get("content-length")
                if n is not None:
                    yield await reader.readexactly(int(n))
                else:
                    while True:
                        data = await reader.read(65536)
                        if not data:
                            return
                        yield data

        if status != 200:
            body = b"".join([p async for p in pieces()])
            raise RuntimeError(f"HTTP {status}: {body[:300].decode(errors='replace')}")
        buf = b""
        async for data in pieces():
            now = time.perf_counter()
            buf += data.replace(b"\r\n", b"\n")
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                payload = [ln[5:].lstrip() for ln in event.split(b"\n") if ln.startswith(b"data:")]
                if payload:
                    yield now, b"\n".join(payload)
    finally:
        writer.close()


async def client(args, host, port, prefix, stats, stop_at, budget):
    path = prefix + ("/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions")
    req = {"model": args.model, "max_tokens": args.max_tokens, "temperature": args.temperature, "stream": True,
           "stream_options": {"include_usage": True}}
    if args.endpoint == "chat":
        req["messages"] = [{"role": "user", "content": args.prompt}]
    else:
        req["prompt"] = args.prompt
    if args.logit_bias:
        req["logit_bias"] = json.loads(args.logit_bias)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    while time.perf_counter() < stop_at and budget[0] > 0:
        budget[0] -= 1
        measured = stats.measuring
        body = json.dumps(req).encode()
        t0 = time.perf_counter()
        first = last = None
        chunks = 0
        usage_tokens = None
        itl = []
        try:
            async for now, payload in stream_request(host, port, path, body, headers):
                if payload == b"[DONE]":
                    break
                v = json.loads(payload)
                if "error" in v:
                    raise RuntimeError(f"error event: {v['error']}")
                if v.get("usage"):
                    usage_tokens = v["usage"].get("completion_tokens")
                for c in v.get("choices") or []:
                    text = c.get("text") if args.endpoint == "completions" else (c.get("delta") or {}).get("content")
                    if text:
                        chunks += 1
                        if first is None:
                            first = now
                        else:
                            itl.append(now - last)
                        last = now
        except Exception as e:  # noqa: BLE001 -- counted and reported
            if measured:
                stats.errors.append(str(e)[:300])
            await asyncio.sleep(0.1)
            continue
        if measured and first is not None:
            stats.requests += 1
            stats.ttft.append(first - t0)
            stats.itl.extend(itl)
            stats.tokens += usage_tokens if usage_tokens is not None else chunks


def get_text(base, path, api_key=None, timeout=10):
    req = urllib.request.Request(base + path, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read().decode()


def kiln_metrics(base):
    try:
        text = get_text(base, "/metrics")
    except Exception:
        return None
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, _, v = line.rpartition(" ")
            try:
                out[k] = float(v)
            except ValueError:
                pass
    return out if "kiln_running_sequences" in out else None


async def run(args):
    host, port, prefix = loopback_target(args.base_url)
    base = f"http://{host}:{port}{prefix}"
    warmup = args.warmup if args.warmup is not None else min(30.0, max(5.0, args.duration * 0.1))
    stats = Stats()
    start = time.perf_counter()
    stop_at = start + warmup + args.duration
    budget = [args.max_requests]
    tasks = [asyncio.create_task(client(args, host, port, prefix, stats, stop_at, budget)) for _ in range(args.clients)]
    await asyncio.sleep(warmup)
    rss_warm = rss_kib(args.pid) if args.pid else None
    stats.measuring = True
    t_measure = time.perf_counter()
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - t_measure

    report = {
        "base_url": base,
        "endpoint": args.endpoint,
        "clients": args.clients,
        "warmup_s": warmup,
        "measured_s": round(elapsed, 2),
        "requests": stats.requests,
        "errors": len(stats.errors),
        "generated_tokens": stats.tokens,
        "tokens_per_s": round(stats.tokens / elapsed, 1) if elapsed > 0 else 0.0,
        "ttft_p50_ms": round(percentile(stats.ttft, 0.5) * 1e3, 1),
        "ttft_p99_ms": round(percentile(stats.ttft, 0.99) * 1e3, 1),
        "itl_p50_ms": round(percentile(stats.itl, 0.5) * 1e3, 2),
        "itl_p99_ms": round(percentile(stats.itl, 0.99) * 1e3, 2),
    }
    failures = []
    if stats.errors:
        failures.append(f"{len(stats.errors)} requests failed, e.g. {stats.errors[0]}")
    if stats.requests == 0:
        failures.append("no request completed after the warm-up")

    # Afterwards: nothing running, every slot free (kiln), memory back where it was.
    m = kiln_metrics(base)
    if m is not None:
        deadline = time.time() + 15
        while time.time() < deadline and (m["kiln_running_sequences"] or m["kiln_queue_depth"] or m["kiln_kv_slots_used"]):
            await asyncio.sleep(0.1)
            m = kiln_metrics(base)
        report["after"] = {k: m[k] for k in ("kiln_running_sequences", "kiln_queue_depth", "kiln_kv_slots_used", "kiln_kv_slots_free", "kiln_kv_slots_total")}
        if m["kiln_running_sequences"] != 0 or m["kiln_queue_depth"] != 0:
            failures.append(f"still running/queued after the run: {report['after']}")
        if m["kiln_kv_slots_free"] != m["kiln_kv_slots_total"] or m["kiln_kv_slots_used"] != 0:
            failures.append(f"KV slots not all free after the run: {report['after']}")
    else:
        report["after"] = "not a kiln server (no kiln_running_sequences in /metrics): slot checks skipped"
    if args.pid:
        rss_after = rss_kib(args.pid)
        change = (rss_after - rss_warm) / rss_warm
        report["rss_after_warmup_mib"] = round(rss_warm / 1024, 1)
        report["rss_after_run_mib"] = round(rss_after / 1024, 1)
        report["rss_change_pct"] = round(change * 100, 2)
        if change > args.rss_tolerance:
            failures.append(f"RSS grew {change * 100:.1f}% after the warm-up (limit {args.rss_tolerance * 100:.0f}%)")
    report["ok"] = not failures
    report["failures"] = failures
    if args.json:
        print(json.dumps(report))
    else:
        for k, v in report.items():
            print(f"{k:>22}: {v}")
    return 0 if not failures else 1


def main():
    args = parse_args()
    if args.clients < 1 or args.duration <= 0:
        raise SystemExit("--clients must be >= 1 and --duration > 0")
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
