"""The names of the torch custom ops the Triton kernels register (``kernels/triton_attention.py``,
``kernels/triton_ops.py``): dispatcher-visible, so a selective checkpoint (``kernels.checkpoint_policy``) can keep
their outputs. A module of their own, below both the kernels that define the ops and the policy that names them."""
SPARSE_ATTENTION_OP = "csa2::sparse_attention"
INDEXER_SELECT_OP = "csa2::indexer_select"
