#!/usr/bin/env bash
# The test command: sets up .venv if it is missing or stale, then runs pytest.
#   bash tests/run.sh                 # the whole suite (about 28 minutes on 2 cores; see README, Tests)
#   bash tests/run.sh -m "not e2e"    # skip the launcher runs
#   bash tests/run.sh tests/test_config.py -k batch
source "$(dirname "${BASH_SOURCE[0]}")/../launch/setup_env.sh"
ensure_venv
cd "$SEEKSPEED_ROOT"
exec python -m pytest -ra --durations=60 "$@"
