"""estimate-memory: a training step's peak memory, predicted on the CPU.

estimator.py         the estimate itself: the run built on fake tensors, one step run under
                     the memory model
tracker.py           the memory model: storages by category, the step's segments and peaks
depth.py             a deep model of repeating blocks from two short ones, exactly
fit/                 whether it fits: capacity, the ladder, the advice, train's pre-flight,
                     the printed tables (one module each)
memory_internals.py  the PyTorch internals the memory model reads (fake tensors, the fake
                     process group, storage resizes), behind one module
"""
