"""Quantized releases. Block-quantized FP8 (DeepSeek-V3's and Qwen3-FP8's layout: F8_E4M3 `weight` and an fp32
`weight_scale_inv` per block) is dequantized as it loads, each rank its own rows and columns (of experts: its
own experts), exactly as Transformers' Fp8Dequantize does; so are MXFP4 experts (gpt-oss), by Transformers'
own function. The model trains and exports in plain floating point. Any other quantization is refused in one
line: its dequantization is not this code's to guess."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor
from transformers import FineGrainedFP8Config, Mxfp4Config, PretrainedConfig
from transformers.core_model_loading import rename_source_key
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from common.config import ConfigError
from common.experts import local_box

SCALE_SUFFIX = "_scale_inv"  # FP8 weights: `<weight key>_scale_inv`, beside the weight
MXFP4 = ("_blocks", "_scales")  # MXFP4 experts (gpt-oss): `<weight key>_blocks` and `<weight key>_scales`


def check_quantization(hf_config: PretrainedConfig, source: str | None) -> None:
    """A block-quantized FP8 or an MXFP4 config is dropped (the model is built, trained and exported
    unquantized, its weights dequantized as they load); any other quantization_config is one line."""
    quantization = getattr(hf_config, "quantization_config", None)
    if quantization is None:
        return
    quantization = quantization if isinstance(quantization, dict) else quantization.to_dict()
    method = quantization.get("quant_method")
    block_fp8 = quantization.get("weight_block_size") and quantization.get("fmt", "e4m3") == "e4m3"
    if (method == "fp8" and block_fp8) or method == "mxfp4":
        del hf_config.quantization_config
        return
    detail = "per-tensor FP8" if method == "fp8" else method
    raise ConfigError(
        f"model.name_or_path {source!r} is quantized ({detail}), which the recipes do not dequantize (only "
        f"block-quantized FP8 and MXFP4); dequantize it with Transformers first (from_pretrained with "
        f"dtype=torch.bfloat16, then save_pretrained) and give that directory, or the unquantized release"
    )


def set_aside_quantized_keys(
    layout, located: dict, keys: list[str], renamings: list, converters: list
) -> tuple[list[str], dict]:
    """For checkpoint_layout: `keys` less the quantized weights' companions, and {an FP8 weight's key: its
    scales' key}. An MXFP4 weight's blocks and scales go into `layout.mxfp4` under the weight's name, as
    Transformers' Mxfp4Dequantize loads it. `located`: {key: (its file, its dtype)}."""
    plain, scale_keys = [], {}
    for key in keys:
        if key.endswith(SCALE_SUFFIX) and key.removesuffix(SCALE_SUFFIX) in located:
            scale_keys[key.removesuffix(SCALE_SUFFIX)] = key
            continue
        weight = key.rsplit("_", 1)[0]
        if key.endswith(MXFP4) and {weight + suffix for suffix in MXFP4} <= located.keys():
            if key.endswith(MXFP4[0]):
                blocks, scales = (weight + suffix for suffix in MXFP4)
                name = rename_source_key(weight, renamings, converters)[0]
                layout.mxfp4[name] = ((blocks, located[blocks][0]), (scales, located[scales][0]))
            continue
        plain.append(key)
    return plain, scale_keys


def attach_fp8_scales(layout, located: dict, scale_keys: dict, path: str) -> None:
    """Each F8_E4M3 weight's scales into `layout`: a weight's under our name (`scales`), an expert's under
    its key (`expert_scales`: Transformers fuses experts as it loads). Block scales of any other dtype (packed
    FP4) are one line."""
    fp8 = {key: scale_keys.pop(key) for key in list(scale_keys) if located[key][1] == "F8_E4M3"}
    for name, key in layout.names.items():
        if key in fp8:
            scale = fp8.pop(key)
            layout.scales[name] = (scale, located[scale][0])
    layout.expert_scales = {key: (scale, located[scale][0]) for key, scale in fp8.items()}
    if scale_keys:
        key = next(iter(scale_keys))
        raise ConfigError(
            f"model.name_or_path {path!r}: {key} ({located[key][1]}) has block scales, which the recipes "
            f"dequantize only for F8_E4M3 weights; dequantize it with Transformers first "
            f"(from_pretrained with dtype=torch.bfloat16, then save_pretrained)"
        )


def dequantizing(path: str) -> dict:
    """from_pretrained's keywords that dequantize an FP8 or MXFP4 release on any device (with a GPU it would
    keep quantized layers), for a model loaded whole."""
    quantization = PretrainedConfig.get_config_dict(path)[0].get("quantization_config") or {}
    if quantization.get("quant_method") == "mxfp4":
        return {"quantization_config": Mxfp4Config(dequantize=True)}
    if quantization.get("quant_method") != "fp8":
        return {}
    block = quantization.get("weight_block_size")
    return {"quantization_config": FineGrainedFP8Config(dequantize=True, weight_block_size=block)}


