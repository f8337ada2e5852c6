#!/usr/bin/env bash
# Sourced by the sbatch files: rendezvous, network presets and preemption handling, written once.
# shellcheck shell=bash

# Sizes come from Slurm, never typed twice: change `#SBATCH --nodes` (or pass --nodes to sbatch) and that is all.
NNODES=${SLURM_NNODES:?run this through sbatch}
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  NPROC_PER_NODE=${SLURM_GPUS_ON_NODE:-$(nvidia-smi -L 2>/dev/null | wc -l)}
  [[ "$NPROC_PER_NODE" -gt 0 ]] || NPROC_PER_NODE=1  # CPU-only nodes: one process per node
fi

# Rendezvous on the first node. Its NodeAddr, not its name: names of test clusters are not in DNS.
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
HEAD_ADDR=$(scontrol show node "$HEAD_NODE" | grep -oP 'NodeAddr=\K\S+' || echo "$HEAD_NODE")
# A port derived from the job id: two jobs sharing a head node do not collide, and a requeue reuses it.
RDZV_PORT=${RDZV_PORT:-$((20000 + SLURM_JOB_ID % 20000))}

# Network presets. NETWORK=ib (InfiniBand, default), roce, efa (AWS), or tcp (plain sockets, e.g. CPU tests).
case "${NETWORK:-ib}" in
  ib)   export NCCL_IB_DISABLE=0 NCCL_NET_GDR_LEVEL=PHB ;;
  roce) export NCCL_IB_DISABLE=0 NCCL_IB_GID_INDEX=${NCCL_IB_GID_INDEX:-3} NCCL_IB_TC=${NCCL_IB_TC:-106} ;;
  efa)  export FI_PROVIDER=efa FI_EFA_USE_DEVICE_RDMA=1 NCCL_PROTO=simple NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-^docker,lo} ;;
  tcp)  export NCCL_IB_DISABLE=1 ;;
  *)    echo "NETWORK must be ib, roce, efa or tcp, not '${NETWORK}'" >&2; exit 2 ;;
esac
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Restarted torchrun workers otherwise read stale rendezvous store addresses.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1

# Preemption: Slurm sends USR1 to this batch shell (--signal=B:USR1@120). The trap asks the training
# processes to checkpoint at their next step boundary through a file they poll; after they exit, the job
# requeues itself and the next run resumes from that checkpoint (checkpoint.resume=auto).
export FSDP2_RECIPES_PREEMPT_FILE=${FSDP2_RECIPES_PREEMPT_FILE:-${SLURM_SUBMIT_DIR:-$PWD}/logs/preempt-${SLURM_JOB_ID}}
mkdir -p "$(dirname "$FSDP2_RECIPES_PREEMPT_FILE")"
rm -f "$FSDP2_RECIPES_PREEMPT_FILE"
PREEMPTED=0
on_preempt() {
  echo "$(date -Is) job $SLURM_JOB_ID: USR1 received, asking for a checkpoint and a requeue"
  PREEMPTED=1
  touch "$FSDP2_RECIPES_PREEMPT_FILE"
}
trap on_preempt USR1

# run_recipe SCRIPT CONFIG [overrides...]: one torchrun agent per node, in the background so the trap can run.
run_recipe() {
  local script=$1 config=$2
  shift 2
  echo "$(date -Is) job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $NNODES nodes x $NPROC_PER_NODE, head $HEAD_ADDR:$RDZV_PORT"
  srun --kill-on-bad-exit=1 --ntasks-per-node=1 \
    torchrun --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE" \
      --rdzv_backend c10d --rdzv_endpoint "$HEAD_ADDR:$RDZV_PORT" --rdzv_id "$SLURM_JOB_ID" \
      --max_restarts "${MAX_RESTARTS:-0}" \
      "$script" --config "$config" "$@" &
  local pid=$!
  # `wait` returns early when the trap fires; wait again until the training really ends.
  while true; do
    wait "$pid"
    local status=$?
    kill -0 "$pid" 2>/dev/null || break
  done
  rm -f "$FSDP2_RECIPES_PREEMPT_FILE"
  if [[ "$PREEMPTED" == 1 ]]; then
    # Whatever the exit status: the scheduler takes the nodes back either way, and the next run resumes from the
    # newest complete checkpoint (they are renamed into place only once fully written).
    echo "$(date -Is) job $SLURM_JOB_ID: training exited $status after the checkpoint request, requeueing"
    scontrol requeue "$SLURM_JOB_ID"
  fi
  return "$status"
}
