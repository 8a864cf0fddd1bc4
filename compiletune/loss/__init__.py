"""Loss formulas.

head.py         the LM head and its loss: fused (no logits), chunked or plain
objectives.py   the objectives' formulas on per-token log-probs: DPO and its variants, KD
"""
