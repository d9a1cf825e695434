"""Train a seekspeed recipe on DeepSpeed's pipeline engine.

    # CPU, 4 gloo ranks (2 pipeline stages x 2 data-parallel), the tiny recipe:
    deepspeed --num_gpus 4 launch/train.py --deepspeed ds_configs/tiny_cpu.json
    # one node, 8 GPUs:
    deepspeed --num_gpus 8 launch/train.py --deepspeed ds_configs/single_node.json
    # 128 nodes x 8 GPUs (hostfile format: launch/hosts.example):
    deepspeed --hostfile hosts launch/train.py --deepspeed ds_configs/128node.json
    # the same under torchrun, or one rank with plain python:
    torchrun --nproc_per_node 4 launch/train.py --deepspeed ds_configs/tiny_cpu.json
    python launch/train.py --deepspeed ds_configs/tiny_1rank.json
    # continue the newest complete checkpoint of seekspeed.checkpoint.dir:
    deepspeed --num_gpus 4 launch/train.py --deepspeed ds_configs/tiny_cpu.json --resume
    # restart by itself after a rank dies (torchrun does it; DeepSpeed's launcher needs the wrapper):
    torchrun --nproc_per_node 4 --max_restarts 3 --rdzv_backend c10d --rdzv_endpoint localhost:29400 \
        launch/train.py --deepspeed ds_configs/tiny_cpu.json --resume auto
    python launch/elastic.py --max-restarts 3 -- \
        deepspeed --hostfile hosts launch/train.py --deepspeed ds_configs/128node.json --resume auto
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ds_ext.trainer import main

if __name__ == "__main__":
    sys.exit(main())
