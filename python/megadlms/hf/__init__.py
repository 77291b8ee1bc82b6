"""Hugging Face interop: export a checkpoint to a transformers model directory
(``export``), and start from a Llama / Qwen2 causal LM (``importer``). See docs/hf.md."""
