"""Serve a checkpoint over HTTP, as Megatron's tools/run_text_generation_server.py does.

    python -m megatron_train.tools.run_text_generation_server --load CKPT --port 5000 [--host 127.0.0.1]

Endpoints: PUT /api (Megatron's request and answer), POST /v1/completions (OpenAI-style), GET /health.
"""

from __future__ import annotations

import argparse
import logging

import uvicorn

from megatron_train.device import get_device
from megatron_train.inference.checkpoint import add_checkpoint_args, load_for_inference
from megatron_train.inference.server import ServerLimits, create_app


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_checkpoint_args(parser)
    defaults = ServerLimits()
    parser.add_argument("--host", default="127.0.0.1", help="Address to bind (0.0.0.0 to serve the network).")
    parser.add_argument("--port", type=int, default=5000)
    parser.add_argument(
        "--max-batch-size", type=int, default=defaults.max_batch_size, help="Prompts per request."
    )
    parser.add_argument("--max-tokens-to-generate", type=int, default=defaults.max_tokens_to_generate)
    parser.add_argument(
        "--max-tokens-to-oom",
        type=int,
        default=defaults.max_tokens_to_oom,
        help="Refuse requests whose prompts x (longest prompt + tokens to generate) exceed this.",
    )
    parser.add_argument("--max-request-bytes", type=int, default=defaults.max_request_bytes)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    model, tokenizer, _ = load_for_inference(args, device=get_device())
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
