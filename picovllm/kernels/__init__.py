"""Triton kernels for the GPU fast path.

One module per kernel kind; each launcher has a torch reference (in picovllm.layers, or beside
the launcher) that is its test oracle and the CPU path. Importing this package needs triton.
Under TRITON_INTERPRET=1 the kernels also run on CPU tensors (slowly), which is how CI tests them.
"""
