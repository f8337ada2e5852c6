#!/usr/bin/env bash
# MoE fine-tuning with expert parallelism x FSDP2 on 2 nodes x 8 GPUs (Qwen3-30B-A3B). Usage:
#   sbatch slurm/moe_ep.sh [CONFIG] [key.path=value ...]
#   sbatch slurm/moe_ep.sh configs/mixtral.json
# configs/qwen3_moe.json sets ep_size=8, one node's GPUs: the all-to-all stays on the node's fast links and
# the two nodes each hold all experts, FSDP-sharded between them (efsdp = 16 / 8 = 2).
# Preemption works as in 8node.sh: USR1 -> checkpoint -> requeue -> resume.
#SBATCH --job-name=moe-ep-fsdp
#SBATCH --nodes=2
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

CONFIG=${1:-configs/qwen3_moe.json}
shift $(( $# > 0 ? 1 : 0 ))
run_recipe scripts/finetune_moe_ep_fsdp.py "$CONFIG" "$@"
