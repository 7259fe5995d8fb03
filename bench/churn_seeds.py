#!/usr/bin/env python3
"""Placement under cache churn over several workload seeds (issue 11).

A few hundred requests on GPUs that hold two to four prompts make TTFT p99 the third or
sixth slowest request: one seed says little. This runs `warmpath simulate` on the churn
setups of BENCHMARKS.md ("Live churn") for each seed, with the agents' feed of observed
residency on and off, and prints per policy the median hit rate, the median and worst TTFT
p99 and the median TTFT p50 over the seeds. The simulator runs on a virtual clock: the
figures do not depend on the machine.

Usage: bench/churn_seeds.py [--binary target/release/warmpath] [--seeds 1-6]
                            [--policies "prefix-aware kv-aware"]
"""
import argparse, json, os, statistics, subprocess

HERE = os.path.dirname(os.path.abspath(__file__))

CASES = [
    ("chat 4x20k 0.5/s 250", ["--workload", "chat", "--rate", "0.5", "--requests", "250",
                               "--gpu-kv-tokens", "20000"]),
    ("conversation 4x20k 2/s 600", ["--workload", "conversation", "--rate", "2",
                                     "--requests", "600", "--gpu-kv-tokens", "20000"]),
    ("chat 4x40k 2/s 600", ["--workload", "chat", "--rate", "2", "--requests", "600",
                             "--gpu-kv-tokens", "40000"]),
]


def seeds(spec):
    lo, _, hi = spec.partition("-")
    return range(int(lo), int(hi or lo) + 1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=os.path.join(HERE, "..", "target", "release", "warmpath"))
    ap.add_argument("--seeds", default="1-6")
    ap.add_argument("--policies", default="prefix-aware kv-aware")
    a = ap.parse_args()
    print(f"warmpath simulate --instances 4 --block-tokens 16 --seed S, S in {a.seeds}; "
          "medians over the seeds, times in ms")
    print(f"{'case':<28}{'feed':<6}{'policy':<14}{'hit%':>6}{'p99 med':>9}{'p99 max':>9}{'p50 med':>9}")
    for name, args in CASES:
        for feed in (True, False):
            runs = {}
            for seed in seeds(a.seeds):
                cmd = [a.binary, "simulate", "--json", "--instances", "4", "--block-tokens", "16",
                       "--seed", str(seed), "--policy", *a.policies.split(), *args]
                if not feed:
                    cmd.append("--no-agent-feed")
                out = json.loads(subprocess.run(cmd, check=True, capture_output=True,
                                                text=True).stdout)
                for r in out["runs"]:
                    runs.setdefault(r["policy"], []).append(r)
            for policy, rs in runs.items():
                med = lambda k: statistics.median(r[k] for r in rs)
                print(f"{name:<28}{'on' if feed else 'off':<6}{policy:<14}"
                      f"{med('hit_rate') * 100:>6.1f}{med('ttft_ms_p99'):>9.0f}"
                      f"{max(r['ttft_ms_p99'] for r in rs):>9.0f}{med('ttft_ms_p50'):>9.1f}")


if __name__ == "__main__":
    main()
