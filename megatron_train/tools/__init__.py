"""Command-line tools, as in Megatron-LM's tools/ folder: the text generation server and its client."""
