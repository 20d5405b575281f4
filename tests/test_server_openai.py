"""The server's OpenAI endpoints: top_logprobs on /v1/completions, /v1/chat/completions with the tokenizer's
chat template, and beam search on Megatron's PUT /api."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient

from megatron_train.inference.beam_search import BeamSearchParams, beam_search
from megatron_train.inference.generation import GenerationParams, generate
from megatron_train.inference.server import ServerLimits, create_app
from megatron_train.tokenizer.chat import ChatFormat, serving_chat_format
from tests.helpers.generation import (  # noqa: F401 (one_torch_thread is an autouse fixture)
    CharTokenizer,
    build_tiny_gpt,
    one_torch_thread,
)

LIMITS = ServerLimits(
    max_batch_size=4, max_tokens_to_generate=32, max_tokens_to_oom=400, max_request_bytes=4000
)
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def model():
    return build_tiny_gpt()


@pytest.fixture(scope="module")
def client(model):
    return TestClient(create_app(model, CharTokenizer(), LIMITS))


def post(client, path: str, body) -> tuple[int, dict]:
    """POST to the OpenAI endpoints; PUT to Megatron's /api."""
    send = client.put if path == "/api" else client.post
    response = send(path, content=json.dumps(body).encode())
    return response.status_code, response.json()


def test_completions_top_logprobs_are_the_most_likely_tokens(client, model):
    tokenizer = CharTokenizer()
    status, body = post(
        client, "/v1/completions", {"prompt": "hello", "max_tokens": 4, "temperature": 0, "logprobs": 3}
    )
    assert status == 200
    expected = generate(
        model, tokenizer, ["hello"], GenerationParams(tokens_to_generate=4, top_k=1, top_logprobs=3)
    )
    logprobs = body["choices"][0]["logprobs"]
    assert len(logprobs["top_logprobs"]) == len(logprobs["tokens"]) == 4
    for position, top in enumerate(logprobs["top_logprobs"]):
        wanted = expected.top_logprobs[0][4 + position]
        assert list(top) == [tokenizer.detokenize([token]) for token, _ in wanted]
        assert list(top.values()) == pytest.approx([value for _, value in wanted])
        # greedy: the chosen token is the most likely one
        assert logprobs["tokens"][position] == next(iter(top))
        assert logprobs["token_logprobs"][position] == pytest.approx(max(top.values()))
    # the values are log-softmax of the model's logits at the first generated position
    ids = tokenizer.tokenize("hello")
    with torch.no_grad():
        logits = model(torch.tensor([ids]))[0, -1, : tokenizer.vocab_size].float()
    best = torch.log_softmax(logits, -1).topk(3)
    assert list(logprobs["top_logprobs"][0].values()) == pytest.approx(best.values.tolist(), abs=1e-5)


