#!/usr/bin/env python3
"""Where a live request's time goes outside the engine model: the client's TTFT against
the engine's own (model-time) TTFT, straight to one `warmpath engine-sim` and through a
`warmpath router` in front of it, for long prompts that share a document.

The simulator's TTFT is the engine model's alone; `warmpath demo` measures TTFT at the
client. This prints the difference per request (client TTFT minus the engine's, from the
growth of its `vllm:time_to_first_token_seconds_sum`), and each process's CPU per request
(user + system, from /proc). The engine runs at 1x so that its model time is wall time.
Rounds alternate direct and routed; the first routed round after start-up is marked, as
its first requests run on cold processes. The machine is shared and noisy: compare the
rows of one run.

Usage:
  bench/live_split.py --binary target/release/warmpath            # 40,000-word prompts
  bench/live_split.py --binary B --words 1000 --requests 40 --rounds 3
"""
import argparse, datetime, http.client, json, os, platform, random, subprocess, tempfile, time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def start(binary, args):
    """Starts `binary args`, returns (process, host:port) from its first stdout line."""
    p = subprocess.Popen([binary] + args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         text=True, start_new_session=True)
    line = p.stdout.readline()
    if "listening on " not in line:
        p.kill()
        raise RuntimeError(f"{args[0]} did not start: {line!r}")
    return p, line.split("listening on ", 1)[1].strip().replace("http://", "")


def cpu_s(pid):
    """User + system CPU seconds of `pid` (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_ttft_sum(addr):
    host, port = addr.split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=10)
    c.request("GET", "/metrics")
    for line in c.getresponse().read().decode().splitlines():
        if line.startswith("vllm:time_to_first_token_seconds_sum"):
            return float(line.split()[-1])
    raise RuntimeError("the engine reports no vllm:time_to_first_token_seconds_sum")


def first_token_s(addr, body):
    """Seconds from sending `body` to the first streamed token; reads the stream to its end."""
    host, port = addr.split(":")
    c = http.client.HTTPConnection(host, int(port), timeout=60)
    t0 = time.perf_counter()
    c.request("POST", "/v1/completions", body, {"content-type": "application/json"})
    resp = c.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"status {resp.status}: {resp.read()[:200]!r}")
    first = None
    while True:
        line = resp.fp.readline()
        if first is None and line.startswith(b"data: {"):
            first = time.perf_counter() - t0
        if not line or line.startswith(b"data: [DONE]"):
            break
    c.close()
    return first


def quantiles(xs):
    s = sorted(xs)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]
    return pick(0.1), pick(0.5), pick(0.9), s[-1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", default=os.path.join(ROOT, "target", "release", "warmpath"))
    ap.add_argument("--words", type=int, default=40000, help="words in the shared document")
    ap.add_argument("--requests", type=int, default=30, help="requests per round")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of each path")
    ap.add_argument("--strategy", default="kv-aware")
    a = ap.parse_args()

    rnd = random.Random(42)
    doc = " ".join(f"w{rnd.randrange(50000)}" for _ in range(a.words))
    engine, eaddr = start(a.binary, ["engine-sim", "--listen", "127.0.0.1:0", "--speedup", "1",
                                     "--gpu-kv-tokens", "2000000", "--block-tokens", "16"])
    with tempfile.TemporaryDirectory() as d:
        cfg = os.path.join(d, "router.toml")
        with open(cfg, "w") as f:
            f.write(f'version = 1\n[[pools]]\nmodel = "sim-llama"\ninstances = ["http://{eaddr}"]\nblock_tokens = 16\n')
        router, raddr = start(a.binary, ["router", "--listen", "127.0.0.1:0", "--strategy",
                                         a.strategy, "--config", cfg])
        try:
            body0 = json.dumps({"model": "sim-llama", "prompt": doc, "max_tokens": 4, "stream": True})
            print(f"# {a.binary}; engine-sim at 1x (one, 2M GPU KV tokens, 16-token blocks), router "
                  f"--strategy {a.strategy} in front of it; streaming completions of a {a.words:,}-word "
                  f"document ({len(body0):,} B bodies) plus a unique question, 4 output tokens, one at a time")
            print(f"# machine: {platform.node() and 'vm'}, {os.cpu_count()} cores, {platform.platform()}; "
                  f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M:%S} UTC; "
                  f"load average {os.getloadavg()[0]:.2f}")
            # The document, computed once: every request below finds it on the GPU.
            first_token_s(eaddr, body0)
            print("  path    round   outside the engine, ms: p10    p50    p90    max   CPU ms/request: router  engine")
            routed = 0
            for r in range(a.rounds * 2):
                direct = r % 2 == 0
                addr = eaddr if direct else raddr
                outside = []
                cpu0 = (cpu_s(router.pid), cpu_s(engine.pid))
                for i in range(a.requests):
                    body = json.dumps({"model": "sim-llama", "prompt": f"{doc} question {r} {i} {rnd.randrange(10**9)}",
                                       "max_tokens": 4, "stream": True})
                    before = engine_ttft_sum(eaddr)
                    client = first_token_s(addr, body)
                    outside.append((client - (engine_ttft_sum(eaddr) - before)) * 1e3)
                cpu1 = (cpu_s(router.pid), cpu_s(engine.pid))
                if not direct:
                    routed += 1
                label = "direct" if direct else "router"
                tag = "" if direct or routed > 1 else " (first after start)"
                p10, p50, p90, mx = quantiles(outside)
                rcpu = (cpu1[0] - cpu0[0]) * 1e3 / a.requests
                ecpu = (cpu1[1] - cpu0[1]) * 1e3 / a.requests
                print(f"  {label:6}  {r // 2 + 1:5}   {'':22}{p10:5.2f}  {p50:5.2f}  {p90:5.2f}  {mx:5.2f}   "
                      f"{'':15}{rcpu:6.2f}  {ecpu:6.2f}{tag}")
            print("# outside the engine = client TTFT minus the engine's model TTFT; the client is this "
                  "script (Python), whose own share is the direct path's small-prompt figure (--words 1000); "
                  "CPU per request counts all each process did in the round (the engine's /metrics scrapes too)")
        finally:
            router.kill()
            engine.kill()


if __name__ == "__main__":
    main()
