"""Serve a checkpoint over HTTP, as Megatron's tools/run_text_generation_server.py does.

    python -m megatron_train.tools.run_text_generation_server --load CKPT --port 5000 [--host 127.0.0.1] \\
        [Megatron's training flags, e.g. --num-layers 24 --hidden-size 1024 --tokenizer-type ...]
    torchrun --nproc-per-node N -m megatron_train.tools.run_text_generation_server --load CKPT \\
        --tensor-model-parallel-size T --pipeline-model-parallel-size P      (N = T x P)

Takes Megatron's whole argument set: model flags are checked against the checkpoint, tokenizer flags replace
the tokenizer it recorded (which must fit its vocabulary), training-only flags are accepted and unused. Run
as one process, it serves the whole model whatever layout the checkpoint was saved with (the TP/PP flags are
then unused). Under torchrun the model is split over the ranks as TP x PP says, the checkpoint resharded on
load; rank 0 answers HTTP and the other ranks follow it (docs/architecture.md, serving).
Endpoints: PUT /api (Megatron's request and answer, beam search with beam_width), POST /v1/completions and
POST /v1/chat/completions (OpenAI-style), GET /health.

    python -m megatron_train.tools.run_text_generation_server --load RETRO_CKPT --retro-project-dir DIR

serves a Retro checkpoint: each chunk of the text is retrieved for once it is complete, from the project's
filled index with its embedder (`retro.retrieval.RetrievingModel`), and decoding uses the Retro KV cache. One process only, no beam search (its beams cannot reorder a cache of encoded
neighbours); greedy and sampling as for GPT. What a checkpoint needs to be served is its model family's
(`ModelFamily.inference`); a family from outside the project is named with `--model-family pkg.module:ATTR`.
"""

from __future__ import annotations

import argparse
import logging
import os

import torch.distributed as dist
import uvicorn

from megatron_train.checkpointing import CheckpointError
from megatron_train.device import get_device
from megatron_train.inference.checkpoint import (
    add_family_flags,
    build_inference_parser,
    inference_checkpoint,
    load_for_inference,
    start_model_parallel,
)
from megatron_train.inference.ranks import follow
from megatron_train.inference.server import ServerLimits, create_app


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The server's flags, with those of the model families' inference hooks (of the family `--model-family`
    names in `argv` too)."""
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
    group.add_argument(
        "--no-dynamic-batching",
        dest="dynamic_batching",
        action="store_false",
        help="Run requests one at a time instead of batching those that arrive together.",
    )
    group.add_argument(
        "--max-batch-wait-ms",
        type=float,
        default=10.0,
        help="How long the oldest waiting request waits for others to join its batch.",
    )
    add_family_flags(parser, argv)
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
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    multi_rank = int(os.environ.get("WORLD_SIZE", "1")) > 1
    try:
        family = inference_checkpoint(args)[0]
        if multi_rank and family.inference.one_process is not None:
            raise ValueError(family.inference.one_process)
        if multi_rank:
            start_model_parallel(args, data_parallel=False)
        model, tokenizer, config = load_for_inference(args, device=get_device())
    except (ValueError, CheckpointError, FileNotFoundError) as error:
        parser.error(str(error))
    try:
        if multi_rank and dist.get_rank() != 0:
            follow(model, tokenizer)
            return
        limits = ServerLimits(
            max_batch_size=args.max_batch_size,
            max_tokens_to_generate=args.max_tokens_to_generate,
            max_tokens_to_oom=args.max_tokens_to_oom,
            max_request_bytes=args.max_request_bytes,
        )
        app = create_app(
            model,
            tokenizer,
            limits,
            model_name=args.load,
            dynamic_batching=args.dynamic_batching,
            max_batch_wait_s=args.max_batch_wait_ms / 1000,
            sft_prompt_format=config.data.sft_tokenizer_prompt_format if config.data.sft else None,
        )
        try:
            uvicorn.run(app, host=args.host, port=args.port, log_level="info")
        finally:
            if multi_rank:  # the followers return, also when uvicorn could not start
                app.state.service.batcher.close()
    finally:
        if multi_rank:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