def test_completions_echo_top_logprobs_starts_with_none(client):
    status, body = post(
        client,
        "/v1/completions",
        {"prompt": "ab", "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 2},
    )
    top = body["choices"][0]["logprobs"]["top_logprobs"]
    assert status == 200 and top[0] is None and [len(entry) for entry in top[1:]] == [2, 2, 2]


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tmp_path_factory):
    """A character-level Hugging Face tokenizer folder (BOS added on encode) with a chat template."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    symbols = ["<s>", "</s>"] + list("abcdefghijklmnopqrstuvwxyz <>.!?")
    tokenizer = Tokenizer(models.WordLevel({s: i for i, s in enumerate(symbols)}, unk_token="?"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", chat_template=TEMPLATE
    )
    folder = tmp_path_factory.mktemp("chat_tokenizer")
    fast.save_pretrained(str(folder))
    return str(folder)


MESSAGES = [{"role": "system", "content": "be brief."}, {"role": "user", "content": "hi there"}]


def test_chat_completion_uses_the_chat_template(model, chat_tokenizer_dir):
    import transformers

    from megatron_train.tokenizer import build_tokenizer

    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=chat_tokenizer_dir)
    hf = transformers.AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    prompt = serving_chat_format(tokenizer, None).prompt(MESSAGES)
    # the ids we generate from are exactly transformers' chat ids: one BOS, then the template's text
    hf_ids = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tokenizer.tokenize(prompt) == list(hf_ids)
    assert prompt == "<system>be brief.<user>hi there<assistant>"

    client = TestClient(create_app(model, tokenizer, LIMITS, model_name="chat"))
    body = {"messages": MESSAGES, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    status, answer = post(client, "/v1/chat/completions", body)
    assert status == 200, answer
    expected = generate(
        model,
        tokenizer,
        [prompt],
        GenerationParams(tokens_to_generate=5, top_k=1, return_output_log_probs=True),
    )
    choice = answer["choices"][0]
    assert answer["object"] == "chat.completion" and answer["model"] == "chat"
    assert choice["message"] == {"role": "assistant", "content": expected.completions[0]}
    assert choice["finish_reason"] == expected.finish_reasons[0]
    start = expected.prompt_lengths[0]
    content = choice["logprobs"]["content"]
    assert [entry["token"] for entry in content] == expected.segments[0][start:]
    assert [entry["logprob"] for entry in content] == pytest.approx(expected.logprobs[0][start - 1 :])
    assert all(len(entry["top_logprobs"]) == 2 for entry in content)
    assert all(entry["top_logprobs"][0]["token"] == entry["token"] for entry in content)  # greedy
    assert content[0]["bytes"] == list(content[0]["token"].encode())
    assert answer["usage"]["prompt_tokens"] == len(hf_ids)


CHAT_ERRORS = [
    ({"max_tokens": 2}, "messages is required"),
    ({"messages": []}, "messages is required"),
    (
        {"messages": [{"role": "user"}]},
        "messages[0] must be an object with a string role and a string content",
    ),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0] must be an object"),
    ({"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs needs logprobs=true"),
    (
        {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21},
        "top_logprobs must be an integer from 0 to 20",
    ),
    ({"messages": MESSAGES, "max_tokens": 0}, "max_tokens must be at least 1"),
    ({"messages": MESSAGES, "temperature": "hot"}, "temperature must be between 0 and 2"),
]


@pytest.mark.parametrize(("body", "message"), CHAT_ERRORS, ids=[m for _, m in CHAT_ERRORS])
def test_chat_bad_requests_answer_400(client, body, message):
    status, answer = post(client, "/v1/chat/completions", body)
    assert status == 400 and message in answer["error"]["message"], answer


@pytest.mark.parametrize("prompt_format", ["chat-template", "chatml"])
def test_a_model_trained_with_sft_is_served_the_prompt_it_was_trained_on(
    model, chat_tokenizer_dir, prompt_format
):
    from megatron_train.tokenizer import build_tokenizer

    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=chat_tokenizer_dir)
    question = [
        {"role": "user", "content": "hi"}
    ]  # short: ChatML's prompt fits the tiny model's 64 positions
    conversation = [*question, {"role": "assistant", "content": "hello"}]
    trained = ChatFormat(tokenizer, prompt_format).segments(conversation)
    assert [is_assistant for _, is_assistant in trained] == [False, True]
    prompt = serving_chat_format(tokenizer, prompt_format).prompt(question)
    if prompt_format == "chat-template":  # the template writes BOS; tokenize adds it again, so it is left out
        assert "<s>" + prompt == trained[0][0] == "<s><user>hi<assistant>"
        trained_ids, assistant = ChatFormat(tokenizer, prompt_format).tokenize(conversation)
        assert tokenizer.tokenize(prompt) == trained_ids[: assistant.index(True)]
    else:
        assert prompt == trained[0][0] and prompt.endswith("<|im_start|>assistant\n")
    client = TestClient(create_app(model, tokenizer, LIMITS, sft_prompt_format=prompt_format))
    status, answer = post(
        client, "/v1/chat/completions", {"messages": question, "max_tokens": 3, "temperature": 0}
    )
    expected = generate(model, tokenizer, [prompt], GenerationParams(tokens_to_generate=3, top_k=1))
    assert status == 200 and answer["choices"][0]["message"]["content"] == expected.completions[0]


def test_chat_without_a_chat_template_answers_400(client):
    status, answer = post(client, "/v1/chat/completions", {"messages": MESSAGES})
    assert status == 400
    assert "the tokenizer (CharTokenizer) has no chat template" in answer["error"]["message"]


def test_api_beam_search_answers_megatrons_shape(client, model):
    status, body = post(client, "/api", {"prompts": ["hello"], "tokens_to_generate": 6, "beam_width": 3})
    expected = beam_search(
        model, CharTokenizer(), "hello", BeamSearchParams(beam_width=3, tokens_to_generate=6)
    )
    assert status == 200 and set(body) == {"text", "segments", "scores"}
    assert body["text"] == expected.texts and body["segments"] == expected.segments
    assert body["scores"] == pytest.approx(expected.scores)
    status, body = post(
        client,
        "/api",
        {"prompts": ["hello"], "tokens_to_generate": 6, "beam_width": 2, "length_penalty": 0.5},
    )
    assert status == 200 and len(body["text"]) == 2


def test_prompts_past_the_models_positions_answer_400(client):
    """The model has 64 positions: a request that cannot fit is refused before it reaches a batch."""
    status, body = post(client, "/api", {"prompts": ["a" * 60], "tokens_to_generate": 10})
    assert status == 400 and "longer than allowed: 60 + 10 tokens > 64" in body["message"]
    status, body = post(client, "/v1/completions", {"prompt": "a" * 60, "max_tokens": 10})
    assert status == 400 and "longer than allowed" in body["error"]["message"]


def test_scoring_a_prompt_returns_its_top_logprobs(client, model):
    body = {"prompt": "abc", "max_tokens": 0, "echo": True, "logprobs": 2}
    status, answer = post(client, "/v1/completions", body)
    logprobs = answer["choices"][0]["logprobs"]
    assert status == 200 and logprobs["tokens"] == ["a", "b", "c"] and logprobs["top_logprobs"][0] is None
    with torch.no_grad():
        logits = model(torch.tensor([CharTokenizer().tokenize("abc")]))[0, :2, : CharTokenizer().vocab_size]
    best = torch.log_softmax(logits.float(), -1).topk(2).values
    got = torch.tensor([list(top.values()) for top in logprobs["top_logprobs"][1:]])
    torch.testing.assert_close(got, best, rtol=1e-5, atol=1e-5)
