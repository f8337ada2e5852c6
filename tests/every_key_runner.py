"""The runner of tests/test_every_key.py's table: `python tests/every_key_runner.py PLAN OUT` runs each
planned run in this one process (one import of torch and Transformers for them all) and writes what each
wrote. It imports neither pytest nor the test helpers, so the XLA recipe's runs go through it in the
PyTorch/XLA environment too (with torch_xla the recipe's main() runs; without, what it checks before)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def _load(script: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(script, os.path.join(REPO, "scripts", f"{script}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _layout(model, counts: dict) -> dict:
    """What apply_fsdp built: its counts, and the model's own settings that no metric shows."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule

    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
    groups = [g for g in groups if g is not None]
    return {
        **counts,
        "attn": model.config._attn_implementation,
        "gradient_checkpointing": model.is_gradient_checkpointing,
        "checkpointed": sum(isinstance(m, CheckpointWrapper) for m in model.modules()),
        "offload": sorted({type(g.offload_policy).__name__ for g in groups}),
        "reshard": sorted({g.post_forward_mesh_info is not None for g in groups}),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }


class _SummaryWriter:
    """Stands in for TensorBoard's when it is not installed: metrics.tensorboard then still shows whether
    the recipe asked for a writer, and what it wrote."""

    def __init__(self, log_dir: str):
        os.makedirs(log_dir, exist_ok=True)
        self.file = open(os.path.join(log_dir, "scalars.txt"), "a")

    def add_scalar(self, tag, value, step):
        self.file.write(f"{tag} {step} {value}\n")

    def close(self):
        self.file.close()


class _ReachedTheProcessGroup(Exception):
    pass


def _count_forwards(model) -> list:
    """Each forward's batch shape, as the model runs."""
    forwards = []

    def count(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        forwards.append(list(ids.shape) if ids is not None else None)

    model.register_forward_pre_hook(count, with_kwargs=True)
    return forwards


def _damaged_copy(export: str, path: str) -> None:
    """A copy of an export with one byte of its weights flipped: its manifest's checksum no longer holds."""
    shutil.copytree(export, path)
    with open(os.path.join(path, "model.safetensors"), "r+b") as f:
        header = int.from_bytes(f.read(8), "little")
        f.seek(8 + header + 100)
        byte = f.read(1)
        f.seek(8 + header + 100)
        f.write(bytes([byte[0] ^ 0xFF]))


def _run_one(module, script: str, argv: list[str], until_group: bool) -> dict:
    import importlib.util

    import torch.distributed as dist

    from common.config import ConfigError
    from common.mesh import init_distributed, resolve_device

    out = {"error": None, "before_group": None, "layout": {}}
    xla = importlib.util.find_spec("torch_xla") is not None
    if until_group:  # what init_distributed checks, then stop: the rest is the run itself

        def stop_at_the_process_group(device_preference, timeout_minutes):
            resolve_device(device_preference)
            raise _ReachedTheProcessGroup

        module.init_distributed = stop_at_the_process_group
    captured = io.StringIO()
    original = getattr(module, "apply_fsdp", None)
    built = getattr(module, "build_model", None)  # the XLA recipe's, which no apply_fsdp follows
    if original is not None:

        def apply_fsdp(model, *args, **kwargs):
            counts = original(model, *args, **kwargs)
            out["layout"] = _layout(model, counts)
            out["layout"]["forwards"] = _count_forwards(model)
            return counts

        module.apply_fsdp = apply_fsdp
    elif built is not None and xla:

        def build_model(*args, **kwargs):
            model = built(*args, **kwargs)
            out["layout"]["forwards"] = _count_forwards(model)
            return model

        module.build_model = build_model
    try:
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            if script == "tpu_xla_fsdp" and not xla:  # its main() needs torch_xla: what it checks before
                cfg = module.parse_args(argv)
                module.xla_settings(cfg.fsdp)
                module.check_xla_config(cfg, 4)
                module.wrap_plan(module.build_model(cfg), cfg.fsdp, cfg.fsdp.xla_fsdp_grad_ckpt)
            else:
                module.main(argv)
    except _ReachedTheProcessGroup:
        pass
    except ConfigError as error:
        out["error"], out["before_group"] = f"config error: {error}", not dist.is_initialized()
    except Exception as error:  # noqa: BLE001 - a crash is a finding, reported with its traceback
        out["error"] = f"crash: {type(error).__name__}: {error}\n{traceback.format_exc()[-3000:]}"
    finally:
        if original is not None:
            module.apply_fsdp = original
        if built is not None:
            module.build_model = built
        if hasattr(module, "init_distributed"):
            module.init_distributed = init_distributed
        if dist.is_initialized():
            dist.destroy_process_group()
    out["out"] = captured.getvalue()
    return out


def _run_plan(plan_path: str, out_path: str) -> None:
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        import types

        sys.modules["torch.utils.tensorboard"] = types.SimpleNamespace(SummaryWriter=_SummaryWriter)
    with open(plan_path) as f:
        plan = json.load(f)
    modules, results = {}, {}
    for item in plan:
        script, run_dir = item["script"], item["dir"]
        module = modules.setdefault(script, _load(script))
        if item.get("copy_from"):  # a run that starts where another one ended (checkpoint.resume)
            shutil.copytree(results[item["copy_from"]]["dir"], run_dir)
        if item.get("damage"):  # a run that loads an earlier run's export, damaged: (that export, the copy)
            _damaged_copy(*item["damage"])
        argv = item["argv"]
        words = ["--config", argv[0], f"checkpoint.dir={run_dir}", *argv[1:]]
        out = _run_one(module, script, words, item["until_group"])
        out["dir"] = run_dir
        watched = item["watch"]
        out["watched"] = sorted(os.listdir(watched)) if watched and os.path.isdir(watched) else None
        out["files"] = sorted(
            os.path.relpath(os.path.join(root, name), run_dir)
            for root, _, names in os.walk(run_dir)
            for name in names
        )
        out["records"] = []
        if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
            with open(os.path.join(run_dir, "metrics.jsonl")) as f:
                out["records"] = [json.loads(line) for line in f]
        out["results"] = None
        if os.path.exists(os.path.join(run_dir, "eval_results.json")):
            with open(os.path.join(run_dir, "eval_results.json")) as f:
                out["results"] = json.load(f)
        results[item["id"]] = out
    with open(out_path, "w") as f:
        json.dump(results, f)
    sys.stdout.flush()
    os._exit(0)  # gloo's threads of the runs above may still hold tensors: no interpreter teardown


if __name__ == "__main__":
    _run_plan(*sys.argv[1:3])
