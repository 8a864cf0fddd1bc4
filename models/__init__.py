"""Native decoder models, presets and HF checkpoint mapping."""
