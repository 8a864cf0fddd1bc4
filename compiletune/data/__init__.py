"""What the model reads, from the user's files to the batches of a step.

    sources.py      reading --data: files, folders, shards, save_to_disk, the HF cache; the
                    layouts (text, prompt/completion, messages, ShareGPT, alpaca) and their checks
    tokenizer.py    loading the tokenizer (and the byte tokenizer of the debug models)
    token_cache.py  tokenising once into an on-disk entry that proves its integrity
    images.py       image conversations: content parts, where each image comes from (a file,
                    a row's image column), reading it; image_tokens.py: the processor expands
                    the images into their tokens; image_batch.py: a batch's pixels, prepared
                    from the cached references when the batch is taken
    token_store.py  the tokenised documents (in memory or memory-mapped) and their rows: whole
                    examples packed best-fit, or one stream cut into rows
    rows.py         examples -> rows -> batches: held-out splits, mixtures, the target checks
    pairs.py        preference pairs (DPO) and their rows
    corpus.py       the embedded default corpus (Python's own docstrings)

Imports run one way: sources <- token_cache <- rows; pairs reads through sources and rows.
"""
