# Sourced by launch/quickstart.sh and tests/run.sh: make .venv (Python 3.11) with
# requirements.txt installed, reinstalling only when requirements.txt changes, and
# build DeepSpeed's JIT ops once (cached in ~/.cache/torch_extensions).
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
        echo "setup: building DeepSpeed's CPU ops once if needed (about a minute the first time)" >&2
        python - <<'PY' 2>&1 | grep -v -E "WARNING|^\s*$" | tail -n 3 >&2 || true
from deepspeed.accelerator import get_accelerator
for name in ("ShareMemCommBuilder", "FusedAdamBuilder"):
    get_accelerator().create_op_builder(name).load(verbose=False)
PY
    fi
}
