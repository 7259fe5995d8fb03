#!/usr/bin/env python3
"""Placement side by side with the routers users would pick instead (issue 8, part 1).

Each router under test gets four fresh `warmpath engine-sim`s (10x speed-up) and the same
`warmpath loadgen` workload as `warmpath demo` (600 requests at 20/s of model time, seed
42, streaming); the table gives the hit rate the engines report and TTFT p50/p99 in model
time (wall time x speed-up).

Routers:
  warmpath:<policy>   `warmpath router --strategy <policy>` at its defaults
  smg:cache_aware     SMG (`pip install smg`), `python -m smg launch --worker-urls ...
                      --policy cache_aware --disable-tokenizer-autoload`, as its docs show
  sglang:cache_aware  sglang-router (`pip install sglang-router`),
                      `python -m sglang_router.launch_router ... --policy cache_aware`

The peers are installed from PyPI into a virtual environment (--venv, created on first use
with --install); none of their code is in this repository. Runs are sequential; each
case prints its conditions. The machine is shared and noisy: compare rows of one run.

Usage:
  bench/peers.py --install                         # once: venv with smg and sglang-router
  bench/peers.py                                   # the default matrix
  bench/peers.py --cases bots:60000 --routers warmpath:kv-aware smg:cache_aware
"""
import argparse, json, os, platform, shutil, signal, socket, subprocess, sys, time, urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_BINARY = os.path.join(ROOT, "target", "release", "warmpath")
DEFAULT_VENV = os.path.join(ROOT, "target", "peer-venv")
MODEL = "sim-llama"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child process, killed (with its group) on close."""

    def __init__(self, args, read_url=False, env=None):
        self.p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                  text=True, env=env, start_new_session=True)
        self.url = None
        if read_url:
            line = self.p.stdout.readline()
            if "listening on " not in line:
                self.close()
                raise RuntimeError(f"{args[:2]} did not start: {line!r}")
            self.url = line.split("listening on ", 1)[1].strip()
        # Keep draining stdout so the child never blocks on a full pipe.
        import threading
        threading.Thread(target=lambda: [None for _ in self.p.stdout], daemon=True).start()

    def rss_mib(self):
        """Resident memory of the process and its children, MiB (Linux)."""
        total = 0
        pids = [self.p.pid]
        try:
            out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.p.pid)],
                                 capture_output=True, text=True).stdout.split()
            pids += [int(x) for x in out]
        except OSError:
            pass
        for pid in pids:
            try:
                with open(f"/proc/{pid}/status") as f:
                    for line in f:
                        if line.startswith("VmRSS:"):
                            total += int(line.split()[1])
            except OSError:
                pass
        return total / 1024

    def close(self):
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except OSError:
            pass
        self.p.wait()


def wait_ready(url, path="/v1/models", timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url + path, timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            time.sleep(0.25)
    raise RuntimeError(f"{url} not ready after {timeout} s")


def start_router(kind, policy, engines, a):
    urls = [e.url for e in engines]
    if kind == "warmpath":
        args = [a.binary, "router", "--listen", "127.0.0.1:0", "--strategy", policy]
        for u in urls:
            args += ["--instance", u]
        r = Proc(args, read_url=True, env={**os.environ, "WARMPATH_LOG": "warn"})
    else:
        python = os.path.join(a.venv, "bin", "python")
        port = free_port()
        if kind == "smg":
            args = [python, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(port),
                    "--worker-urls", *urls, "--policy", policy, "--disable-tokenizer-autoload"]
        elif kind == "sglang":
            args = [python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                    "--port", str(port), "--worker-urls", *urls, "--policy", policy]
        else:
            raise SystemExit(f"unknown router kind {kind!r}")
        r = Proc(args)
        r.url = f"http://127.0.0.1:{port}"
    wait_ready(r.url)
    return r


def run_case(router_spec, workload, kv, a):
    kind, policy = router_spec.split(":", 1)
    engines = [Proc([a.binary, "engine-sim", "--listen", "127.0.0.1:0", "--speedup", str(a.speedup),
                     "--gpu-kv-tokens", str(kv)], read_url=True) for _ in range(a.instances)]
    router = None
    try:
        router = start_router(kind, policy, engines, a)
        out = subprocess.run([a.binary, "loadgen", "--target", router.url, "--workload", workload,
                              "--requests", str(a.requests), "--rate", str(a.rate),
                              "--time-scale", str(a.speedup), "--seed", str(a.seed),
                              "--model", MODEL, "--timeout-s", "120", "--json"],
                             capture_output=True, text=True, check=True).stdout
        report = json.loads(out)
        report["rss_mib"] = router.rss_mib()
        return report
    finally:
        if router:
            router.close()
        for e in engines:
            e.close()


def install(venv):
    if not os.path.exists(os.path.join(venv, "bin", "python")):
        subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([os.path.join(venv, "bin", "pip"), "install", "--quiet", "smg", "sglang-router"],
                   check=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", default=DEFAULT_BINARY)
    ap.add_argument("--venv", default=DEFAULT_VENV)
    ap.add_argument("--install", action="store_true", help="create the venv and install the peers")
    ap.add_argument("--routers", nargs="+",
                    default=["warmpath:prefix-aware", "warmpath:kv-aware", "smg:cache_aware"])
    ap.add_argument("--cases", nargs="+",
                    default=["bots:120000", "bots:60000", "chat:120000", "conversation:120000"],
                    help="workload:gpu_kv_tokens_per_engine")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--speedup", type=float, default=10.0)
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--repeat", type=int, default=1, help="runs per router and case")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.install:
        install(a.venv)
        if len(sys.argv) == 2:
            return
    if any(not r.startswith("warmpath:") for r in a.routers) and not os.path.exists(
            os.path.join(a.venv, "bin", "python")):
        raise SystemExit(f"no peer venv at {a.venv}: run bench/peers.py --install first")
    print(f"# {a.instances} engine-sims per run ({a.speedup:g}x speed-up), {a.requests} requests at "
          f"{a.rate:g}/s of model time, seed {a.seed}, streaming; TTFT in ms of model time")
    print(f"# machine: {platform.node()}, {os.cpu_count()} cores, {platform.platform()}; "
          f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    rows = []
    for case in a.cases:
        workload, kv = case.split(":")
        print(f"\n{workload}, {int(kv):,} GPU KV tokens per engine")
        print(f"  {'router':<24}{'hit%':>7}{'ttft p50':>10}{'ttft p99':>10}{'errors':>8}{'rss MiB':>9}")
        for _ in range(a.repeat):
            for spec in a.routers:
                r = run_case(spec, workload, int(kv), a)
                errors = sum(r["errors"].values()) if isinstance(r["errors"], dict) else r["errors"]
                row = {"case": case, "router": spec, "hit_rate": r["hit_rate"],
                       "ttft_p50_ms": r["ttft_ms"]["p50"] * a.speedup,
                       "ttft_p99_ms": r["ttft_ms"]["p99"] * a.speedup, "errors": errors,
                       "ok": r["ok"], "rss_mib": r["rss_mib"]}
                rows.append(row)
                print(f"  {spec:<24}{row['hit_rate'] * 100:>6.1f}%{row['ttft_p50_ms']:>10.1f}"
                      f"{row['ttft_p99_ms']:>10.1f}{errors:>8}{row['rss_mib']:>9.0f}", flush=True)
    if a.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
