"""The Llama-2 workflow of the README: a Hugging Face Llama converted in with `checkpoint_util --loader hf`,
instruction-tuned with `pretrain_gpt --sft --finetune --load` using the flags the converter printed, and
exported with `--saver hf` to a folder `transformers` loads cleanly with our logits."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
import torch

from megatron_train.checkpointing import load_model_for_inference
from megatron_train.tools.checkpoint_util import main as convert
from tests.helpers.convert_models import LLAMA2_CHAT_TEMPLATE, VOCAB, hf_logits, ids, save_chat_tokenizer

pytestmark = pytest.mark.processes  # every test here starts processes

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _hf_llama_with_tokenizer(folder: str, untied: bool) -> None:
    """A tiny Llama-2-shaped model (GQA: 4 heads over 2 key/value heads) saved with its chat tokenizer."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5, tie_word_embeddings=not untied,
        bos_token_id=1, eos_token_id=2, pad_token_id=3,
    )  # fmt: skip
    torch.manual_seed(11)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    save_chat_tokenizer(folder, LLAMA2_CHAT_TEMPLATE)


def _conversations(path: str) -> None:
    """Counting: the assistant continues the user's three words (w5 w6 w7 -> w8 w9 w10)."""
    with open(path, "w") as handle:
        for start in range(40):
            user = " ".join(f"w{start + k}" for k in range(3))
            answer = " ".join(f"w{start + k}" for k in range(3, 6))
            messages = [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
            handle.write(json.dumps({"messages": messages}) + "\n")


@pytest.mark.parametrize("untied", [True, False])
def test_llama2_convert_finetune_with_sft_and_export(untied, tmp_path, capsys, caplog):
    hf_in, ours, tuned, hf_out = (str(tmp_path / name) for name in ("hf", "flow", "tuned", "hf_out"))
    _hf_llama_with_tokenizer(hf_in, untied)
    convert(
        ["--model-type", "GPT", "--loader", "hf", "--saver", "flow", "--load-dir", hf_in, "--save-dir", ours]
    )
    printed = capsys.readouterr().out
    finetune = next(line for line in printed.splitlines() if line.startswith("finetune: "))
    assert f"run_text_generation_server --load {ours}" in printed
    assert "--sft" in finetune and f"--tokenizer-model {ours}/tokenizer" in finetune
    model_flags = shlex.split(finetune.split("pretrain_gpt", 1)[1].split(" --load ", 1)[0])

    _conversations(str(tmp_path / "chat.jsonl"))
    argv = [
        *model_flags, "--load", ours, "--finetune", "--sft", "--train-data-path", str(tmp_path / "chat.jsonl"),
        "--save", tuned, "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "15",
        "--lr", "1e-2", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0", "--seed", "1",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    run = subprocess.run([sys.executable, "-m", "megatron_train.pretrain_gpt", *argv], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"loaded weights of {ours}/iter_0000001 for finetuning" in run.stdout + run.stderr
    with open(os.path.join(tuned, "metrics.jsonl")) as handle:
        losses = [record["lm loss"] for record in map(json.loads, handle) if "split" not in record]
    assert len(losses) == 15 and sum(losses[-3:]) / 3 < 0.8 * losses[0], losses

    convert(
        [
            "--model-type",
            "GPT",
            "--loader",
            "flow",
            "--saver",
            "hf",
            "--load-dir",
            tuned,
            "--save-dir",
            hf_out,
        ]
    )
    model, _ = load_model_for_inference(tuned, device="cpu")
    with torch.no_grad():
        expected = model(ids())[..., :VOCAB]
    torch.testing.assert_close(hf_logits(hf_out, ids(), caplog), expected, rtol=1e-5, atol=1e-5)
    original = transformers.AutoModelForCausalLM.from_pretrained(hf_in)
    with torch.no_grad():
        assert not torch.allclose(original(ids()).logits, expected, atol=1e-3)  # the finetune changed it
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_out)  # the chat template travelled along
    assert tokenizer.chat_template == LLAMA2_CHAT_TEMPLATE
