"""Serve a checkpoint over HTTP, as Megatron's tools/run_text_generation_server.py does.

    python -m megatron_train.tools.run_text_generation_server --load CKPT --port 5000 [--host 127.0.0.1] \\
        [Megatron's training flags, e.g. --num-layers 24 --hidden-size 1024 --tokenizer-type ...]

Takes Megatron's whole argument set: model flags are checked against the checkpoint, tokenizer flags replace
the tokenizer it recorded (which must fit its vocabulary), training-only flags are accepted and unused. The
model is served in one process, whatever --tensor/--pipeline-model-parallel-size it was saved with.
Endpoints: PUT /api (Megatron's request and answer), POST /v1/completions (OpenAI-style), GET /health.
"""

from __future__ import annotations

import argparse
import logging

import uvicorn

from megatron_train.checkpointing import CheckpointError
from megatron_train.device import get_device
from megatron_train.inference.checkpoint import build_inference_parser, load_for_inference
from megatron_train.inference.server import ServerLimits, create_app


def build_parser() -> argparse.ArgumentParser:
    parser = build_inference_parser(__doc__)
    defaults = ServerLimits()
    group = parser.add_argument_group("text generation server")
    group.add_argument("--host", default="127.0.0.1", help="Address to bind (0.0.0.0 to serve the network).")
    group.add_argument("--port", type=int, default=5000)
    group.add_argument(
        "--max-batch-size", type=int, default=defaults.max_batch_size, help="Prompts per request."
    )
    group.add_argument("--max-tokens-to-generate", type=int, default=defaults.max_tokens_to_generate)
    group.add_argument(
        "--max-tokens-to-oom",
        type=int,
        default=defaults.max_tokens_to_oom,
        help="Refuse requests whose prompts x (longest prompt + tokens to generate) exceed this.",
    )
    group.add_argument("--max-request-bytes", type=int, default=defaults.max_request_bytes)
    # Megatron's script takes these too; here every request carries its own sampling settings.
    unused = parser.add_argument_group("accepted for Megatron's scripts (requests set their own sampling)")
    unused.add_argument("--temperature", type=float, default=1.0)
    unused.add_argument("--top_k", type=int, default=1)
    unused.add_argument("--top_p", type=float, default=0.0)
    unused.add_argument("--return-log-probs", action="store_true")
    unused.add_argument("--num-tokens-to-generate", type=int, default=30)
    unused.add_argument("--prompts", nargs="+", default=None)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        model, tokenizer, _ = load_for_inference(args, device=get_device())
    except (ValueError, CheckpointError) as error:
        parser.error(str(error))
    limits = ServerLimits(
        max_batch_size=args.max_batch_size,
        max_tokens_to_generate=args.max_tokens_to_generate,
        max_tokens_to_oom=args.max_tokens_to_oom,
        max_request_bytes=args.max_request_bytes,
    )
    app = create_app(model, tokenizer, limits, model_name=args.load)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
