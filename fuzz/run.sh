#!/bin/sh
# Fuzzes warmpath's network decoders with libFuzzer on stable Rust.
#
#   fuzz/run.sh [SECONDS] [TARGET...]     each target for SECONDS (default 60)
#   KEEP=1 fuzz/run.sh ...                 then merge what was new into fuzz/corpus
#   RUNS=N fuzz/run.sh ...                 at most N inputs per target, seed 1 (SEED=…):
#                                          the same tree fuzzes the same inputs every time
#
# Targets: the files in fuzz/fuzz_targets (all by default). Each run reads the kept corpus
# fuzz/corpus/TARGET and writes new inputs to target/fuzz/new/TARGET, so the repository's
# corpus changes only with KEEP=1 (a minimizing merge). A crash stops the run with a
# non-zero status; its input is in target/fuzz/artifacts/TARGET/, and once the bug is
# fixed it belongs in fuzz/corpus/TARGET, where `cargo test` replays it.
#
# The coverage flags are cargo-fuzz's for `--sanitizer none`, the mode that needs no
# nightly compiler: `cargo fuzz run -s none TARGET` works the same where cargo-fuzz is
# installed.
set -eu
cd "$(dirname "$0")"
seconds=${1:-60}
[ $# -gt 0 ] && shift
targets=${*:-$(ls fuzz_targets | sed 's/\.rs$//')}
host=$(rustc -vV | sed -n 's/^host: //p')
out=../target/fuzz
export CARGO_TARGET_DIR=$out
# With --target, RUSTFLAGS reach only the fuzzed code, not build scripts or proc macros.
export RUSTFLAGS="--cfg fuzzing -Cpasses=sancov-module \
 -Cllvm-args=-sanitizer-coverage-level=4 -Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
 -Cllvm-args=-sanitizer-coverage-pc-table -Cllvm-args=-sanitizer-coverage-trace-compares \
 -Cdebug-assertions -Coverflow-checks"
cargo build --locked --release --target "$host" --bins
for t in $targets; do
  mkdir -p "$out/new/$t" "$out/artifacts/$t"
  echo "== $t: ${seconds}s"
  limit=""
  [ -n "${RUNS:-}" ] && limit="-runs=$RUNS -seed=${SEED:-1}"
  # shellcheck disable=SC2086
  "$out/$host/release/$t" -max_total_time="$seconds" $limit -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$out/artifacts/$t/" "$out/new/$t" "corpus/$t"
  if [ "${KEEP:-0}" = 1 ]; then
    "$out/$host/release/$t" -merge=1 "corpus/$t" "$out/new/$t"
  fi
done
