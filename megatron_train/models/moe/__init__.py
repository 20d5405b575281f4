"""Mixture of experts (Megatron-Core's `transformer/moe`): flags (`config`), router and routing (`router`,
`routing`), auxiliary losses (`aux_losses`), token dispatchers (`dispatcher`, `comm`), experts (`experts`) and the
MoE layer (`layer`). See docs/architecture.md (mixture of experts)."""
