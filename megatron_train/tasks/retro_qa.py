"""Zero-shot open-domain QA (`tasks.main --task RETRO-QA`): greedy answers scored by exact match and F1, as
Megatron's tools/retro/text_generation (retro_text_generation.py, evaluate.py) scored InstructRetro.

A QA file is JSON Lines, one question a line: {"question": str, "answers": [str, ...], "ctxs": [{"title": str,
"text": str}, ...]} (`ctxs` optional). The prompt is the short-span form of Megatron's `reformat_prompt`
(tools/retro/sft/dataset_conv.py): the system line, the first `--ft-neighbours` contexts as "title: T, source: S"
paragraphs, then "User: Answer the following question with a short span. Q\\n\\nAssistant: The answer is". A
Retro model also retrieves neighbours for the prompt's chunks from its project (`retro.retrieval.RetrievingModel`).
The answer is the generated text up to the first newline. Scores use SQuAD's normalization (lower case, no
punctuation, no articles, single spaces): exact match against any answer, precision / recall / F1 of tokens
against the best-matching answer (Megatron's F1 took the first answer only; see docs/architecture.md,
conventions).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from dataclasses import dataclass, field

import torch

from megatron_train.inference.generation import GenerationParams, generate
from megatron_train.tokenizer.base import MegatronTokenizer
from storage.documents import read_json_records

SYSTEM = (
    "System: This is a chat between a user and an artificial intelligence assistant. The assistant gives helpful, "
    "detailed, and polite answers to the user's questions based on the context. The assistant should also "
    "indicate when the answer cannot be found in the context.\n\n"
)
ANSWER_LEAD = " The answer is"


@dataclass(frozen=True)
class QAExample:
    question: str
    answers: tuple[str, ...]
    contexts: tuple[str, ...] = ()  # "title: T, source: S" paragraphs, best first


def read_qa(path: str) -> list[QAExample]:
    """Every question of a QA JSONL file; a bad record is an error naming the file, the line and the field."""
    examples = []
    for _, where, record in read_json_records(path):
        if not isinstance(record, dict) or not isinstance(record.get("question"), str):
            raise ValueError(f'{where}: "question" must be a string')
        answers = record.get("answers")
        if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
            raise ValueError(f'{where}: "answers" must be a non-empty list of strings')
        contexts = record.get("ctxs", [])
        if not isinstance(contexts, list) or not all(
            isinstance(c, dict) and isinstance(c.get("text"), str) for c in contexts
        ):
            raise ValueError(f'{where}: "ctxs" must be a list of {{"title", "text"}} objects')
        paragraphs = tuple(f"title: {c.get('title', '')}, source: {c['text']}" for c in contexts)
        examples.append(QAExample(record["question"], tuple(answers), paragraphs))
    if not examples:
        raise ValueError(f"{path}: no questions; each line is {{question, answers, ctxs}}")
    return examples


def qa_prompt(example: QAExample, ft_neighbours: int) -> str:
    """The prompt text: system line, the first `ft_neighbours` contexts, the question in Megatron's short-span form."""
    context = "".join(f"{paragraph}\n\n" for paragraph in example.contexts[:ft_neighbours])
    user = f"User: Answer the following question with a short span. {example.question}\n\nAssistant:"
    return SYSTEM + context + user + ANSWER_LEAD


def normalize_answer(text: str) -> str:
    """SQuAD's normalization: lower case, punctuation and articles removed, whitespace collapsed."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def exact_match(prediction: str, answers: tuple[str, ...]) -> bool:
    return any(normalize_answer(prediction) == normalize_answer(answer) for answer in answers)


def token_scores(prediction: str, answer: str) -> tuple[float, float, float]:
    """(precision, recall, F1) of the normalized prediction's tokens against the answer's."""
    predicted, gold = normalize_answer(prediction).split(), normalize_answer(answer).split()
    common = sum((Counter(predicted) & Counter(gold)).values())
    if common == 0:
        return 0.0, 0.0, 0.0
    precision, recall = common / len(predicted), common / len(gold)
    return precision, recall, 2 * precision * recall / (precision + recall)


@dataclass
class QAResult:
    exact_match: float
    precision: float
    recall: float
    f1: float
    num_examples: int
    predictions: list[str] = field(repr=False)

    def megatron_line(self, task: str) -> str:
        """Megatron's evaluate.py lines ("Exact Match: ..." and "Method: ...; f1: ...") on one line."""
        return (
            f"Exact Match: {self.exact_match:.4f}; Method: {task}; Precision: {self.precision:.4f}; "
            f"recall: {self.recall:.4f}; f1: {self.f1:.4f}"
        )


def score_answers(predictions: list[str], examples: list[QAExample]) -> QAResult:
    """Mean exact match, and precision / recall / F1 against each question's best-F1 answer."""
    matches, best = [], []
    for prediction, example in zip(predictions, examples, strict=True):
        matches.append(exact_match(prediction, example.answers))
        best.append(max((token_scores(prediction, answer) for answer in example.answers), key=lambda s: s[2]))
    count = len(examples)
    precision, recall, f1 = (sum(scores[i] for scores in best) / count for i in range(3))
    return QAResult(sum(matches) / count, precision, recall, f1, count, predictions)


def answer_questions(
    model: torch.nn.Module,
    tokenizer: MegatronTokenizer,
    examples: list[QAExample],
    ft_neighbours: int,
    tokens_to_generate: int,
    batch_size: int,
) -> list[str]:
    """Greedy answers, `batch_size` questions per generation call, each cut at its first newline."""
    params = GenerationParams(tokens_to_generate=tokens_to_generate, top_k=1, stop_on_eol=True)
    answers = []
    for start in range(0, len(examples), batch_size):
        prompts = [qa_prompt(example, ft_neighbours) for example in examples[start : start + batch_size]]
        output = generate(model, tokenizer, prompts, params)
        answers += [completion.split("\n")[0].strip() for completion in output.completions]
    return answers


def evaluate_qa(
    model: torch.nn.Module,
    tokenizer: MegatronTokenizer,
    path: str,
    ft_neighbours: int,
    tokens_to_generate: int,
    batch_size: int,
) -> QAResult:
    examples = read_qa(path)
    predictions = answer_questions(model, tokenizer, examples, ft_neighbours, tokens_to_generate, batch_size)
    return score_answers(predictions, examples)
