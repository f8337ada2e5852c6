#!/usr/bin/env bash
# Long-context evaluation with context parallelism on one 8-GPU node (cp 8). Usage:
#   sbatch slurm/eval_cp.sh [CONFIG] [key.path=value ...]
#   sbatch --nodes 2 slurm/eval_cp.sh configs/eval_cp_llama.json parallelism.cp_size=16
# Evaluation keeps no state worth a checkpoint, so there is no preemption handling: a rerun starts over.
#SBATCH --job-name=eval-cp
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --output=logs/%x-%j.out
set -uo pipefail
cd "${SLURM_SUBMIT_DIR:-.}" || exit 1
# shellcheck source=slurm/common.sh
source slurm/common.sh

CONFIG=${1:-configs/eval_cp_llama.json}
shift $(( $# > 0 ? 1 : 0 ))
run_recipe scripts/eval_cp.py "$CONFIG" "$@"
