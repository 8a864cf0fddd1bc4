"""Native vision towers of the vision-language checkpoints, beside the decoder.

Each tower turns pixels into the decoder's image-token embeddings and loads from / saves to its
checkpoint's own tensor names (a `NameMap` in the tower's module):

- `siglip`: Gemma 3's SigLIP encoder and multi-modal projector;
- `qwen`: Qwen3.5's vision transformer (dynamic resolution, 2-D rotary positions, patch merger)
  and the 3-D (mrope) text positions its images give the decoder;
- `gemma4`: Gemma 4's image encoder (aspect-ratio preserving padded patches, 2-D rotary
  positions, position-wise pooling) and its embedder into the text width;
- `lora`: LoRA on a tower's linear projections, named as transformers' model (and PEFT) name
  them (`--lora-targets vision.NAME`).

Plain PyTorch like `models/decoder.py`: no compile, checkpointing or sharding here. The decoder
with its family's tower, and the image-token merge, is `model` (docs/models.md,
"Vision-language: status").
"""
