"""The ops' Triton kernels and their host wrappers, one module per kernel (an op may have two).

Each module implements the torch reference of its op module (``epserve/kernels/<op>.py``, the
definition) and is imported by that op's entry lazily, only when ``dispatch.use_triton`` says the
kernel runs. A module here imports ``triton``, ``torch``, ``epserve.kernels.dispatch`` and sibling
modules of this package (a fused kernel runs its parts' programs inline), never an op module.
Importing one imports triton; kernels decorated while ``TRITON_INTERPRET=1`` is set run in the
Triton interpreter (CPU tensors allowed), and each module's ``INTERPRETED`` says which it got.
Nothing is imported here: ``from epserve.kernels.triton.<name> import ...`` reads ``sys.modules``
(tests swap interpreted copies in there).
"""
