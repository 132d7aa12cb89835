#!/usr/bin/env bash
# make test's suite as two shards run at once, then the SQLite pass (see the Makefile).
#
# Why two at once: one pytest process keeps about 0.9 of this machine's 2 cores busy (measured over
# the API, gateway and integration suites: most of a test's time is a child process starting, a
# server answering or a worker polling), so a second process in parallel nearly halves the wall time.
# Each shard has its own test database, Redis database and data folder, so neither sees the other's
# rows, queued tasks, checkpoints or sandbox slots. OMP_WAIT_POLICY=PASSIVE: torch's OpenMP threads
# sleep instead of spinning while they wait, so two processes running torch on 2 cores do not
# starve each other (thread counts, and so every float sum, are unchanged).
#
#     tests/shards.sh PYTHON "SHARD_A_PATHS" "SQLITE_PATHS"
# Shard A runs SHARD_A_PATHS; shard B runs the rest of tests/ and then the SQLite pass over
# SQLITE_PATHS (the tests there that reach the database). DATABASE_URL and CELERY_BROKER_URL are
# shard A's; shard B's database name gets "_b" and its Redis database is the one below A's. Each pytest
# prints its slowest tests (--durations): where the suite's wall time goes, in every CI log.
set -uo pipefail

python=$1
read -r -a shard_a <<<"$2"
read -r -a sqlite_paths <<<"$3"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/sqlite"
export OMP_WAIT_POLICY=PASSIVE DEBUG=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

database_b="${DATABASE_URL%%\?*}_b"
broker_db=${CELERY_BROKER_URL##*/}
if [[ $broker_db =~ ^[0-9]+$ ]] && ((broker_db > 0)); then
    broker_b="${CELERY_BROKER_URL%/*}/$((broker_db - 1))"
else
    echo "CELERY_BROKER_URL must end in a Redis database number above 0 (shard B uses the one below)" >&2
    exit 2
fi
ignore=()
for path in "${shard_a[@]}"; do ignore+=(--ignore="$path"); done

started=$SECONDS
"$python" -m pytest --durations=25 "${shard_a[@]}" >"$work/shard-a.log" 2>&1 &
pid_a=$!

(
    export DATABASE_URL=$database_b CELERY_BROKER_URL=$broker_b ARTWEB_DATA_DIR=$work/data-b
    "$python" -m pytest --durations=25 tests "${ignore[@]}" || exit 1
    echo "== the SQLite pass: ${sqlite_paths[*]}, the tests that reach the database"
    # A database file of its own (tests/conftest.py puts the test database beside it).
    DATABASE_URL=sqlite:///$work/sqlite/artweb.sqlite3 ARTWEB_TESTS_ORM_ONLY=1 \
        "$python" -m pytest --durations=15 "${sqlite_paths[@]}"
) > >(tee "$work/shard-b.log") 2>&1 &
pid_b=$!

wait "$pid_b"
status_b=$?
echo "== shard B (the rest, then the SQLite pass) done after $((SECONDS - started)) s: exit $status_b"
wait "$pid_a"
status_a=$?
echo "== shard A (${shard_a[*]}) done after $((SECONDS - started)) s: exit $status_a; its output:"
cat "$work/shard-a.log"
# A CI log shows its tail: each failing shard's failures are repeated here, last.
for shard in a b; do
    grep -E '^(FAILED|ERROR) |^=+ .*(failed|error).* =+$' "$work/shard-$shard.log" | sed "s/^/shard $shard: /"
done
echo "== shard A exit $status_a, shard B exit $status_b, $((SECONDS - started)) s in all"
((status_a == 0 && status_b == 0))
