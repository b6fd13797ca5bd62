"""Where checkpoints come from: a Hugging Face snapshot, a local folder, a GGUF file, or a generated tiny
model. Everything here ends in the same place: a plain HF checkpoint folder (config.json, safetensors,
tokenizer files) that `convert` reads."""

from __future__ import annotations

# Files a fast tokenizer (plus its chat template) can come from; any present are carried along.
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)

# The weight file names transformers' from_pretrained looks for (single file, shards, shard index).
# Narrower than *.safetensors on purpose: some repos also ship e.g. consolidated.safetensors, a second copy
# of the weights in another layout.
SAFETENSORS_WEIGHTS: tuple[str, ...] = ("model*.safetensors", "model.safetensors.index.json")
PICKLE_WEIGHTS: tuple[str, ...] = ("pytorch_model*.bin", "pytorch_model.bin.index.json")
