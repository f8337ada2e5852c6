"""Test-only: run the recipes on many architectures in one launch, and record what a test compares with
Transformers' own model.

    torchrun --nproc_per_node 2 tests/arch_matrix.py OUT CHECKPOINTS llama gemma3_text ...

For each architecture, `CHECKPOINTS/<arch>` is a tiny random Transformers checkpoint (made by the test). This
calls the real scripts' main() one after the other in this process (one launch, so the import cost is paid
once): pretrain_fsdp.py full fine-tuning, eval_cp.py on its export, and pretrain_fsdp.py with LoRA (the MoE
architectures: finetune_moe_ep_fsdp.py at ep = world size). Patched from the outside, as tests/with_faults.py
does, it writes under `OUT/<arch>/<run>/`:
- `ready.pt` (rank 0): every parameter, full, and every buffer, persistent or not, right after loading;
- `fixed.pt` (rank 0): the fixed batch and the recipe's losses on it: the training path's, evaluate()'s;
- `step1-rank<r>.pt`: this rank's micro-batches of step 1 and the step's loss, and the full gradient norm of
  every parameter that got one (LoRA: the adapters');
- `eval-rank<r>.pt`: this rank's held-out batches of the first evaluation and its result.
A release with a processor also trains on the image-text records in `CHECKPOINTS/../shapes/` (runs `images`,
`images_vision` with its vision side trained, `images_lora`, `images_stream` streamed); without torchvision,
Qwen3-VL's and Gemma 4's processors are built with no video processor (tests/image_releases.py).
Never imported by scripts/ or common/.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.tensor import DTensor
from transformers import AutoConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from image_releases import processor_without_torchvision  # noqa: E402

from common import loss  # noqa: E402
from common.ops.cli import end_process  # noqa: E402

COMMON = ["data.dataset=arithmetic", "data.eval_dataset=arithmetic", "data.seq_len=64", "train.steps=2"]
COMMON += ["train.global_batch_size=8", "train.micro_batch_size=2", "train.warmup_steps=1", "train.lr=3e-3"]
COMMON += ["train.loss_chunk_tokens=32", "eval.loss_chunk_tokens=32", "model.config={}"]
COMMON += ["eval.interval=2", "eval.max_sequences=8", "eval.batch_size=2", "metrics.log_every=1"]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu().clone()


def clean(name: str) -> str:
    return name.replace(_CHECKPOINT_PREFIX, "").replace("_orig_mod.", "")


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def plain(batch) -> dict:
    return {k: getattr(batch, k) for k in ("input_ids", "labels", "position_ids", "images")}


def observe(script, out: str) -> None:
    """Wrap the script's helpers (module globals main() looks up when it calls them)."""
    os.makedirs(out, exist_ok=True)
    evaluate = script.evaluate
    seen = {"step": 0, "eval": 0}

    def load_or_set_aside(path, c, loader, model, *rest):
        result = load(path, c, loader, model, *rest)
        state = {clean(n): full(p) for n, p in model.named_parameters()}
        buffers = {clean(n): full(b) for n, b in model.named_buffers()}
        device = next(model.parameters()).device
        fixed, data = {}, rest[-1]
        if hasattr(data, "fixed_batch"):  # every rank scores the same batch: the means are one rank's
            batch = data.fixed_batch(2)
            with torch.no_grad():
                summed = loss.token_loss_sum(model, batch.labels.to(device), 32, **batch.model_inputs(device))
            scored = evaluate(model, [batch], device, None, 32)
            fixed = dict(batch=plain(batch), loss_sum=float(summed), evaluate=scored)
        if rank() == 0:
            torch.save({"parameters": state, "buffers": buffers}, os.path.join(out, "ready.pt"))
            torch.save(fixed, os.path.join(out, "fixed.pt"))
        return result

    def observed_train_step(model, optimizer, scheduler, micro_batches, *rest):
        seen["step"] += 1
        if seen["step"] > 1:
            return train_step(model, optimizer, scheduler, micro_batches, *rest)
        clip = script.clip_grad_norm_
        norms = {}

        def clip_and_record(parameters, max_norm):
            parameters = list(parameters)
            for name, p in model.named_parameters():
                if p.grad is not None:
                    norms[clean(name)] = float(full(p.grad).norm())
            return clip(parameters, max_norm)

        script.clip_grad_norm_ = clip_and_record
        try:
            result = train_step(model, optimizer, scheduler, micro_batches, *rest)
        finally:
            script.clip_grad_norm_ = clip
        batches = [plain(b) for b in micro_batches]
        torch.save(
            {"batches": batches, "result": result, "grad_norms": norms},
            os.path.join(out, f"step1-rank{rank()}.pt"),
        )
        return result

    def observed_evaluate(model, batches, *args, **kwargs):
        result = evaluate(model, batches, *args, **kwargs)
        if seen["eval"] == 0 and batches is not None:
            torch.save(
                {"batches": [plain(b) for b in batches], "result": result},
                os.path.join(out, f"eval-rank{rank()}.pt"),
            )
        seen["eval"] += 1
        return result

    script.evaluate = observed_evaluate
    if hasattr(script, "train_step"):  # the training recipes
        load, train_step = script.load_or_set_aside, script.train_step
        script.load_or_set_aside = load_or_set_aside
        script.train_step = observed_train_step


