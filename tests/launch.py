"""Run the real scripts as subprocesses (python or torchrun) with a timeout, and read what they wrote: for
the tests, and for the benchmarks (which import it as tests.launch)."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "configs", "debug_tiny.json")
# common/load_weights.py's line for a release it cannot read per rank: every rank then loads it whole.
WHOLE_LOAD = "loading it whole through from_pretrained"


# The PyTorch/XLA environment .ci/run builds (requirements-xla.txt); where it could not, why, in the file.
XLA_PYTHON = os.environ.get("XLA_PYTHON", os.path.expanduser("~/.cache/fsdp2-recipes/xla-venv/bin/python"))
XLA_UNAVAILABLE = os.path.expanduser("~/.cache/fsdp2-recipes/xla-venv.failed")


def xla_unavailable() -> str:
    """The skip reason of a test that needs the PyTorch/XLA environment, where there is none."""
    reason = open(XLA_UNAVAILABLE).read().strip() if os.path.exists(XLA_UNAVAILABLE) else "not created"
    return f"no PyTorch/XLA environment at {XLA_PYTHON} ({reason}); see docs/tpu.md"


def free_port() -> int:
    """For launchers that default to port 29500: tests run in parallel (pytest-xdist) must not share it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra: str) -> dict:
    """Offline, unbuffered, one thread each; faulthandler prints every Python thread's stack on a crash."""
    out = dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        PYTHONFAULTHANDLER="1",
    )
    out.update(extra)
    return out


def run(
    script: str,
    args: list[str],
    nproc: int = 1,
    timeout: int = 300,
    check: bool = True,
    extra_env: dict | None = None,
    launcher: list[str] | None = None,
    wrapper: str | None = None,
) -> subprocess.CompletedProcess:
    """nproc == 0 runs plain `python`; otherwise `torchrun --standalone --nproc_per_node nproc`. `wrapper`: a
    test-side script in tests/ that patches the recipe from the outside, then runs it (with_faults.py)."""
    paths = [os.path.join(REPO, "scripts", script)]
    if wrapper is not None:
        paths.insert(0, os.path.join(REPO, "tests", wrapper))
    if launcher is not None:
        cmd = [*launcher, *paths, *args]
    elif nproc == 0:
        cmd = [sys.executable, *paths, *args]
    else:
        cmd = [*torchrun(nproc), *paths, *args]
    return run_command(cmd, timeout, check, extra_env)


def torchrun(nproc: int) -> list[str]:
    """The launcher prefix for `nproc` processes on this host."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def each_rank(
    script: str,
    args: list[str],
    nproc: int = 2,
    timeout: int = 300,
    extra_env: dict | None = None,
    wrapper: str | None = None,
) -> list[tuple[int, str]]:
    """(exit code, stderr) of each rank, started as torchrun starts them but not under torchrun: torchrun
    stops the other ranks as soon as one exits, sometimes before they have printed their own line."""
    paths = [os.path.join(REPO, "scripts", script)]
    if wrapper is not None:
        paths.insert(0, os.path.join(REPO, "tests", wrapper))
    ranks = dict(WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    ranks.update(LOCAL_WORLD_SIZE=str(nproc), **(extra_env or {}))
    logs = [tempfile.TemporaryFile("w+") for _ in range(nproc)]  # files: a full pipe would stop a rank
    procs = [
        subprocess.Popen(
            [sys.executable, *paths, *args],
            cwd=REPO,
            env=env(RANK=str(r), LOCAL_RANK=str(r), **ranks),
            stdout=subprocess.DEVNULL,
            stderr=logs[r],
        )
        for r in range(nproc)
    ]
    try:
        results = []
        for proc, log in zip(procs, logs):
            proc.wait(timeout=timeout)
            log.seek(0)
            results.append((proc.returncode, log.read()))
        return results
    finally:
        for proc, log in zip(procs, logs):
            proc.kill()
            log.close()


def run_command(
    cmd: list[str], timeout: int = 300, check: bool = True, extra_env: dict | None = None
) -> subprocess.CompletedProcess:
    """Any command with env() and a timeout; a failure raises with the end of its stdout and stderr, where
    faulthandler's stacks land."""
    proc = subprocess.run(
        cmd, cwd=REPO, env=env(**(extra_env or {})), capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def pretrain(run_dir, *overrides: str, nproc: int = 2, config: str = TINY, **kwargs) -> list[dict]:
    run(
        "pretrain_fsdp.py",
        ["--config", config, f"checkpoint.dir={run_dir}", *overrides],
        nproc=nproc,
        **kwargs,
    )
    return read_metrics(run_dir)


def read_metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def steps(records: list[dict]) -> list[dict]:
    """The per-step training records (events such as checkpoints also carry a step)."""
    return [r for r in records if "step" in r and "event" not in r]


def losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in steps(records)]


def event(records: list[dict], name: str) -> dict:
    return next(r for r in records if r.get("event") == name)


def write_short_documents(path, seed: int = 0) -> str:
    """A JSONL corpus of 600 documents of 5-40 words, so packed rows of 64+ tokens hold several documents."""
    rng = random.Random(seed)
    words = "the model reads every token of a short document and then another one begins after it".split()
    with open(path, "w") as f:
        for _ in range(600):
            f.write(json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(5, 40)))}) + "\n")
    return str(path)


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% if m['role'] == 'assistant' %}<|eos|>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def release_tokenizer():
    """A tokenizer of the test releases' own, not the embedded one: byte-level BPE with 1,024 ids (pad 0,
    bos 1, eos 2) and a chat template, trained on a fixed text, so every test builds the same one."""
    import inspect
    import json as text_source

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=1024, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    sums = [f"{a}+{b}={a + b}" for a in range(0, 100, 3) for b in range(0, 100, 7)]
    tok.train_from_iterator([*sums, *inspect.getsource(text_source).splitlines()], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        chat_template=CHAT_TEMPLATE,
    )


