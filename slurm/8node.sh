#!/usr/bin/env bash
# Llama pretraining on 8 nodes x 8 GPUs. Usage:
#   sbatch slurm/8node.sh [CONFIG] [key.path=value ...]
#   sbatch --nodes 2 slurm/8node.sh configs/llama.json train.steps=1000     # fewer nodes: nothing else changes
#   NETWORK=efa sbatch slurm/8node.sh                                        # AWS EFA presets (see slurm/common.sh)
#   sbatch slurm/8node.sh configs/llama.json parallelism.tp_size=8          # TP within each node, FSDP across
#   sbatch slurm/8node.sh configs/llama.json parallelism.dp_replicate_size=8 parallelism.tp_size=2
#                                            # HSDP x TP: replicas across nodes, tp 2 x dp_shard 4 in each node
# Tensor parallelism belongs within a node (NVLink): the mesh is (dp_replicate, dp_shard, tp) with tp
# innermost, so each tp group is adjacent ranks, which torchrun places on one node (docs/sharding.md).
#SBATCH --job-name=pretrain-fsdp
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --output=logs/%x-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
set -uo pipefail
cd "${SLURM_SUBMIT_DIR:-.}" || exit 1
# shellcheck source=slurm/common.sh
source slurm/common.sh

CONFIG=${1:-configs/llama.json}
shift $(( $# > 0 ? 1 : 0 ))
run_recipe scripts/pretrain_fsdp.py "$CONFIG" "$@"
