"""The sbatch files on a real two-node Slurm cluster on loopback (tests/slurm/cluster.sh), and multi-node
torchrun without Slurm."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from launch import REPO, TINY, env, event, losses, read_metrics, steps

CLUSTER = os.path.join(REPO, "tests", "slurm", "cluster.sh")
# the 8-node file, overridden on the command line
SBATCH_CPU = [
    "--nodes=2",
    "--gpus-per-node=0",
    "--time=15",
]


@pytest.fixture(scope="module")
def slurm_env():
    if shutil.which("slurmctld") is None or shutil.which("munged") is None:
        pytest.skip(
            "Slurm is not installed (apt-get install slurmctld slurmd slurm-client munge; .ci/run does)"
        )
    if os.geteuid() != 0:
        pytest.skip("the loopback Slurm cluster needs root")
    state = f"/tmp/fsdp2-recipes-slurm-{os.getpid()}"
    started = subprocess.run(["bash", CLUSTER, "start", state], capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr
    yield env(SLURM_CONF=f"{state}/slurm.conf", NPROC_PER_NODE="1", NETWORK="tcp")
    subprocess.run(["bash", CLUSTER, "stop", state], timeout=60)


def sbatch(slurm_env, tmp_path, *args: str, wait: bool, script: str = "8node.sh", config: str = TINY) -> str:
    cmd = [
        "sbatch",
        "--parsable",
        *(["--wait"] if wait else []),
        *SBATCH_CPU,
        f"--output={tmp_path}/%j.out",
        os.path.join("slurm", script),
        config,
        f"checkpoint.dir={tmp_path}/run",
        *args,
    ]
    proc = subprocess.run(
        cmd,
        cwd=REPO,
        env={**slurm_env, "FSDP2_RECIPES_PREEMPT_FILE": f"{tmp_path}/preempt"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, (
        proc.stdout,
        proc.stderr,
        open(next(tmp_path.glob("*.out"))).read() if wait else "",
    )
    return proc.stdout.strip().split(";")[0]


def job_state(slurm_env, job: str) -> str:
    out = subprocess.run(
        ["squeue", "-h", "-j", job, "-o", "%T"], env=slurm_env, capture_output=True, text=True
    )
    return out.stdout.strip()


def job_report(slurm_env, job: str, log_path) -> str:
    """What a failed wait shows: Slurm's record of the job, the controller's last lines and the job's log."""
    show = subprocess.run(["scontrol", "show", "job", job], env=slurm_env, capture_output=True, text=True)
    ctld_log = os.path.join(os.path.dirname(slurm_env["SLURM_CONF"]), "log", "slurmctld.log")
    ctld = open(ctld_log).read()[-3000:] if os.path.exists(ctld_log) else ""
    job_log = log_path.read_text()[-4000:]
    return f"{show.stdout}{show.stderr}\n--- slurmctld.log\n{ctld}\n--- {log_path}\n{job_log}"


@pytest.mark.slurm
def test_two_node_sbatch_trains_and_exits_0(slurm_env, tmp_path):
    job = sbatch(slurm_env, tmp_path, "train.steps=4", wait=True)
    log = open(tmp_path / f"{job}.out").read()
    assert "2 nodes x 1" in log
    records = read_metrics(tmp_path / "run")
    assert event(records, "model_ready")["world_size"] == 2 and len(losses(records)) == 4
    assert (tmp_path / "run" / "export" / "model.safetensors").exists()


