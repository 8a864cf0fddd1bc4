"""estimate-memory: a training step's peak memory, predicted on the CPU.

estimator.py         the estimate itself (the run built on fake tensors, one step replayed
                     through the memory model) and the advice search
memory_internals.py  the PyTorch internals the memory model reads (allocator rounding,
                     the fake-tensor mode), behind one module
"""