def save_release(model, path, **save_kwargs) -> str:
    """A checkpoint as releases ship it: the weights and config, with a tokenizer of its own."""
    model.save_pretrained(path, **save_kwargs)
    release_tokenizer().save_pretrained(path)
    return str(path)


def plant_trained_biases(model, std: float = 0.1) -> None:
    """Every bias non-zero, as in a trained checkpoint: Transformers initialises them at zero, which hides a
    bias a recipe leaves out (or a bias buffer it casts)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    for name, parameter in model.named_parameters():
        if name.endswith("bias"):
            parameter.data.normal_(0.0, std, generator=generator)
    for name, buffer in model.named_buffers():  # DeepSeek-V3's e_score_correction_bias, a saved buffer
        if name.endswith("_bias") and buffer.is_floating_point():
            buffer.normal_(0.0, std, generator=generator)


def save_hf_llama(path, hidden_size: int, intermediate_size: int):
    """A random 6-layer Llama with a 4096-token vocabulary, as save_pretrained writes it: an HF checkpoint
    large enough for a memory figure to stand out."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    save_release(LlamaForCausalLM(config), path)
    return path


def estimate(config: str, world: int, *overrides: str, device: str = "cpu", quick: bool = False) -> dict:
    """The planner's report. `quick`: the peak and the state bytes only, without its search (the largest
    micro-batch, the alternatives), which tests/test_estimate_at_scale.py covers."""
    cmd = [sys.executable, os.path.join(REPO, "scripts", "estimate_memory.py"), "--config", config]
    cmd += [
        "--world-size",
        str(world),
        "--device",
        device,
        "--json",
        *(["--quick"] if quick else []),
        *overrides,
    ]
    return json.loads(run_command(cmd, timeout=600).stdout.strip().splitlines()[-1])


def run_recipe(
    world: int,
    overrides: list[str],
    extra_env: dict | None = None,
    script: str = "pretrain_fsdp.py",
    config: str = TINY,
) -> list[dict]:
    """A benchmark's run: `world` ranks under torchrun in a scratch directory, no export; its records."""
    with tempfile.TemporaryDirectory() as run_dir:
        args = [
            "--config",
            config,
            f"checkpoint.dir={run_dir}",
            "checkpoint.export=false",
            "metrics.tensorboard=false",
        ]
        run(script, [*args, *overrides], nproc=world, timeout=3600, extra_env=extra_env)
        return read_metrics(run_dir)


def tiny() -> bool:
    """`--tiny` on a benchmark's command line: the smallest sizes, so the test suite checks it still runs
    (its numbers then mean nothing)."""
    return "--tiny" in sys.argv[1:]


def steady_step(records: list[dict]) -> dict:
    """The median step by tokens/s, leaving out the first two (allocator and, with compile, tracing)."""
    ordered = sorted((r for r in steps(records) if r["step"] > 2), key=lambda r: r["tokens_per_s"])
    return ordered[len(ordered) // 2]


def last_step(records: list[dict]) -> dict:
    return steps(records)[-1]


def final(records: list[dict]) -> dict:
    return event(records, "final")


def assert_same_weights(ours, theirs) -> int:
    """The same safetensors files, index and tensors, bit for bit; returns how many files."""
    import torch
    from safetensors import safe_open

    files = sorted(name for name in os.listdir(ours) if name.endswith(".safetensors"))
    assert files == sorted(name for name in os.listdir(theirs) if name.endswith(".safetensors"))
    if len(files) > 1:
        assert json.loads((ours / "model.safetensors.index.json").read_text()) == json.loads(
            (theirs / "model.safetensors.index.json").read_text()
        )
    for name in files:
        with safe_open(ours / name, "pt") as a, safe_open(theirs / name, "pt") as b:
            assert sorted(a.keys()) == sorted(b.keys())
            assert all(torch.equal(a.get_tensor(key), b.get_tensor(key)) for key in a.keys())
    return len(files)


def host_memory_env(out, rank0_copy=None) -> dict[str, str]:
    """What tests/with_host_memory.py reads: where its records go (`out`), and where rank 0 also writes the
    gathered export, for contrast. glibc returns large blocks to the kernel, so a peak is what was live."""
    env = {"MALLOC_MMAP_THRESHOLD_": "131072", "HOST_MEMORY_OUT": str(out)}
    if rank0_copy is not None:
        env["EXPORT_ON_RANK0_TOO"] = str(rank0_copy)
    return env


def anonymous_rise(path: str) -> float:
    """MiB: with_host_memory.py's peak anonymous memory over its start."""
    with open(path) as f:
        memory = json.load(f)
    return memory["peak"]["RssAnon"] - memory["before"]["RssAnon"]


def anonymous_rises(out, window: str, world: int = 2) -> list[float]:
    """MiB, per rank: anonymous_rise in with_host_memory.py's `window` (load, export, export_on_rank0)."""
    return [anonymous_rise(f"{out}.{window}.rank{rank}.json") for rank in range(world)]
