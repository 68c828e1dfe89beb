#!/usr/bin/env python3
"""Idle-connection flood against `kiln serve` under a file-descriptor limit (issue 50's check).

Starts `kiln serve` with `ulimit -n LIMIT` (default 1024), opens CONNS idle TCP connections
(default 1100: more than the process can hold), times `/health` on a fresh connection, then
waits the server's `--timeout` (default 30 s) plus one second and counts how many of the
idle connections the server has closed.

    python3 scripts/server/idle_flood.py [--kiln target/release/kiln] [--model M]
        [--limit 1024] [--conns 1100] [--timeout 30]

Stdlib only; loopback only. The test process needs CONNS + a few descriptors itself.
"""
import argparse
import os
import re
import socket
import subprocess
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kiln", default="target/release/kiln")
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--limit", type=int, default=1024)
    ap.add_argument("--conns", type=int, default=1100)
    ap.add_argument("--timeout", type=float, default=30.0)
    a = ap.parse_args()
    cmd = (f'ulimit -n {a.limit} && exec "{a.kiln}" serve -m "{a.model}" --port 0 --backend cpu '
           f'-c 512 --max-seqs 2 --timeout {a.timeout}')
    server = subprocess.Popen(["sh", "-c", cmd], stderr=subprocess.PIPE, text=True)
    port = None
    for line in server.stderr:
        m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
        if m:
            port = int(m.group(1))
            break

    def health():
        start = time.time()
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        head = s.recv(64)
        s.close()
        return time.time() - start, head.startswith(b"HTTP/1.1 200")

    while True:
        try:
            if health()[1]:
                break
        except OSError:
            pass
        time.sleep(0.1)
    conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(a.conns)]
    took, ok = health()
    print(f"/health with {a.conns} idle connections at {a.limit} descriptors: {took * 1000:.1f} ms, ok={ok}")
    time.sleep(a.timeout + 1)

    def closed(c):
        c.settimeout(0.01)
        try:
            return c.recv(16) == b""
        except socket.timeout:
            return False
        except OSError:
            return True

    n = sum(closed(c) for c in conns)
    print(f"closed by the server after {a.timeout + 1:.0f} s: {n} of {a.conns} ({100 * n / a.conns:.0f}%)")
    server.terminate()
    server.wait()


if __name__ == "__main__":
    main()
