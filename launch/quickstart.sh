#!/usr/bin/env bash
# From a fresh clone: make .venv, install requirements.txt, and train the tiny MLA
# recipe with 4 ranks (2 pipeline stages x 2 data-parallel replicas) through the
# deepspeed launcher. On a machine without GPUs it runs on CPU with gloo.
#   bash launch/quickstart.sh                       # ds_configs/tiny_cpu.json, 300 steps
#   bash launch/quickstart.sh --steps 50            # extra flags go to launch/train.py
#   CONFIG=ds_configs/tiny_dualpipev_cpu.json bash launch/quickstart.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
ensure_venv
cd "$SEEKSPEED_ROOT"
CONFIG="${CONFIG:-ds_configs/tiny_cpu.json}"
RUN_DIR="runs/quickstart-$(date +%Y%m%d-%H%M%S)"
exec deepspeed --num_gpus 4 launch/train.py --deepspeed "$CONFIG" --checkpoint-dir "$RUN_DIR/checkpoints" \
    --summary-json "$RUN_DIR/summary.json" "$@"
