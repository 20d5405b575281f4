"""BERT training-step throughput: our BertModel against transformers.BertForPreTraining with identical weights.

One fwd + bwd + AdamW step (foreach) of the pretraining loss (masked-LM over the masked tokens + the
next-sentence / sentence-order cross entropy) on the same batch, fp32, same thread count. HF's model is saved
with `save_pretrained` and loaded into ours through `models.hf_bert` (post-LN layers); the MLM and binary logits
are checked equal before any timing. Each repeat runs our step then HF's, back to back, so a shared machine's
changing load hits both alike; the ratio is taken within a repeat, then the median over repeats.

The default shape is BERT-base's width, heads and vocabulary with 4 layers and 4 x 512 tokens, 15% masked.
The last line is `ratio: <ours/hf>` of tokens/s.

    .venv/bin/python -m benchmarks.bert_step [--layers 4 --hidden 768 --repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from collections.abc import Callable

import torch
import torch.nn.functional as F
import transformers

from benchmarks.train_step import paired_median, timed
from megatron_train.models.bert import BertModel
from megatron_train.models.hf_bert import load_hf_bert


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=30522)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="default: all cores")
    return parser.parse_args()


def build_pair(args: argparse.Namespace, batch: dict[str, torch.Tensor]) -> tuple[BertModel, torch.nn.Module]:
    """HF BertForPreTraining with random weights and ours loaded from its saved directory; equal logits."""
    hf_config = transformers.BertConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, intermediate_size=4 * args.hidden, max_position_embeddings=args.seq,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.BertForPreTraining(hf_config)
    hf.config._attn_implementation = "sdpa"  # HF's fastest CPU attention, the same kernel as ours
    with tempfile.TemporaryDirectory() as directory:
        hf.save_pretrained(directory)
        ours = load_hf_bert(directory).model
    inputs = (batch["input_ids"][:2], batch["attention_mask"][:2], batch["token_type_ids"][:2])
    with torch.no_grad():
        expected = hf.eval()(*inputs)
        logits, binary = ours.eval()(*inputs)
        torch.testing.assert_close(logits, expected.prediction_logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(binary, expected.seq_relationship_logits, rtol=1e-4, atol=1e-4)
    return ours.train(), hf.train()


def make_batch(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """Two segments per sequence, the last quarter of every other sequence padding, 15% of tokens masked."""
    generator = torch.Generator().manual_seed(1)
    shape = (args.batch, args.seq)
    attention_mask = torch.ones(shape, dtype=torch.long)
    attention_mask[::2, 3 * args.seq // 4 :] = 0
    token_type_ids = torch.zeros(shape, dtype=torch.long)
    token_type_ids[:, args.seq // 2 :] = 1
    masked = (torch.rand(shape, generator=generator) < 0.15) & attention_mask.bool()
    return {
        "input_ids": torch.randint(0, args.vocab, shape, generator=generator),
        "attention_mask": attention_mask,
        "token_type_ids": token_type_ids,
        "labels": torch.where(masked, torch.randint(0, args.vocab, shape, generator=generator), -100),
        "sentence_order": torch.randint(0, 2, (args.batch,), generator=generator),
    }


def make_step(model: torch.nn.Module, is_ours: bool, batch: dict[str, torch.Tensor]) -> Callable[[], None]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    inputs = (batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    labels, loss_mask = batch["labels"], (batch["labels"] >= 0).float()

    def step() -> None:
        if is_ours:  # pretrain_bert's loss: per-token vocab-parallel cross entropy, masked mean
            lm_losses, binary = model(*inputs, lm_labels=labels)
            lm_loss = (lm_losses * loss_mask).sum() / loss_mask.sum()
        else:
            output = model(*inputs)
            logits, binary = output.prediction_logits, output.seq_relationship_logits
            lm_loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.view(-1))
        loss = lm_loss + F.cross_entropy(binary.float(), batch["sentence_order"])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    batch = make_batch(args)
    tokens = args.batch * args.seq
    print(f"threads {args.threads}; BERT shape: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
          f"seq {args.seq}, batch {args.batch}, vocab {args.vocab}; fp32; median of {args.repeats} repeats; "
          f"load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    ours, hf = build_pair(args, batch)
    runs = {"ours": timed(make_step(ours, True, batch)), "hf": timed(make_step(hf, False, batch))}
    for _ in range(args.warmup):
        for run in runs.values():
            run()
    seconds: dict[str, list[float]] = {key: [] for key in runs}
    for _ in range(args.repeats):
        for key, run in runs.items():
            seconds[key].append(run())
    ratio = paired_median(seconds["hf"], seconds["ours"])
    print(
        f"ours {tokens / statistics.median(seconds['ours']):.1f} tok/s | "
        f"hf {tokens / statistics.median(seconds['hf']):.1f} tok/s | ours/hf {ratio:.3f}"
    )
    print(f"ratio: {ratio:.3f}")


if __name__ == "__main__":
    main()
