"""SFT rows: loss only on answers, packed examples isolated from each other, chat templates."""

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3MoeConfig

from common.config import ConfigError
from common.data.sft import arithmetic_examples, build_rows, tokenize_example

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% if m['role'] == 'assistant' %}<eos>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    """A character-level tokenizer, so token positions can be read off the text."""
    chars = list("0123456789+-=abcdefghijklmnopqrstuvwxyz ?<>/")
    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


def test_prompt_completion_trains_only_on_the_answer_and_eos(tokenizer):
    ids, answer = tokenize_example(tokenizer, {"prompt": "12+30=", "completion": "42"})
    assert tokenizer.decode([i for i, a in zip(ids, answer) if a]) == "42<eos>"
    rows = build_rows([(ids, answer)], seq_len=16, pack=False, pad_id=0)
    inputs, labels, positions, real = rows[0]
    assert tokenizer.decode([t for t in labels if t != -100]) == "42<eos>"
    assert list(positions[:8]) == list(range(8)) and real.sum() == 8  # 9 tokens -> 8 (input, target) pairs


def test_packing_restarts_positions_and_never_trains_across_examples(tokenizer):
    examples = [tokenize_example(tokenizer, e) for e in arithmetic_examples("train")[:40]]
    packed = build_rows(examples, seq_len=32, pack=True, pad_id=0)
    padded = build_rows(examples, seq_len=32, pack=False, pad_id=0)
    assert len(padded) == 40 and len(packed) < 40 / 2
    # The same answer tokens are trained on either way.
    assert sorted(packed[:, 1][packed[:, 1] != -100]) == sorted(padded[:, 1][padded[:, 1] != -100])
    row = packed[0]
    starts = np.flatnonzero(row[2] == 0)
    assert len(starts) >= 3  # several examples (plus the padding segment) share the row


def test_packed_examples_do_not_see_each_other(tokenizer):
    """A packed row gives each example exactly the logits it gets alone: position ids alone isolate them."""
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    a, b = (tokenize_example(tokenizer, e) for e in arithmetic_examples("train")[:2])
    packed = torch.from_numpy(build_rows([a, b], seq_len=32, pack=True, pad_id=0)).long()
    alone = torch.from_numpy(build_rows([b], seq_len=32, pack=False, pad_id=0)).long()
    with torch.no_grad():
        both = model(input_ids=packed[:, 0], position_ids=packed[:, 2], use_cache=False).logits[0]
        single = model(input_ids=alone[:, 0], position_ids=alone[:, 2], use_cache=False).logits[0]
    n_a, n_b = len(a[0]) - 1, len(b[0]) - 1
    torch.testing.assert_close(both[n_a : n_a + n_b], single[:n_b], atol=1e-5, rtol=1e-5)


def test_chat_messages_train_on_every_assistant_turn_only(tokenizer):
    tokenizer.chat_template = TEMPLATE
    try:
        messages = [
            {"role": "user", "content": "1+1="},
            {"role": "assistant", "content": "2"},
            {"role": "user", "content": "2+2="},
            {"role": "assistant", "content": "4"},
        ]
        ids, answer = tokenize_example(tokenizer, {"messages": messages})
        assert tokenizer.decode(ids) == tokenizer.apply_chat_template(messages, tokenize=False)
        assert tokenizer.decode([i for i, a in zip(ids, answer) if a]) == "2<eos>4<eos>"
    finally:
        tokenizer.chat_template = None


def test_records_without_sft_fields_and_chat_without_template_are_config_errors(tokenizer):
    with pytest.raises(ConfigError, match="give 'prompt' and 'completion', or 'messages'"):
        tokenize_example(tokenizer, {"text": "hello"})
    with pytest.raises(ConfigError, match="has no chat template"):
        tokenize_example(tokenizer, {"messages": [{"role": "user", "content": "hi"}]})