@pytest.mark.slurm
def test_preemption_checkpoints_requeues_and_resumes(slurm_env, tmp_path):
    job = sbatch(slurm_env, tmp_path, "train.steps=40", wait=False)
    log_path = tmp_path / f"{job}.out"
    deadline = time.monotonic() + 300
    while not (log_path.exists() and "step 3 " in log_path.read_text()):
        assert time.monotonic() < deadline, "the job never reached step 3"
        time.sleep(1)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=slurm_env, check=True)
    # Done when the job has left the queue after its second run started; squeue can briefly list nothing
    # while a job is being requeued, so an empty state alone does not mean finished.
    while (state := job_state(slurm_env, job)) != "" or "(restart 1)" not in log_path.read_text():
        assert time.monotonic() < deadline + 300, (
            f"job {job} still {state!r}\n{job_report(slurm_env, job, log_path)}"
        )
        if state == "PENDING":
            # Slurm delays a requeued job's start by about two minutes (and may set that delay after an early
            # update): the test keeps asking for now instead of waiting.
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=slurm_env)
        time.sleep(3)
    log = log_path.read_text()
    assert "USR1 received" in log and "training exited 0 after the checkpoint request, requeueing" in log
    assert "(restart 1)" in log
    records = read_metrics(tmp_path / "run")
    stopped = event(records, "stopped")
    assert stopped["reason"] == "preempted"
    assert (tmp_path / "run" / "checkpoints").exists()
    starts = [r["start_step"] for r in records if r.get("event") == "model_ready"]
    assert starts == [0, stopped["step"]]  # the second run resumed from the preemption checkpoint
    assert [r["step"] for r in steps(records)] == list(range(1, 41))
    assert event(records, "exported")


@pytest.mark.slurm
def test_eval_cp_sbatch_splits_a_sequence_across_two_nodes(slurm_env, tmp_path):
    subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "scripts", "pretrain_fsdp.py"),
            "--config",
            TINY,
            f"checkpoint.dir={tmp_path}/trained",
            "train.steps=2",
        ],
        env=env(),
        check=True,
        capture_output=True,
    )
    sbatch(
        slurm_env,
        tmp_path,
        f"model.name_or_path={tmp_path}/trained/export",
        "parallelism.cp_size=2",
        "data.seq_len=256",
        "eval.max_sequences=2",
        wait=True,
        script="eval_cp.sh",
        config=os.path.join(REPO, "configs", "debug_eval_cp.json"),
    )
    results = json.load(open(tmp_path / "run" / "eval_results.json"))
    assert results["cp_size"] == 2 and results["tokens"] == 2 * 256


@pytest.mark.slurm
def test_moe_sbatch_runs_expert_parallel_across_two_nodes(slurm_env, tmp_path):
    """ep=2 over one rank per node: every MoE layer's all-to-all crosses the (loopback) nodes."""
    sbatch(
        slurm_env,
        tmp_path,
        "parallelism.ep_size=2",
        "train.steps=3",
        "metrics.log_every=1",
        wait=True,
        script="moe_ep.sh",
        config=os.path.join(REPO, "configs", "debug_moe.json"),
    )
    records = read_metrics(tmp_path / "run")
    layout = event(records, "model_ready")["expert_layout_per_rank"]
    assert [r["mesh"] for r in layout] == [{"efsdp": 1, "ep": 2}] * 2 and len(losses(records)) == 3
    assert (tmp_path / "run" / "export" / "model.safetensors").exists()


def test_two_torchrun_agents_rendezvous_without_slurm(tmp_path):
    """docs/slurm.md's multi-node recipe without Slurm: two agents, --nnodes 2, a c10d rendezvous."""
    port = 29000 + os.getpid() % 1000
    cmd = [
        "torchrun",
        "--nnodes=2",
        "--nproc_per_node=1",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{port}",
        "--rdzv_id=two-agents",
        os.path.join(REPO, "scripts", "pretrain_fsdp.py"),
        "--config",
        TINY,
        f"checkpoint.dir={tmp_path}",
        "train.steps=2",
        "checkpoint.export=false",
    ]
    agents = [
        subprocess.Popen(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for _ in range(2)
    ]
    for agent in agents:
        assert agent.wait(timeout=300) == 0, agent.stdout.read().decode()[-3000:]
    assert event(read_metrics(tmp_path), "model_ready")["world_size"] == 2


def test_shell_scripts_parse_and_are_shellcheck_clean():
    scripts = [os.path.join(REPO, "slurm", f) for f in os.listdir(os.path.join(REPO, "slurm"))] + [
        CLUSTER,
        os.path.join(REPO, ".ci", "run"),
    ]
    for script in scripts:
        subprocess.run(["bash", "-n", script], check=True)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck; .ci/run does)")
    proc = subprocess.run(["shellcheck", "-x", *scripts], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
