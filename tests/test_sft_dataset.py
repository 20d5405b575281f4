"""The SFT dataset: conversations rendered with the chat template, loss only on the assistant's tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_train.data.config import DataConfig
from megatron_train.data.sft_dataset import SFTDataset, build_sft_datasets, tokenize_conversations
from megatron_train.tokenizer.chat import ChatFormat
from megatron_train.tokenizer.huggingface import HuggingFaceAutoTokenizer
from tests.helpers.convert_models import LLAMA2_CHAT_TEMPLATE, save_chat_tokenizer

transformers = pytest.importorskip("transformers")

CONVERSATION = [
    {"role": "system", "content": "w1 w2"},
    {"role": "user", "content": "w3 w4"},
    {"role": "assistant", "content": "w5 w6"},
    {"role": "user", "content": "w7"},
    {"role": "assistant", "content": "w8 w9 w10"},
]


def _write_jsonl(path, conversations) -> str:
    path.write_text("".join(json.dumps({"messages": messages}) + "\n" for messages in conversations))
    return str(path)


@pytest.mark.parametrize(
    ("template", "prompt_format", "assistant_text"),
    [
        (LLAMA2_CHAT_TEMPLATE, "chat-template", "w5 w6 </s> w8 w9 w10 </s>"),
        (None, "chat-template", "w5 w6 <|im_end|> w8 w9 w10 <|im_end|>"),  # no template: ChatML
        (LLAMA2_CHAT_TEMPLATE, "chatml", "w5 w6 <|im_end|> w8 w9 w10 <|im_end|>"),
    ],
)
def test_loss_mask_covers_exactly_the_assistant_tokens(template, prompt_format, assistant_text, tmp_path):
    save_chat_tokenizer(str(tmp_path / "tok"), template)
    tokenizer = HuggingFaceAutoTokenizer(str(tmp_path / "tok"))
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    chat = ChatFormat(tokenizer, prompt_format)
    if prompt_format == "chat-template" and template:  # rendered and tokenized as transformers does
        assert chat.render(CONVERSATION) == hf.apply_chat_template(CONVERSATION, tokenize=False)
        assert (
            chat.tokenize(CONVERSATION)[0] == hf.apply_chat_template(CONVERSATION, tokenize=True)["input_ids"]
        )
    path = _write_jsonl(tmp_path / "sft.jsonl", [CONVERSATION])
    [conversation] = tokenize_conversations([path], chat)
    sample = SFTDataset([conversation], seq_length=40, pad_id=3, seed=0)[0]
    expected = hf.convert_tokens_to_ids(assistant_text.split())
    assert sample["labels"][sample["loss_mask"] == 1].tolist() == expected
    length = len(conversation[0])
    assert (sample["loss_mask"][length - 1 :] == 0).all() and (
        sample["tokens"][length:] == 3
    ).all()  # padding
    assert sample["tokens"][:length].tolist() == conversation[0].tolist()
    assert sample["position_ids"].tolist() == list(range(40))


def test_packing_restarts_positions_and_runs_are_deterministic(tmp_path):
    save_chat_tokenizer(str(tmp_path / "tok"), None)
    tokenizer = HuggingFaceAutoTokenizer(str(tmp_path / "tok"))
    conversations = [
        [{"role": "user", "content": f"w{i}"}, {"role": "assistant", "content": f"w{i + 1} w{i + 2}"}]
        for i in range(10)
    ]
    path = _write_jsonl(tmp_path / "sft.jsonl", conversations)
    config = DataConfig(data_path=[path], split="8,2,0", sft=True, sft_pack=True)
    train, valid, test = build_sft_datasets(config, tokenizer, 31, (12, None, None), seed=3)
    # ChatML: "<|im_start|> user wI <|im_end|> <|im_start|> assistant wJ wK <|im_end|>" = 9 tokens; 3 per sample
    assert (len(train.samples), len(train), len(valid.samples), test) == (3, 12, 1, None)
    assert train.samples == [[0, 1, 2], [3, 4, 5], [6, 7]]
    full = next(i for i in range(3) if train._sample(i) == [0, 1, 2])
    positions = train[full]["position_ids"].tolist()
    assert positions[:27] == list(range(9)) * 3 and positions[27:] == [9, 10, 11, 12]  # padding continues
    again = build_sft_datasets(config, tokenizer, 31, (12, None, None), seed=3)[0]
    assert all(np.array_equal(train[i]["tokens"], again[i]["tokens"]) for i in range(12))
    assert sorted(train._sample(i)[0] for i in range(3)) == [0, 3, 6]  # one epoch visits every sample once
    assert train[full]["document_ids"].tolist() == [0] * 9 + [1] * 9 + [2] * 9 + [3] * 4  # padding: its own


def test_a_packed_conversation_scores_as_it_does_alone(tmp_path):
    """Each conversation of a pack attends to itself only: its per-token losses equal those it gets padded
    alone, whatever it was packed with."""
    import torch

    from megatron_train.models import GPTModel
    from tests.helpers.tiny import tiny_config

    save_chat_tokenizer(str(tmp_path / "tok"), None)
    tokenizer = HuggingFaceAutoTokenizer(str(tmp_path / "tok"))
    conversations = [
        [{"role": "user", "content": f"w{i}"}, {"role": "assistant", "content": f"w{i + 1} w{i + 2}"}]
        for i in range(3)
    ]
    tokenized = tokenize_conversations(
        [_write_jsonl(tmp_path / "sft.jsonl", conversations)], ChatFormat(tokenizer)
    )
    packed = SFTDataset(tokenized, seq_length=31, pad_id=0, seed=0, packed=True)
    alone = SFTDataset(tokenized, seq_length=31, pad_id=0, seed=0)
    torch.manual_seed(0)
    model = GPTModel(tiny_config(seq_length=32), len(tokenizer.vocab)).eval()

    def losses(sample: dict) -> torch.Tensor:
        batch = {key: torch.as_tensor(value)[None] for key, value in sample.items()}
        with torch.no_grad():
            return model(batch["tokens"], batch["position_ids"], labels=batch["labels"],
                         document_ids=batch.get("document_ids"))[0] * batch["loss_mask"][0]  # fmt: skip

    [pack] = [packed[i] for i in range(len(packed)) if packed._sample(i) == [0, 1, 2]]
    by_conversation = {alone._sample(i)[0]: losses(alone[i]) for i in range(3)}
    pack_losses = losses(pack)
    for number in range(3):  # 9 tokens each; the mask keeps the assistant's labels only
        torch.testing.assert_close(pack_losses[9 * number : 9 * number + 9], by_conversation[number][:9],
                                   rtol=1e-5, atol=1e-6)  # fmt: skip
        assert by_conversation[number][:9].sum() > 0


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('{"messages": [{"role": "user", "content": "w1"}, {"role": "bot", "content": "w2"}]}',
         "sft.jsonl:2: messages[1].role is 'bot', not one of ('system', 'user', 'assistant')"),
        ('{"messages": [{"role": "user", "content": 3}]}', "sft.jsonl:2: messages[0].content is not a string"),
        ('{"text": "w1"}', 'sft.jsonl:2: "messages" must be a non-empty list'),
        ('{"messages": [{"role": "user", "content": "w1"}', "sft.jsonl:2: not valid JSON"),
        ('{"messages": [{"role": "user", "content": "w1"}]}', "sft.jsonl:2: messages has no assistant turn"),
        ('{"messages": [{"role": "assistant", "content": "w1"}, {"role": "assistant", "content": "w1"}]}',
         "sft.jsonl:2: the chat template refuses the conversation: Conversation roles must alternate"),
    ],
)  # fmt: skip
def test_bad_records_name_the_file_line_and_field(line, problem, tmp_path):
    save_chat_tokenizer(str(tmp_path / "tok"), LLAMA2_CHAT_TEMPLATE)
    chat = ChatFormat(HuggingFaceAutoTokenizer(str(tmp_path / "tok")))
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n" + line + "\n")
    with pytest.raises(ValueError, match="sft.jsonl") as error:
        tokenize_conversations([str(path)], chat)
    assert problem in str(error.value)


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path):
    reversed_template = "{% for m in messages|reverse %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    save_chat_tokenizer(str(tmp_path / "tok"), reversed_template)
    chat = ChatFormat(HuggingFaceAutoTokenizer(str(tmp_path / "tok")))
    path = _write_jsonl(tmp_path / "sft.jsonl", [CONVERSATION])
    with pytest.raises(
        ValueError, match=r"sft.jsonl:1: the chat template does not render message 2 as an extension"
    ):
        tokenize_conversations([path], chat)
    [conversation] = tokenize_conversations(
        [path], ChatFormat(chat.tokenizer, "chatml")
    )  # the way out it names
    assert conversation[1].any()


def test_sft_flags_are_checked():
    with pytest.raises(ValueError, match="--sft-pack packs SFT conversations: it needs --sft"):
        DataConfig(data_path=["x.jsonl"], sft_pack=True)
    with pytest.raises(ValueError, match="drop --mock-data"):
        DataConfig(mock_data=True, sft=True)
