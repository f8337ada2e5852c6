"""Image-text SFT records, in TRL's format: a `messages` column whose contents list {"type": "image"} and
{"type": "text", "text": ...} parts, and an `images` column (paths, relative to the data file, or the datasets
Image feature). The release's own processor (AutoProcessor: its chat template and image tokens) renders them;
the loss is on the answers only, as for text SFT. One example per row: an image's tokens are never split
across rows or packed with another example's (docs/finetune.md, "Image-text records")."""

from __future__ import annotations

import os

import numpy as np
import torch

from common.config import ConfigError, DataConfig, EvalConfig, TrainConfig
from common.data.batches import PAD, Batch, LocalBatches, prepare_local_data
from common.data.checks import held_out_source
from common.data.embedded import embedded_tokenizer_dir, ensure_embedded_tokenizer
from common.data.files import file_fingerprint, load_local, local_files

# TRL's columns of media beside `messages`; only images are rendered, the others are one line
MEDIA_COLUMNS = ("images", "videos", "audios", "video", "audio")
SHAPES = "shapes"  # the built-in image task: a coloured shape -> "a red circle"
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 40), "blue": (40, 60, 220), "yellow": (230, 200, 30)}
# Gemma 3's image tokens, added to the embedded tokenizer for a model from scratch (configs/debug_vlm.json)
EMBEDDED_IMAGE_TOKENS = {
    "boi_token": "<start_of_image>",
    "image_token": "<image_soft_token>",
    "eoi_token": "<end_of_image>",
}
EMBEDDED_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}:\n{% for p in m['content'] %}{% if p['type'] == 'image' %}"
    "<start_of_image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% if m['role'] == 'assistant' %}"
    "<|endoftext|>{% endif %}\n{% endfor %}{% if add_generation_prompt %}assistant:\n{% endif %}"
)


