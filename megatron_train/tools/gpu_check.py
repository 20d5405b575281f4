"""`make gpu-check`: what this engine does on the GPUs of the machine it runs on, in at most a few minutes.

Runs with the machine's own `python3` and CUDA build of torch: nothing installed, no network, no `make setup`
(the checkout on PYTHONPATH). Without CUDA (or without torch) it prints one line saying it skipped. With CUDA:

1. NCCL: one process per GPU present runs the collectives tensor, sequence, data and context parallelism use
   (all-reduce, all-gather, reduce-scatter, the ring's batched isend/irecv) and checks their values; on one GPU
   the group has one rank, and the report says which exchanges that leaves unexercised.
2. Precision: the tiny GPT in bf16 with TF32 off, its loss against the same model in fp32 on the CPU.
3. Kernels: torch's flash and memory-efficient SDPA kernels, and flash-attn's when the package is installed,
   against the math kernel; with two GPUs or more, ring attention (context parallelism) against full attention.
4. Throughput: a training step of a Llama-shaped model in bf16, its TFLOP/s (the family's FLOPs terms) and MFU,
   against the transformers LlamaForCausalLM of the same shape when transformers is installed (else ours alone);
   the last line is `ratio: <ours / transformers>`.
"""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _nccl_worker(rank: int, world_size: int, port: int, results) -> None:
    """Every collective the parallel layouts use, on NCCL, with values checked on this rank."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    try:
        dist.init_process_group("nccl", rank=rank, world_size=world_size)
        device = torch.device("cuda", rank)
        checks = {}
        x = torch.full((1024,), float(rank + 1), device=device)
        dist.all_reduce(x)
        checks["all-reduce"] = bool(torch.all(x == world_size * (world_size + 1) / 2))
        gathered = torch.empty(world_size * 4, device=device)
        dist.all_gather_into_tensor(gathered, torch.full((4,), float(rank), device=device))
        checks["all-gather"] = gathered.tolist() == [float(r) for r in range(world_size) for _ in range(4)]
        out = torch.empty(4, device=device)
        dist.reduce_scatter_tensor(out, torch.ones(4 * world_size, device=device))
        checks["reduce-scatter"] = bool(torch.all(out == world_size))
        if world_size > 1:
            send, recv = torch.full((8,), float(rank), device=device), torch.empty(8, device=device)
            ops = [
                dist.P2POp(dist.isend, send, (rank + 1) % world_size),
                dist.P2POp(dist.irecv, recv, (rank - 1) % world_size),
            ]
            for request in dist.batch_isend_irecv(ops):
                request.wait()
            checks["ring isend/irecv"] = bool(torch.all(recv == (rank - 1) % world_size))
            checks["ring attention (CP)"] = _ring_attention_error(rank, world_size, device) < 2e-2
        results.put((rank, checks))
    except Exception:  # noqa: BLE001 - reported by the parent
        results.put((rank, {"error": traceback.format_exc()}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _ring_attention_error(rank: int, world_size: int, device) -> float:
    """Context-parallel ring attention over all GPUs against full causal attention, bf16, max abs error."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from megatron_train.models.context_attention import context_parallel_attention
    from megatron_train.parallel.context_parallel import chunk_indices

    generator = torch.Generator(device=device).manual_seed(0)
    seq = 256 * world_size
    q, k, v = (
        torch.randn(1, seq, 8, 64, device=device, dtype=torch.bfloat16, generator=generator) for _ in "qkv"
    )
    full = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(
        1, 2
    )
    index = chunk_indices(seq, world_size, rank, device)
    group = dist.new_group(list(range(world_size)))
    local = context_parallel_attention(q[:, index], k[:, index], v[:, index], group, "p2p").transpose(0, 1)
    return (local.float() - full[:, index].float()).abs().max().item()


def check_nccl(device_count: int) -> list[str]:
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    port = _free_port()
    procs = [
        context.Process(target=_nccl_worker, args=(r, device_count, port, results))
        for r in range(device_count)
    ]
    for proc in procs:
        proc.start()
    outcomes = dict(results.get() for _ in procs)
    for proc in procs:
        proc.join(60)
    lines = []
    for rank in sorted(outcomes):
        if "error" in outcomes[rank]:
            lines.append(f"NCCL rank {rank}: FAILED\n{outcomes[rank]['error']}")
    checks = outcomes[0] if "error" not in outcomes[0] else {}
    passed = ", ".join(f"{name} {'ok' if ok else 'WRONG'}" for name, ok in checks.items())
    lines.append(f"NCCL over {device_count} GPU(s): {passed}")
    if device_count == 1:
        lines.append(
            "one GPU: the group has one rank, so no byte crossed between GPUs; tensor, pipeline, context and data "
            "parallel exchanges and ring attention were not run (they are tested over gloo on CPU)"
        )
    return lines


