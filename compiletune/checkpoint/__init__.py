"""What a run writes and reads back.

atomic.py       folders written under a temporary name and renamed when complete
steps.py        step_N checkpoints (one process and FSDP-sharded), resume checks, convert
adapter_io.py   PEFT adapter folders and the merged model of a LoRA run
"""
