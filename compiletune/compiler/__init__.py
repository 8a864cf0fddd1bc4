"""What the compiler does to a run.

regions.py      the compiled regions (one per block kind, the loss head) and their options
backend.py      the inductor backend that runs our graph passes (passes/) on each graph
activation.py   the activation policies (--ac) and eager checkpointing
graph_dump.py   --dump-graphs: what each pass matched and what the graphs hold
"""
