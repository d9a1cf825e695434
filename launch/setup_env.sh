# Sourced by launch/quickstart.sh and tests/run.sh: make .venv (Python 3.11) with
# requirements.txt installed, reinstalling only when requirements.txt changes, and
# build the compiled ops a run loads once, inside the venv (.venv/torch_extensions;
# python launch/build_ops.py, see ds_ext/ops.py), so no launch builds or waits on a build.
set -euo pipefail
SEEKSPEED_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${SEEKSPEED_VENV:-$SEEKSPEED_ROOT/.venv}"

_pick_python() {
    for py in python3.11 python3; do
        if command -v "$py" >/dev/null && "$py" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
            echo "$py"; return 0
        fi
    done
    echo "error: seekspeed needs Python 3.11 (python3.11 or python3 on PATH); found none" >&2
    return 1
}

ensure_venv() {
    local stamp="$VENV/.requirements.sha256" want
    want="$(sha256sum "$SEEKSPEED_ROOT/requirements.txt" | cut -d' ' -f1)"
    if [[ ! -x "$VENV/bin/python" ]]; then
        echo "setup: creating $VENV" >&2
        "$(_pick_python)" -m venv "$VENV"
    fi
    if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" ]]; then
        echo "setup: installing requirements.txt into $VENV (about a minute)" >&2
        "$VENV/bin/python" -m pip install --quiet --upgrade pip
        "$VENV/bin/python" -m pip install --quiet -r "$SEEKSPEED_ROOT/requirements.txt"
        echo "$want" > "$stamp"
    fi
    # shellcheck disable=SC1091
    source "$VENV/bin/activate"
    export PYTHONPATH="$SEEKSPEED_ROOT${PYTHONPATH:+:$PYTHONPATH}"
    # without a GPU, DeepSpeed's CPU accelerator and the gloo backend
    if ! python -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
        export DS_ACCELERATOR=cpu
    fi
    # the builds belong to this venv's torch and DeepSpeed (the trainer picks the same place)
    export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$VENV/torch_extensions}"
    local ops_stamp="$TORCH_EXTENSIONS_DIR/.seekspeed-ops-built"
    if [[ ! -f "$ops_stamp" || "$(cat "$ops_stamp")" != "$want" ]]; then
        echo "setup: building the compiled ops runs load into $TORCH_EXTENSIONS_DIR (about two minutes, once)" >&2
        mkdir -p "$TORCH_EXTENSIONS_DIR"
        local ops_log="$TORCH_EXTENSIONS_DIR/.seekspeed-ops-build.log"
        if ! (cd "$SEEKSPEED_ROOT" && python launch/build_ops.py) >"$ops_log" 2>&1; then
            tail -n 20 "$ops_log" >&2
            echo "error: building the compiled ops failed (log: $ops_log); a C++ compiler and ninja are needed" >&2
            return 1
        fi
        grep -E "^ops:" "$ops_log" >&2 || true
        echo "$want" > "$ops_stamp"
    fi
}
