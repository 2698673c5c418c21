#!/usr/bin/env bash
# Runs one fuzz target (fuzz/fuzz_targets/TARGET.rs) for SECONDS with libFuzzer under the
# nightly toolchain (cargo-fuzz; installed if missing). The corpus grows in
# fuzz/corpus/TARGET (git-ignored except the committed seeds in fuzz/seeds/TARGET); a crash
# leaves its input in fuzz/artifacts/TARGET and fails the run.
#   bash scripts/fuzz.sh                 # list the targets
#   bash scripts/fuzz.sh sfx_container 60
#   bash scripts/fuzz.sh all 30          # every target in turn (what CI runs)
set -euo pipefail
cd "$(dirname "$0")/.."
target="${1:-}"
seconds="${2:-60}"
targets=$(sed -n 's/^name = "\([a-z_]*\)"$/\1/p' fuzz/Cargo.toml | grep -v '^sfx-fuzz$' || true)
if [ -z "$target" ]; then
    echo "targets:"; echo "$targets" | sed 's/^/  /'; exit 0
fi
if ! cargo +nightly fuzz --version > /dev/null 2>&1; then
    cargo install cargo-fuzz --locked
fi
run() {
    local t="$1"
    mkdir -p "fuzz/corpus/$t" "fuzz/seeds/$t"
    # Built first and on its own, so a build failure fails the run (the run's output below
    # is filtered, and its status comes from the artifacts).
    cargo +nightly fuzz build "$t"
    echo "fuzz $t for ${seconds}s"
    # -rss_limit_mb / -malloc_limit_mb: an allocation over 2 GiB is a finding (a size read
    # from the input must be checked before it is allocated).
    cargo +nightly fuzz run "$t" "fuzz/corpus/$t" "fuzz/seeds/$t" -- \
        -max_total_time="$seconds" -rss_limit_mb=4096 -malloc_limit_mb=2048 -timeout=10 \
        -print_final_stats=1 2>&1 | grep -E "^(#[0-9]+.*DONE|stat::number_of_executed_units|stat::peak_rss_mb|==[0-9]+==|SUMMARY|Done)|panicked|ERROR|crash-|timeout-|oom-" || true
    # cargo fuzz exits non-zero on a finding; the pipe above hides it, so check artifacts.
    if ls "fuzz/artifacts/$t"/* > /dev/null 2>&1; then
        echo "fuzz $t: findings in fuzz/artifacts/$t"; return 1
    fi
}
if [ "$target" = all ]; then
    status=0
    for t in $targets; do run "$t" || status=1; done
    exit $status
fi
run "$target"
