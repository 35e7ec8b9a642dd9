#!/bin/sh
# DeepSpeed: plan #1 (tp=8,pp=1,dp=8) for llama-3-70b on 8x8 H100-SXM5-80GB; train.py is your DeepSpeed script
deepspeed --num_nodes 8 --num_gpus 8 train.py --deepspeed --deepspeed_config llama-3-70b.deepspeed.json