def shape_records(split: str) -> list[dict]:
    """The built-in task, made on the fly: 1,000 training records (any other split: 100 held out), each a
    32x32 image of one coloured circle, square or triangle of random size and place, asked what it shows."""
    import random

    from PIL import Image, ImageDraw

    rng, records = random.Random(0 if split == "train" else 1), []
    for _ in range(1000 if split == "train" else 100):
        colour, shape = rng.choice(list(COLOURS)), rng.choice(["circle", "square", "triangle"])
        size, x, y = rng.randint(10, 20), rng.randint(0, 10), rng.randint(0, 10)
        image = Image.new("RGB", (32, 32), "white")
        draw, box = ImageDraw.Draw(image), (x, y, x + size, y + size)
        if shape == "triangle":
            draw.polygon([(x, y + size), (x + size, y + size), (x + size // 2, y)], fill=COLOURS[colour])
        else:
            (draw.ellipse if shape == "circle" else draw.rectangle)(box, fill=COLOURS[colour])
        question = [{"type": "image"}, {"type": "text", "text": "What is this?"}]
        answer = [{"type": "text", "text": f"a {colour} {shape}"}]
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        records.append({"messages": messages, "images": [image]})
    return records


def has_images(source: str | list | None, split: str = "train") -> bool:
    """Whether `source` is the built-in shapes task, or its first record is an image-text conversation
    (`messages` and `images`)."""
    if source == SHAPES:
        return True
    if not isinstance(source, (str, list)) or source in ("embedded", "arithmetic"):
        return False
    from common.data.sft import first_record  # sft reads records; this module renders them

    first = first_record(source, split)
    return "messages" in first and any(column in first for column in MEDIA_COLUMNS)


def refuse_images(cfg: DataConfig, why: str, training: bool = True) -> None:
    """One line where a recipe, or a setting, does not train on image-text records yet, in data.dataset
    (`training`) or the held-out set."""
    sources = [("data.dataset", cfg.dataset, cfg.split)] if training else []
    for key, source, split in [*sources, held_out_source(cfg)]:
        if has_images(source, split):
            raise ConfigError(f"{key} {source!r} holds image-text records (an 'images' column) but {why}")


def load_processor(cfg: DataConfig):
    """The release's processor: its tokenizer, image processor and chat template. A text model has none."""
    from transformers import AutoProcessor

    if cfg.tokenizer is None:
        return embedded_processor(cfg)
    try:
        processor = AutoProcessor.from_pretrained(cfg.tokenizer)
    except Exception as e:  # a text model's directory, or a processor this install cannot build
        raise ConfigError(
            f"data.dataset {cfg.dataset!r} holds image-text records but no image processor loads from "
            f"data.tokenizer {cfg.tokenizer!r} ({str(e).splitlines()[0]}); train them on an image-text "
            f"release"
        ) from None
    if getattr(processor, "image_processor", None) is None:
        raise ConfigError(
            f"data.dataset {cfg.dataset!r} holds image-text records but data.tokenizer {cfg.tokenizer!r} has "
            f"no image processor (a text model); train them on an image-text release"
        )
    return processor


def embedded_processor(cfg: DataConfig):
    """For a model from scratch: Gemma 3's processor (32x32 images as 4 image tokens) on the embedded
    tokenizer with Gemma 3's image tokens added, which take ids 4096-4098 of the default 4,096."""
    from transformers import AutoTokenizer, Gemma3ImageProcessorPil, Gemma3Processor

    tokenizer = AutoTokenizer.from_pretrained(
        embedded_tokenizer_dir(cfg), extra_special_tokens=EMBEDDED_IMAGE_TOKENS
    )
    images = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    return Gemma3Processor(images, tokenizer, chat_template=EMBEDDED_CHAT_TEMPLATE, image_seq_length=4)


def read_records(source: str | list, split: str, key: str):
    """The records (a datasets.Dataset, or the built-in task's list), and the folder relative image paths
    start from."""
    import datasets

    if source == SHAPES:
        return shape_records(split), None
    files = local_files(source)
    try:
        if files:
            return load_local(files, "train"), os.path.dirname(files[0])
        return datasets.load_dataset(source, split=split), None
    except Exception as e:  # the hub client and the file readers raise many types
        raise ConfigError(f"{key} {source!r} could not be read ({str(e).splitlines()[0]})") from None


def check_modalities(record: dict, key: str) -> None:
    """Text and images only: a video or audio column, or part, is one line naming it."""
    parts = {
        p.get("type") for m in record["messages"] if isinstance(m["content"], list) for p in m["content"]
    }
    others = sorted(c for c in MEDIA_COLUMNS if c != "images" and record.get(c)) + sorted(
        parts - {"text", "image"}
    )
    if others:
        raise ConfigError(
            f"{key}: a record holds {others[0]!r} inputs, which the recipes do not render (text, and images "
            f"in an 'images' column, only); remove them, or train on text"
        )


def open_images(record: dict, folder: str | None, key: str) -> list:
    """The record's images as RGB PIL images, in the order its image parts name them."""
    from PIL import Image

    check_modalities(record, key)
    images = []
    for value in record.get("images") or []:
        if isinstance(value, dict):  # the datasets Image feature, undecoded
            value = value.get("path") if value.get("bytes") is None else value
        if isinstance(value, str):
            path = value if folder is None or os.path.isabs(value) else os.path.join(folder, value)
            try:
                value = Image.open(path)
            except OSError as e:
                raise ConfigError(f"{key}: the image {path!r} cannot be opened ({e})") from None
        elif isinstance(value, dict):
            import io

            value = Image.open(io.BytesIO(value["bytes"]))
        images.append(value.convert("RGB"))
    parts = sum(
        1
        for message in record["messages"]
        if isinstance(message["content"], list)
        for part in message["content"]
        if part.get("type") == "image"
    )
    if parts != len(images):
        raise ConfigError(
            f"{key}: a record has {parts} image parts in its messages but {len(images)} images; give one "
            f"image per {{'type': 'image'}} part, in order"
        )
    return images


def render(processor, messages: list[dict], images: list, prompt: bool = False) -> list[int]:
    """The processor's token ids for `messages` with the images their parts name."""
    text = processor.apply_chat_template(messages, add_generation_prompt=prompt, tokenize=False)
    shown = sum(
        1 for m in messages if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image"
    )
    images = [images[:shown]] if shown else None
    # The chat template writes the special tokens (BOS): the processor adds none again, as TRL's collator
    return list(processor(text=[text], images=images, add_special_tokens=False)["input_ids"][0])


def example_tokens(processor, record: dict, folder: str | None, key: str) -> tuple[list[int], list[int]]:
    """(token ids, 1 on each assistant turn's tokens), as text SFT's chat records have them."""
    messages, images = record["messages"], open_images(record, folder, key)
    ids = render(processor, messages, images)
    answer = [0] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start, through = (
            len(render(processor, messages[:i], images, True)),
            render(processor, messages[: i + 1], images),
        )
        if ids[: len(through)] != through:
            raise ConfigError(
                f"{key}: the processor's chat template renders a conversation differently from its prefixes, "
                f"so the assistant's tokens cannot be located"
            )
        answer[start : len(through)] = [1] * (len(through) - start)
    return ids, answer


def record_row(processor, record: dict, seq_len: int, index: int, folder: str | None, key: str):
    """A record's [3, seq_len + 1] row: token ids, answer flags and `index` (PAD past the end); None where
    it renders to more than seq_len + 1 tokens (its image tokens cannot be cut)."""
    ids, answer = example_tokens(processor, record, folder, key)
    if len(ids) > seq_len + 1:
        return None
    row = np.full((3, seq_len + 1), PAD, dtype=np.int64)
    row[0, : len(ids)], row[1, : len(ids)], row[2] = ids, answer, index
    return row


def rows_path(
    cfg: DataConfig, processor, source, split: str, is_main: bool, key: str, records, folder
) -> str:
    """The cached [N, 3, seq_len + 1] rows of `records` (read_records' of `source`): token ids, answer flags
    and the record's index (PAD past the end). A record longer than the row is left out, and counted in one
    line: its image tokens cannot be cut."""

    def build() -> np.ndarray:
        rows, too_long = [], 0
        for index, record in enumerate(records):
            row = record_row(processor, record, cfg.seq_len, index, folder, key)
            too_long += row is None
            if row is not None and (row[1, 1:] == 1).any():  # a record with no answer trains nothing
                rows.append(row)
        if too_long:  # cutting one would split an image's tokens from its pixels
            print(
                f"{key}: {too_long} of {len(records)} records render to more than data.seq_len + 1 = "
                f"{cfg.seq_len + 1} tokens and are left out; raise data.seq_len to train on them",
                flush=True,
            )
        if not rows:
            raise ConfigError(
                f"{key} {source!r} has no record with an assistant answer within data.seq_len + 1 = "
                f"{cfg.seq_len + 1} tokens; raise data.seq_len or check the records"
            )
        return np.stack(rows)

    files = None if source == SHAPES else local_files(source)
    rendering = (
        f"{processor.chat_template}{processor.image_processor.to_json_string()}{len(processor.tokenizer)}"
    )
    tag = f"images-{source}-{split}-{cfg.tokenizer}-{rendering}-{file_fingerprint(files) if files else ''}"
    return prepare_local_data(cfg, is_main, build, tag=tag)


class ImageBatches(LocalBatches):
    """Pretraining's sampler over image-text rows: each micro-batch is the processor's output for its
    records (pixel values, image grids or sizes, token types), right-padded to its longest record and
    shifted as text rows are."""

    def setup(self, processor, records, folder: str | None, key: str) -> ImageBatches:
        self.processor, self.records, self.folder, self.key = processor, records, folder, key
        return self

    def _batch(self, rows: np.ndarray) -> Batch:
        records = [self.records[int(row[2, 0])] for row in rows]
        return collate(self.processor, records, rows, self.folder, self.key)

    def held_out(self, max_rows: int, batch_size: int, dp_rank: int, dp_size: int) -> list[Batch]:
        """This data-parallel rank's batches of the first max_rows rows; every rank runs as many, and past the
        last row a rank scores row 0 with no labels (common/data/held_out.py:rank_batches)."""
        rows = np.asarray(self.rows[:max_rows])
        batches = []
        for first in range(0, len(rows), dp_size * batch_size):
            index = [first + dp_rank * batch_size + i for i in range(batch_size)]
            batch = self._batch(rows[[i if i < len(rows) else 0 for i in index]])
            batch.labels[[j for j, i in enumerate(index) if i >= len(rows)]] = -100
            batches.append(batch)
        return batches


def collate(processor, records: list, rows: np.ndarray, folder: str | None, key: str) -> Batch:
    """The processor's output for `records`, whose [3, seq_len + 1] `rows` (token ids, answer flags) were
    rendered from them: pixel values, image grids or sizes, token types, right-padded to the longest record
    and shifted as text rows are."""
    texts = [processor.apply_chat_template(r["messages"], tokenize=False) for r in records]
    images = [open_images(r, folder, key) for r in records]
    length = int((rows[:, 0] != PAD).sum(axis=1).max())  # padded to the longest row, as TRL's collator
    out = processor(
        text=texts,
        images=images if any(images) else None,
        padding="max_length",
        max_length=length,
        padding_side="right",
        add_special_tokens=False,
        return_tensors="pt",
    )
    rows = np.array(rows[:, :, :length])
    ids, answer = torch.from_numpy(rows[:, 0]), torch.from_numpy(rows[:, 1])
    if not torch.equal(out["input_ids"][ids != PAD], ids[ids != PAD]):
        raise RuntimeError("the processor rendered a record differently from its rows")
    inputs = out["input_ids"][:, :-1]
    labels = torch.where(answer[:, 1:] == 1, out["input_ids"][:, 1:], -100)
    # Per-token tensors (token types) are shifted with the ids; Qwen-VL's [patches, dim] pixel values are not,
    # even where dim equals the row's length
    extra = {
        name: value[:, :-1] if value.shape == out["input_ids"].shape else value
        for name, value in out.items()
        if name not in ("input_ids", "attention_mask")  # right padding: causal attention ignores it
    }
    # No position ids: the model makes its own (Qwen-VL's 3-D rotary positions come from the image grid).
    return Batch(inputs, labels, images=extra)


def build_image_batches(cfg: DataConfig, t: TrainConfig, dp_rank: int, dp_size: int, is_main: bool):
    """(the processor, which checkpoints and the export save whole; this rank's ImageBatches of
    data.dataset)."""
    ensure_embedded_tokenizer(cfg, is_main)
    processor = load_processor(cfg)
    records, folder = read_records(cfg.dataset, cfg.split, "data.dataset")
    path = rows_path(cfg, processor, cfg.dataset, cfg.split, is_main, "data.dataset", records, folder)
    batches = ImageBatches(path, 0, t.seed, t.global_batch_size, t.micro_batch_size, dp_rank, dp_size)
    return processor, batches.setup(processor, records, folder, "data.dataset")


def held_out_image_batches(
    cfg: DataConfig, e: EvalConfig, source, split: str, key: str, dp_rank: int, dp_size: int, is_main: bool
) -> list[Batch]:
    """This data-parallel rank's batches of the first eval.max_sequences image-text records of `source`."""
    processor = load_processor(cfg)
    records, folder = read_records(source, split, key)
    path = rows_path(cfg, processor, source, split, is_main, key, records, folder)
    rows = ImageBatches(path, 0, 0, 1, 1, dp_rank, dp_size).setup(processor, records, folder, key)
    return rows.held_out(e.max_sequences, e.batch_size, dp_rank, dp_size)
