#!/usr/bin/env bash
# The README's test command as a newcomer runs it, timed: a clone of this repository's
# HEAD into an empty folder, a fresh venv, then the command (install included).
# Usage: bash bench/readme_command_time.sh [LABEL]   (prints install, tests and total s)
set -euo pipefail
src="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
git clone -q "$src" "$work/fusedrnn" && cd "$work/fusedrnn"
python3 -m venv .venv && . .venv/bin/activate
unset NUMBA_CACHE_DIR PYTHONPATH
start=$(date +%s.%N)
python -m pip install torch==2.13.0 >/dev/null && python -m pip install -e '.[test]' >/dev/null
mid=$(date +%s.%N)
python -m pytest -q -n 2 2>&1 | tail -1
end=$(date +%s.%N)
python3 -c "print('${1:-run}', 'install', round($mid-$start,1), 'tests', round($end-$mid,1),
 'total', round($end-$start,1))"
