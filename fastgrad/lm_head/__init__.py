"""The LM-head family's kernel-level package: what the three LM-head kernels share.

The family is three ops over one loop — ``fused_linear_online_max_sum`` (the forward statistics),
``fused_linear_cross_entropy_loss_grad`` (the FLCE grad) and the training loss
``linear_cross_entropy`` — planned by :mod:`fastgrad.tiling` (the op_host layer: ``LinearCETiling``,
``TrainingPlan``, the GEMM choice ``GemmChoice``) and entered through their kernels in
``fastgrad/kernels/`` (the ``"cpu"`` backend's table).  Here, below the op layer, under the
kernels' rules (``tests/test_architecture.py``: no settings, no registry, no torch):

``plan_types``
    The plans' types (``LinearCETiling``, ``TrainingPlan``, ``GemmChoice``, ``Buffer``...), made by
    ``fastgrad.tiling`` (which re-exports them) and taken by the kernels; imports nothing of fastgrad's.
``engine``
    The GEMM choice's capability: which engines and native-kernel variants a dtype can run
    (``resolve``), read by the op layer through ``backends/cpu.py``; the plan records the choice.
``loop``
    The loop and its operands: ``Workspace`` (the plan's buffers by name), ``Operands`` (the only
    GEMM caller of the vocabulary-major epilogues), the vocabulary-major ``run`` and the row-block
    ``run_row_blocks`` with their staged ``Sweep`` (a dependency graph of what each step reads and
    writes).
``params``
    The training loss's parameters as its kernel takes them: ``kernel_arrays`` (``LossParams`` as
    the passes' ``par``/``flags``, filled in one place) and the named bundles ``GradOutputs``,
    ``RowCoefficients``, ``PassConstants``.
``passes``
    The training loss's Numba passes (softmax gradient, statistics, filtering's kept blocks).
``epilogues.train_rows``
    The training loss's row blocks: statistics and gradient sweeps, the fused ``precision="fast"``
    path, gradient filtering.
``epilogues.recompute``
    The training loss's vocabulary-major recompute of the gradient from a saved log-sum-exp.
``epilogues.flce_grad``, ``epilogues.online_stats``
    The aclnn ops' epilogues (``FlceGrad``, ``OnlineStats``); their entry points stay in
    ``kernels/`` (the ``"cpu"`` backend's table).

Every component declares the buffers it takes (a ``buffers(...)`` beside its code); the plan's
buffer list is their concatenation (``tiling.lm_head_buffers`` / ``training_buffers``) and the
component takes them by name only (``loop.Workspace``).
"""