def check_precision() -> list[str]:
    """bf16 on the GPU with TF32 off against fp32 on the CPU: the tiny GPT's loss."""
    import torch

    from megatron_train.models.config import TransformerConfig
    from megatron_train.models.gpt import GPTModel

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64,
                               hidden_dropout=0.0, attention_dropout=0.0)  # fmt: skip
    model = GPTModel(config, 256, init_seed=7)
    tokens = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(0))
    reference = model(tokens[:, :-1], labels=tokens[:, 1:]).mean().item()
    gpu = model.to("cuda", torch.bfloat16)
    loss = gpu(tokens[:, :-1].cuda(), labels=tokens[:, 1:].cuda()).mean().item()
    relative = abs(loss - reference) / reference
    verdict = "ok" if relative < 2e-2 else "TOO FAR"
    return [f"bf16 (TF32 off) loss {loss:.5f} vs fp32 CPU {reference:.5f}: relative {relative:.1e} {verdict}"]


def check_kernels() -> list[str]:
    """SDPA's flash and memory-efficient kernels and flash-attn's, against the math kernel, bf16."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(2, 8, 512, 64, device="cuda", dtype=torch.bfloat16, generator=generator) for _ in "qkv"
    )
    with sdpa_kernel(SDPBackend.MATH):
        reference = F.scaled_dot_product_attention(q, k, v, is_causal=True).float()
    lines = []
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True).float()
            lines.append(f"SDPA {backend.name}: max abs error {(out - reference).abs().max().item():.2e}")
        except RuntimeError as error:
            lines.append(f"SDPA {backend.name}: not available here ({str(error).splitlines()[0][:100]})")
    try:
        from flash_attn import flash_attn_func
    except ImportError:
        lines.append("flash-attn: not installed (--use-flash-attn would be refused; SDPA is used)")
    else:
        out = flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True).transpose(1, 2).float()
        lines.append(f"flash-attn: max abs error {(out - reference).abs().max().item():.2e}")
    return lines


def _train_seconds(model, tokens, labels, steps: int, loss_of) -> float:
    """Median seconds of a training step (forward, backward, AdamW) after one warm-up."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    times = []
    for step in range(steps + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss_of(model, tokens, labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def check_throughput() -> list[str]:
    """A Llama-shaped model's training step: our GPTModel against transformers' LlamaForCausalLM."""
    import torch

    from megatron_train.models.config import TransformerConfig
    from megatron_train.models.gpt import GPTModel
    from megatron_train.models.terms import embedding_terms, layer_stack_terms, output_layer_terms
    from megatron_train.training.flops import peak_flops_per_device

    layers, hidden, heads, groups, ffn, seq, batch, vocab = 8, 2048, 16, 4, 5632, 2048, 4, 32000
    config = TransformerConfig.llama(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                                     group_query_attention=True, num_query_groups=groups, ffn_hidden_size=ffn,
                                     seq_length=seq, bf16=True)  # fmt: skip
    terms = embedding_terms(config, vocab) + layer_stack_terms("decoder", config, layers, seq, True)
    terms = terms + output_layer_terms(config, vocab, seq)
    flops = terms.flops_per_sample() * batch
    tokens = torch.randint(0, vocab, (batch, seq + 1), device="cuda")
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    ours = GPTModel(config, vocab).to("cuda", torch.bfloat16)
    seconds = _train_seconds(ours, inputs, labels, 5, lambda m, x, y: m(x, labels=y).mean())
    del ours
    peak = peak_flops_per_device()
    ours_tflops = flops / seconds / 1e12
    mfu = f", MFU {ours_tflops * 1e12 / peak:.1%}" if peak else " (no known peak for this GPU: MFU not shown)"
    lines = [f"ours: {seconds * 1e3:.1f} ms a step, {ours_tflops:.1f} TFLOP/s{mfu}"]
    try:
        import transformers
    except ImportError:
        lines.append("transformers: not installed: our figure alone")
        return lines
    hf_config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                                         num_hidden_layers=layers, num_attention_heads=heads,
                                         num_key_value_heads=groups, max_position_embeddings=seq,
                                         attn_implementation="sdpa")  # fmt: skip
    theirs = transformers.LlamaForCausalLM(hf_config).to("cuda", torch.bfloat16)
    hf_seconds = _train_seconds(theirs, inputs, labels, 5, lambda m, x, y: m(input_ids=x, labels=y).loss)
    lines.append(
        f"transformers LlamaForCausalLM: {hf_seconds * 1e3:.1f} ms a step, {flops / hf_seconds / 1e12:.1f} TFLOP/s"
    )
    lines.append(f"ratio: {hf_seconds / seconds:.3f}")
    return lines


def main() -> None:
    try:
        import torch
    except ImportError:
        print(f"gpu-check: skipped: {sys.executable} has no torch")
        return
    if not torch.cuda.is_available():
        print(
            f"gpu-check: skipped: no CUDA device (torch {torch.__version__}, CUDA build {torch.version.cuda})"
        )
        return
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    print(
        f"gpu-check: torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {torch.cuda.nccl.version()}, {names}"
    )
    start = time.perf_counter()
    for check in (lambda: check_nccl(len(names)), check_precision, check_kernels, check_throughput):
        for line in check():
            print(line, flush=True)
    print(f"gpu-check: done in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
