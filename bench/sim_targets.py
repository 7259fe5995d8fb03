#!/usr/bin/env python3
"""Simulated placement targets (issue 8, DESIGN.md "Benchmark targets").

Runs `warmpath simulate` on every synthetic workload and the public Mooncake trace, with 1
and 4 routers, and prints for each cache-aware policy at its defaults:
  hit/pooled  the hit rate over the pooled bound (target >= 0.95)
  ttft/rr     TTFT p50 over round-robin's (target <= 1.00)
  imbal       max/mean instance busy time (target <= 1.2)
  p99         TTFT p99 in ms
The simulator runs on a virtual clock with fixed seeds: the figures do not depend on the
machine. Usage: bench/sim_targets.py [--binary target/release/warmpath] [--quick]
"""
import argparse, json, os, subprocess, sys

HERE = os.path.dirname(os.path.abspath(__file__))
TRACE = os.path.join(HERE, "..", "..", "shared", "traces", "synthetic_trace.jsonl")

def run(binary, args):
    out = subprocess.run([binary, "simulate", "--json", *args], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=os.path.join(HERE, "..", "target", "release", "warmpath"))
    ap.add_argument("--routers", default="1 4", help="router counts to run")
    ap.add_argument("--rate", default="10", help="request rate of the synthetic workloads, per second")
    ap.add_argument("--kv", default="120000", help="GPU KV tokens per instance for the synthetic workloads")
    ap.add_argument("--policies", default="prefix-aware kv-aware")
    ap.add_argument("extra", nargs="*", help="extra simulate flags")
    a = ap.parse_args()
    policies = a.policies.split()
    cases = []
    for kv in [int(x) for x in a.kv.split()]:
        for w in ["chat", "bots", "rag", "code", "conversation"]:
            cases.append((f"{w} {kv // 1000}k r{a.rate}", ["--workload", w, "--instances", "8",
                          "--gpu-kv-tokens", str(kv), "--rate", a.rate]))
    if os.path.exists(TRACE):
        cases.append(("mooncake 400k", ["--trace", TRACE, "--instances", "8"]))
    cases.append(("bots 4x60k r12", ["--workload", "bots", "--instances", "4",
                  "--gpu-kv-tokens", "60000", "--rate", "12", "--requests", "600"]))
    routers = [int(x) for x in a.routers.split()]
    print(f"{'case':<18}{'R':>2}  {'pooled':>6}  " +
          "  ".join(f"{p[:10]:>10} {'hit/pool':>8} {'ttft/rr':>7} {'imbal':>5} {'p99':>7}" for p in policies))
    misses = 0
    for name, args in cases:
        for r in routers:
            out = run(a.binary, args + ["--routers", str(r), "--policy", "round-robin", *policies, *a.extra])
            pooled = out["bounds"]["pooled_hit_rate"]
            runs = {x["policy"]: x for x in out["runs"]}
            rr = runs["round-robin"]
            cells = []
            for p in policies:
                x = runs[p]
                hp = x["hit_rate"] / pooled if pooled else 1.0
                tr = x["ttft_ms_p50"] / rr["ttft_ms_p50"]
                ok = hp >= 0.95 and tr <= 1.0 and x["imbalance"] <= 1.2
                misses += not ok
                cells.append(f"{x['hit_rate']*100:>9.1f}% {hp:>8.3f} {tr:>7.2f} {x['imbalance']:>5.2f} {x['ttft_ms_p99']:>7.0f}{' ' if ok else '*'}")
            print(f"{name:<18}{r:>2}  {pooled*100:>5.1f}%  " + " ".join(cells))
            sys.stdout.flush()
    print(f"{misses} policy runs miss a target (marked *)")

if __name__ == "__main__":
    main()
