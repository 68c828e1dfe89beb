"""What the server scripts share: the one check that keeps them on this machine.

`loopback_target(base_url)` returns (host, port, path prefix) of an http:// URL whose host
resolves only to loopback addresses, and exits otherwise (the load and hostile-body
scripts must never be pointed at another machine).
"""
import ipaddress
import socket
import urllib.parse


def loopback_target(base_url):
    u = urllib.parse.urlparse(base_url)
    if u.scheme != "http" or not u.hostname:
        raise SystemExit(f"--base-url must be http://HOST:PORT on this machine, not {base_url!r}")
    port = u.port or 80
    for info in socket.getaddrinfo(u.hostname, port, proto=socket.IPPROTO_TCP):
        if not ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback:
            raise SystemExit(f"refusing {base_url}: {u.hostname} is not a loopback address (these scripts stay on this machine)")
    return u.hostname, port, u.path.rstrip("/")