def dequantize_own_blocks(ours: dict[str, torch.Tensor], scales: dict[str, tuple[str, str]]) -> None:
    """`ours` holds each FP8 weight's values as read (fp8 to fp32 is exact); multiply this rank's rows and
    columns in place by their blocks' scales, read for those blocks only. Transformers computes
    `q.float() * scale` per element in fp32 too, so the result is its dequantization bit for bit.
    `scales`: {our name: (the scale's key, its file)}."""
    with ExitStack() as stack:
        opened = {}
        for name, (key, file) in scales.items():
            shard = ours[name]
            local = shard.to_local() if isinstance(shard, DTensor) else shard
            if local.numel() == 0:
                continue  # an empty shard (FSDP's padding)
            if file not in opened:
                opened[file] = stack.enter_context(safe_open(file, framework="pt"))
            grid = opened[file].get_slice(key)
            block_rows, block_cols = block_shape(file, key, grid.get_dtype(), grid.get_shape(), shard.shape)
            r, c = local_box(shard)
            first_row, first_col = r.start // block_rows, c.start // block_cols
            blocks = grid[
                first_row : (r.stop - 1) // block_rows + 1, first_col : (c.stop - 1) // block_cols + 1
            ]
            skip_cols = c.start - first_col * block_cols
            for i, row_of_scales in enumerate(blocks.float(), start=first_row):  # a band of rows at a time:
                per_column = row_of_scales.repeat_interleave(block_cols)  # no shard-sized temporary
                band = slice(
                    max(r.start, i * block_rows) - r.start, min(r.stop, (i + 1) * block_rows) - r.start
                )
                local[band].mul_(per_column[skip_cols : skip_cols + local.shape[1]])


def dequantize_own_mxfp4(ours: dict[str, torch.Tensor], packed: dict[str, tuple]) -> None:
    """MXFP4 experts (gpt-oss's [experts, in, out] weights, stored as [experts, out, in / 32, 16] FP4 pairs
    and an E8M0 exponent per 32): this rank's experts and columns only, dequantized by Transformers' own
    function into the parameter's dtype, in which every FP4 value times a power of two is exact.
    `packed`: {our name: ((the blocks' key, file), (the scales' key, file))}."""
    for name, ((blocks_key, blocks_file), (scales_key, scales_file)) in packed.items():
        shard = ours.get(name)
        if shard is None or shard.dim() != 3:
            raise ConfigError(
                f"{blocks_file}: {blocks_key} is MXFP4, which Transformers dequantizes for experts only; "
                f"dequantize it with Transformers first (from_pretrained, then save_pretrained)"
            )
        local = shard.to_local() if isinstance(shard, DTensor) else shard
        if local.numel() == 0:
            continue  # an empty shard (FSDP's padding)
        experts, rows, cols = local_box(shard)
        with safe_open(blocks_file, framework="pt") as f:
            blocks = f.get_slice(blocks_key)[experts, cols]
        with safe_open(scales_file, framework="pt") as f:
            scales = f.get_slice(scales_key)[experts, cols]
        local.copy_(convert_moe_packed_tensors(blocks, scales, dtype=local.dtype)[:, rows])


def expert_dequantizer(scales: dict[str, tuple[str, str]]) -> Callable:
    """For common/experts.py, which reads each expert's weight whole (a rank reads only its own experts):
    an FP8 one times its blocks' scales, per element in fp32 as Transformers' Fp8Dequantize computes it.
    `scales`: {the weight's key: (its scales' key, their file)}."""

    def dequantize(key: str, tensor: torch.Tensor, read: Callable) -> torch.Tensor:
        if key not in scales:
            return tensor
        grid = read(*scales[key])
        block_rows, block_cols = block_shape(
            scales[key][1], scales[key][0], grid.dtype, grid.shape, tensor.shape
        )
        return tensor.float() * grid.float().repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)

    return dequantize


def block_shape(file: str, key: str, dtype, grid_shape, shape) -> tuple[int, int]:
    """The rows and columns of a weight each of its scales covers; scales that are not floats (MXFP8's E8M0
    exponents) or do not tile a 2-D weight are one line."""
    if str(dtype).removeprefix("torch.") not in ("F32", "BF16", "F16", "float32", "bfloat16", "float16"):
        raise ConfigError(f"{file}: {key} holds {dtype} scales; only float scales dequantize")
    (rows, cols), (grid_rows, grid_cols) = shape[-2:], grid_shape[-2:]
    if len(shape) != 2 or rows % grid_rows or cols % grid_cols:
        raise ConfigError(
            f"{file}: {key} is a {grid_rows}x{grid_cols} grid of scales for a weight of shape {list(shape)}, "
            f"which Transformers does not dequantize either"
        )
    return rows // grid_rows, cols // grid_cols