def fresh_groups() -> None:
    """Each main() makes and destroys its own default process group; a second one in the same process on the
    same store would meet the first one's keys (and hang), so each gets a store prefix of its own."""
    if "RANK" not in os.environ:
        return  # one process: the scripts make their own HashStore
    store = next(dist.rendezvous("env://"))[0]
    original, count = dist.init_process_group, [0]

    def init_process_group(backend, **kwargs):
        count[0] += 1
        kwargs.update(store=dist.PrefixStore(f"main{count[0]}/", store))
        kwargs.update(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        original(backend, **kwargs)

    dist.init_process_group = init_process_group


def main() -> None:
    """With --keep-going (one process only), an architecture that fails is written to OUT/<arch>/error.txt
    and the next one runs: a survey, not a test."""
    fresh_groups()
    keep_going = sys.argv[1] == "--keep-going"
    out, checkpoints, *archs = sys.argv[1 + keep_going :]
    for arch in archs:
        try:
            with processor_without_torchvision():
                run_architecture(out, checkpoints, arch)
        except Exception as error:
            if not keep_going:
                raise
            if dist.is_initialized():
                dist.destroy_process_group()
            with open(os.path.join(out, arch, "error.txt"), "w") as f:
                f.write(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}\n")


def run_architecture(out: str, checkpoints: str, arch: str) -> None:
    source = os.path.join(checkpoints, arch)
    base = [f"model.name_or_path={source}", *COMMON]
    world = int(os.environ.get("WORLD_SIZE", 1))
    text = AutoConfig.from_pretrained(source).get_text_config()  # an image-text release's language model
    # a MoE model: an expert plan, and experts built (Gemma 4's MoE block is optional)
    moe = getattr(text, "base_model_ep_plan", None) and getattr(text, "enable_moe_block", True)
    if moe:
        runs = [("full", "finetune_moe_ep_fsdp", [f"parallelism.ep_size={world}"])]
    else:
        runs = [("full", "pretrain_fsdp", []), ("lora", "pretrain_fsdp", ["lora.r=4", "lora.alpha=8"])]
    if os.path.exists(os.path.join(source, "processor_config.json")):  # image-text records too
        shapes = os.path.join(os.path.dirname(checkpoints), "shapes")
        images = [f"data.dataset={shapes}/train.jsonl", f"data.eval_dataset={shapes}/held_out.jsonl"]
        images += ["data.seq_len=128"]  # a Gemma 4 record is 85 tokens (64 an image); rows pad to the longest
        vision = ["model.freeze_vision_tower=false", "model.freeze_multi_modal_projector=false"]
        runs += [("images", "pretrain_fsdp", images), ("images_vision", "pretrain_fsdp", images + vision)]
        runs += [("images_lora", "pretrain_fsdp", [*images, "lora.r=4", "lora.alpha=8", vision[0]])]
        runs += [("images_stream", "pretrain_fsdp", [*images, "data.streaming=true"])]
    os.makedirs(os.path.join(out, arch), exist_ok=True)
    for run, name, extra in runs:
        run_dir = os.path.join(out, arch, run)
        script = load_script(name)
        observe(script, run_dir)
        config = os.path.join(REPO, "configs", "debug_tiny.json")
        script.main(["--config", config, *base, *extra, f"checkpoint.dir={run_dir}"])
        if run == "full":
            evaluation = load_script("eval_cp")
            observe(evaluation, os.path.join(out, arch, "eval_cp"))
            export = os.path.join(run_dir, "export")
            args = [f"model.name_or_path={export}", f"data.tokenizer={export}", *COMMON]
            evaluation.main(["--config", config, *args, f"checkpoint.dir={run_dir}-eval"])


if __name__ == "__main__":
    main()
    end_process(0)  # DTensor's meshes keep gloo threads that can abort interpreter teardown
