"""compiletune's custom ops: opaque to the compiler, each with its own autograd formula or kernel.

fused_loss.py   compiletune::linear_cross_entropy*: output projection + cross-entropy in
                chunks of tokens, full logits never exist (`--loss fused`)
triton_ce.py    the fused head's row-wise steps as Triton kernels (CUDA)
host_copy.py    compiletune::offload_to_host / reload_from_host: a saved activation copied
                to host memory and back (`--offload-activations`)
grouped_mm.py   compiletune::grouped_mm: rows grouped by expert times each expert's weight
                (MoE layers); torch._grouped_mm where the GPU has it, else an exact fallback
gated_delta.py  compiletune::gated_delta_rule: Gated DeltaNet linear attention in chunks, with
                its own backward and state resets at document boundaries (Qwen3-Next, Qwen3.5)
cpu_kernels.py  the 8-bit AdamW step as one C++ kernel per CPU parameter (`--optim adamw8bit`)
op_memory.py    what each op holds inside itself, declared beside it, for the memory estimate
"""
